"""Is a runtime's batched path token-exact? The identical fraction of each runtime, measured.

For each runtime available here, two plans serve the same requests greedily: one request at a
time (the plan's defaults: sequential, one slot) and continuous batching with ``--concurrency``
in flight (a closed loop of as many clients). The identical fraction is the share of requests
whose token ids are the same both ways (:func:`fractal_opt.quality.probes.agreement_between`,
the number a batching step's reason quotes). Every request generates its whole budget
(end-of-sequence ignored), so a divergence anywhere in it counts.

Plans: transformers in float32; llama.cpp through the xllamacpp wheel on the embedded GGUF (Q4_1)
and on it widened to BF16; llama.cpp's native llama-server on BF16 when ``make setup-llama-native``
built it; vLLM when ``make setup-vllm`` made its environment and ``--vllm`` is given (its start
takes a minute or more). Each runtime declares ``batch_invariant`` in its capabilities table
(``fractal-opt passes --json``); this prints the declaration next to the measurement.

    python benchmarks/batch_invariance.py            # about 2.5 minutes on 2 cores (6 with --vllm)
    python benchmarks/batch_invariance.py --json     # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SUITES = ("default", "chat", "faq")  # short and long chat prompts, multi-turn chats, short questions


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def plans(*, vllm: bool) -> dict[str, Any]:
    """The one-at-a-time plan of each runtime available here, by label."""
    from fractal_opt.core.machine import cpu_flags
    from fractal_opt.runtimes.llama_cpp.process import NATIVE, executable_problem
    from fractal_opt.tower.plan import Plan

    base = Plan(source="smollm2-135m-instruct")
    llama = base.replace_section("hardware", runtime="llama_cpp")
    out = {"transformers, float32": base, "llama.cpp wheel, Q4_1 (the embedded GGUF)": llama,
           "llama.cpp wheel, BF16": llama.replace_section("hardware", dtype="bfloat16")}
    if executable_problem(NATIVE) is None and "avx512_bf16" in cpu_flags():
        out["llama.cpp native, BF16"] = llama.replace_section("hardware", runtime_path=NATIVE, dtype="bfloat16")
    if vllm:
        out["vLLM (CPU build)"] = base.replace_section("hardware", runtime="vllm")
    return out


def serve_all(plan: Any, requests: list, *, concurrency: int, tokens: int) -> dict[str, list[int]]:
    """Every request's greedy token ids through ``plan``'s server under a closed loop of ``concurrency``."""
    from fractal_opt.measure.load import build_items, run_load
    from fractal_opt.runtimes import build
    from fractal_opt.workloads.workload import LoadProfile

    engine = build(plan, progress=lambda m: None, max_new_tokens=tokens)
    try:
        profile = LoadProfile(concurrency=concurrency, requests=len(requests), ignore_eos=True, seed=0)
        with engine.server(ignore_eos=True) as server:
            result = run_load(server, build_items(requests, profile, default_tokens=tokens), profile)
        return {r.id: list(r.token_ids) for r in result.records if r.status == "done"}
    finally:
        engine.close()


def measure_runtime(plan: Any, requests: list, *, concurrency: int, tokens: int) -> dict[str, Any]:
    """One runtime: its one-at-a-time and batched answers, and the identical fraction."""
    from fractal_opt.engine.registry import RUNTIMES
    from fractal_opt.quality.probes import agreement_between

    alone = serve_all(plan, requests, concurrency=1, tokens=tokens)
    batched_plan = plan.replace_section("scheduling", batching="continuous", max_concurrency=concurrency)
    batched = serve_all(batched_plan, requests, concurrency=concurrency, tokens=tokens)
    return {"identical": agreement_between(alone, batched), "requests": len(alone),
            "identical_count": sum(batched.get(rid) == ids for rid, ids in alone.items()),
            "declared_batch_invariant": RUNTIMES.of(plan).batch_invariant}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight in the batched plan (and closed-loop clients)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per request (end-of-sequence ignored)")
    parser.add_argument("--vllm", action="store_true", help="also vLLM (needs make setup-vllm)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args()
    from fractal_opt.core.machine import Machine
    from fractal_opt.workloads.workload import Workload

    load_start = os.getloadavg()
    requests = [r for suite in SUITES for r in Workload(suite=suite).requests()]
    rows = {}
    for label, plan in plans(vllm=args.vllm).items():
        log(f"{label}: {len(requests)} requests one at a time, then {args.concurrency} in flight")
        try:
            rows[label] = measure_runtime(plan, requests, concurrency=args.concurrency, tokens=args.tokens)
        except Exception as e:  # a runtime that cannot start here is reported, the others still measured
            rows[label] = {"error": f"{type(e).__name__}: {e}"}
        log(f"{label}: {rows[label]}")
    machine = Machine.probe()
    out = {"identical_fraction": rows, "suites": list(SUITES), "tokens": args.tokens, "concurrency": args.concurrency,
           "machine": f"{machine.cpu}, {machine.physical_cores} physical cores", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "load_average": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]}}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"# {out['machine']}, {out['date']}, load average {load_start[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"# {len(requests)} requests ({', '.join(SUITES)} suites), {args.tokens} greedy tokens each, {args.concurrency} in flight when batched\n")
    print("| runtime | declared batch invariant | identical batched / one at a time |")
    print("|---|---|---|")
    for label, r in rows.items():
        got = r.get("error") or f"{r['identical_count']}/{r['requests']} ({r['identical']:.2f})"
        print(f"| {label} | {r.get('declared_batch_invariant', '–')} | {got} |")
    return 0


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    sys.exit(main())
