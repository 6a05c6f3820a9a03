"""Placement on this machine: a model split over rpc-servers, vLLM's tensor parallel, and replicas behind a router.

Three measurements of the embedded SmolLM2-135M-Instruct, widened to BF16 (the Q4_1 file's kernels
fail the quality gate on some CPUs: docs/runtimes.md) on llama.cpp's native llama-server
(``make setup-llama-native``), printed as one JSON object:

1. ``llama_cpp_rpc``: the plan in one llama-server process against the same plan split over 2
   llama.cpp rpc-servers on loopback (``split: {rpc_workers: 2}``, each on a core of its own):
   decode tokens/s and TTFT (the default suite's first 4 requests, 32 tokens, one at a time,
   rounds interleaved through the one measurement runner), ``kl_mean`` exact (the split plan's
   exact log-probabilities of the one-process plan's top-256 tokens, 256 positions of the
   reference text: quality.probes), and ``paris``: whether the split plan answers the README's
   question with Paris.
2. ``vllm_tp2``: vLLM's CPU build at tensor parallel 1 (decode, TTFT) against 2: the recipe check's
   refusal from the model's heads, and what ``vllm serve -tp 2`` itself says when started anyway;
   and the split this model allows, pipeline parallel 2 (each rank on a core of its own), measured
   beside tensor parallel 1 (``pp2``), or why it did not start.
3. ``replicas``: 1 replica on 1 core against 2 replicas on 1 core each behind HAProxy: capacity
   under recipes/cpu-serving.yaml's SLOs (TTFT p90 <= 4 s, time per output token p90 <= 1 s, under
   1% failed) with its chat load (closed loop, 16-48 output tokens), the search from 8 clients;
   each plan searched ``--capacity-rounds`` times, alternating; ``scaling_efficiency`` = the
   median capacity of 2 over twice that of 1 (expected >= 0.8).

    python benchmarks/placement.py --json                 # the whole run (about 15 minutes on 2 cores)
    python benchmarks/placement.py --json --quick         # 1 round each, no vLLM: a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUESTION = "What is the capital of France?"  # the README's question
SLOS = {"slo_ttft_ms": 4000.0, "slo_tpot_ms": 1000.0}  # recipes/cpu-serving.yaml's TTFT p90 and ITL p90 limits
EFFICIENCY_TARGET = 0.8
_VLLM_START_S = 300  # a cold vllm serve took 81 s on this 2-core box; its refusal comes sooner


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _r(v: float | None, digits: int = 3) -> float | None:
    return None if v is None else round(v, digits)


def base_plan() -> Any:
    from fractal_opt.layers.hardware import Runtime
    from fractal_opt.tower.plan import Plan

    return Runtime(backend="llama_cpp", path="native", dtype="bfloat16").apply(Plan(source="smollm2-135m-instruct"))


def interleaved(runs: dict[str, tuple[Any, Any]]) -> dict[str, Any]:
    """Each (engine, workload) measured by the one runner, round by round, the order rotating each round."""
    from fractal_opt.measure.runner import Runner

    runners = {key: Runner(engine, workload, workload.requests()) for key, (engine, workload) in runs.items()}
    for runner in runners.values():
        runner.warm_up()
    keys = list(runners)
    for r in range(max(w.repeats for _, w in runs.values())):
        for key in keys[r % len(keys):] + keys[: r % len(keys)]:
            runners[key].round()
            log(f"round {r + 1} {key}: {runners[key].repeats[-1].get('throughput_tokens_per_s')} tokens/s")
    return {key: runner.result() for key, runner in runners.items()}


def llama_reference(engine: Any, k: int = 256, positions: int = 256) -> Any:
    """The one-process plan's top-``k`` next-token log-probabilities over the reference text (llama.cpp's n_probs:
    its full softmax, so the rest's mass is known) and its exact NLL of each next token: what quality.probes compares to."""
    import torch

    from fractal_opt.quality.probes import Reference
    from fractal_opt.quality.reference import reference_text

    ids = torch.tensor(engine.encode(reference_text()), dtype=torch.long)[: positions + 1]  # the probes' own reference text
    rows = engine.top_logprobs(ids.tolist()[:-1], k=k)
    top_ids = torch.tensor([sorted(row, key=row.get, reverse=True)[:k] for row in rows])
    top_lps = torch.tensor([[row[t] for t in tid] for row, tid in zip(rows, top_ids.tolist())], dtype=torch.float64)
    exact = engine.token_logprobs(ids.tolist()[:-1], [[int(t)] for t in ids[1:].tolist()])
    nll = torch.tensor([-row[int(t)] for row, t in zip(exact, ids[1:].tolist())])
    return Reference(token_ids=ids, top_ids=top_ids, top_logprobs=top_lps, token_nll=nll, outputs={}, top_k_positions=positions)


def rpc_part(machine: Any, repeats: int) -> dict[str, Any]:
    from fractal_opt.layers.placement import Split
    from fractal_opt.quality.probes import model_probes
    from fractal_opt.runtimes import build
    from fractal_opt.workloads.workload import Workload

    wl = Workload(suite="default", limit=4, max_new_tokens=32, repeats=repeats)
    plans = {"one_process": base_plan(), "split_2_rpc_servers": Split(rpc_workers=2).apply(base_plan())}
    engines = {name: build(plan, machine=machine, progress=log, max_new_tokens=wl.max_new_tokens) for name, plan in plans.items()}
    measured = interleaved({name: (engine, wl) for name, engine in engines.items()})
    out: dict[str, Any] = {name: {"decode_tokens_per_s": _r(m.median("decode_tokens_per_s"), 1), "ttft_ms": _r(m.median("ttft_ms"), 1)}
                           for name, m in measured.items()}
    one, split = engines["one_process"], engines["split_2_rpc_servers"]
    one.activate()
    reference = llama_reference(one)
    split.activate()
    probes = model_probes(reference, split)
    out["kl_mean"], out["kl_method"], out["top1_flip"] = probes["kl_mean"], probes["kl_method"], probes["top1_flip"]
    answer = split.generate(QUESTION)
    out["answer"], out["paris"] = answer, "Paris" in answer
    out["decode_ratio"] = _r(out["split_2_rpc_servers"]["decode_tokens_per_s"] / out["one_process"]["decode_tokens_per_s"]) \
        if out["one_process"]["decode_tokens_per_s"] else None
    out["processes"] = {"split_2_rpc_servers": len(split.server_pids())}
    return out


def vllm_part(machine: Any, repeats: int) -> dict[str, Any]:
    from fractal_opt.layers.hardware import Runtime
    from fractal_opt.layers.placement import Split
    from fractal_opt.runtimes import build
    from fractal_opt.runtimes.vllm.engine import VllmEngine
    from fractal_opt.runtimes.vllm.engine_args import engine_args, server_env
    from fractal_opt.runtimes.vllm.process import find_executable
    from fractal_opt.tower.plan import Plan
    from fractal_opt.weights.models import materialize, resolve
    from fractal_opt.workloads.workload import Workload

    tp1 = Runtime(backend="vllm").apply(Plan(source="smollm2-135m-instruct")).replace_section("hardware", dtype="bfloat16", threads=machine.physical_cores)
    tp2 = Split(tensor=2).apply(tp1)
    out: dict[str, Any] = {"tp2_refused": VllmEngine.refuse(tp2)}
    try:
        exe = find_executable(None)
    except Exception as e:  # noqa: BLE001  (no vLLM here: said, not raised)
        return {**out, "tp1": None, "tp2": None, "reason": f"no vLLM to run: {e}"}
    # What vLLM itself says of -tp 2 on this model, started past the refusal.
    folder = materialize(resolve(tp2.source), progress=log)
    command = [str(exe), "serve", folder, "--host", "127.0.0.1", "--port", "18931", *engine_args(tp2)]
    env = {**os.environ, **server_env(tp2, physical_cores=machine.physical_cores)}
    log(f"starting {' '.join(command[1:3])} with -tp 2 past the refusal, to record vLLM's own answer")
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=_VLLM_START_S)
        said = [line for line in (run.stdout + run.stderr).splitlines() if "divisible" in line or "Error" in line]
        out["tp2_vllm_says"] = said[-1].strip()[-400:] if said else f"exited with status {run.returncode}"
    except subprocess.TimeoutExpired:
        out["tp2_vllm_says"] = f"still starting after {_VLLM_START_S} s (stopped)"
    wl = Workload(suite="default", limit=4, max_new_tokens=32, repeats=repeats)
    from fractal_opt.runtimes.vllm import clear_cache

    # The split this model allows on 2 cores: its 30 layers over 2 pipeline ranks, one core each.
    pp2 = Split(pipeline=2).apply(tp1)
    try:
        m = interleaved({"tp1": (build(tp1, machine=machine, progress=log, max_new_tokens=wl.max_new_tokens), wl)})["tp1"]
        out["tp1"] = {"decode_tokens_per_s": _r(m.median("decode_tokens_per_s"), 1), "ttft_ms": _r(m.median("ttft_ms"), 1)}
    finally:
        clear_cache()
    engine = None
    try:
        engine = build(pp2, machine=machine, progress=log, max_new_tokens=wl.max_new_tokens)
        m = interleaved({"pp2": (engine, wl)})["pp2"]
        out["pp2"] = {"decode_tokens_per_s": _r(m.median("decode_tokens_per_s"), 1), "ttft_ms": _r(m.median("ttft_ms"), 1)}
    except Exception as e:  # noqa: BLE001  (vLLM's own failure to run a pipeline split here is the measured answer)
        tail = engine.process.log_tail(40) if engine is not None and engine.process is not None else ""
        cause = [line.strip() for line in tail.splitlines() if "Error" in line or "error" in line]
        out["pp2"] = {"failed": f"{type(e).__name__}: {e}"[-600:], "vllm_log": cause[-3:]}
    finally:
        clear_cache()
    out["tp2"] = None
    out["reason"] = f"tensor parallel 2 cannot run this model: {out['tp2_refused']}"
    return out


def capacity_search(engine: Any, wl: Any, profile: Any) -> dict[str, Any]:
    """One bracketing search of the plan's capacity under SLOS (each probe a fresh server over the same replicas)."""
    from fractal_opt.measure.capacity import CapacitySearch
    from fractal_opt.measure.load import build_items, run_load

    def probe(p: Any) -> Any:
        engine.activate()
        t0 = time.perf_counter()
        with engine.server(seed=wl.seed, ignore_eos=p.ignore_eos) as server:
            result = run_load(server, build_items(wl.requests(), p, default_tokens=wl.max_new_tokens), p)
        log(f"  probe {p.offered():g} clients: {time.perf_counter() - t0:.1f} s, ttft p90 {result.summary().get('ttft_ms_p90')} ms")
        return result

    return CapacitySearch(profile, run=probe).run()


def replicas_part(machine: Any, rounds: int) -> dict[str, Any]:
    from fractal_opt.language.recipe import load_recipe
    from fractal_opt.layers.placement import Replicas
    from fractal_opt.runtimes import build

    wl = load_recipe(ROOT / "recipes" / "cpu-serving.yaml").workload
    profile = dataclasses.replace(wl.load_profile(), capacity=True, capacity_max=64.0, requests=None, **SLOS)
    serving = base_plan().replace_section("scheduling", batching="continuous", max_concurrency=8)
    plans = {"1_replica_1_core": Replicas(count=1, cores=1).apply(serving), "2_replicas_1_core_each": Replicas(count=2, cores=1).apply(serving)}
    engines = {name: build(plan, machine=machine, progress=log, max_new_tokens=wl.max_new_tokens) for name, plan in plans.items()}
    searches: dict[str, list[dict[str, Any]]] = {name: [] for name in plans}
    keys = list(plans)
    for r in range(rounds):
        for key in keys[r % 2:] + keys[: r % 2]:
            log(f"capacity search {r + 1}/{rounds}: {key}")
            searches[key].append(capacity_search(engines[key], wl, profile))
            log(f"  {searches[key][-1]['answer']}")
    out: dict[str, Any] = {"slos": {"ttft_ms_p90": SLOS["slo_ttft_ms"], "tpot_ms_p90": SLOS["slo_tpot_ms"]}, "unit": "clients", "replicas": 2}
    for key, runs in searches.items():
        caps = [s["capacity"] for s in runs]
        out[key] = {"capacity": statistics.median(caps) if None not in caps else None, "capacities": caps,
                    "intervals": [s["interval"] for s in runs], "status": [s["status"] for s in runs],
                    "throughput_at_capacity": [next((p["throughput_tokens_per_s"] for p in s["probes"] if p["load"] == s["capacity"]), None) for s in runs]}
    one, two = out["1_replica_1_core"]["capacity"], out["2_replicas_1_core_each"]["capacity"]
    out["scaling_efficiency"] = _r(two / (2 * one)) if one and two else None
    out["meets_target"] = out["scaling_efficiency"] is not None and out["scaling_efficiency"] >= EFFICIENCY_TARGET
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="1 round each, no vLLM, 1 capacity search per plan")
    parser.add_argument("--capacity-rounds", type=int, default=2, help="capacity searches per replica plan (default 2)")
    parser.add_argument("--skip", action="append", default=[], choices=["rpc", "vllm", "replicas"], help="leave a part out")
    args = parser.parse_args()
    from fractal_opt.core.machine import Machine
    from fractal_opt.runtimes.llama_cpp.process import executable_problem

    if (problem := executable_problem("native")) is not None:
        print(f"placement: {problem}", file=sys.stderr)
        return 2
    machine = Machine.probe()
    out: dict[str, Any] = {"machine": {"cpu": machine.cpu, "physical_cores": machine.physical_cores}, "date": time.strftime("%Y-%m-%d %H:%M"),
                           "load_avg_before": [round(x, 2) for x in os.getloadavg()], "command": " ".join(["python", *sys.argv])}
    repeats = 1 if args.quick else 3
    if "rpc" not in args.skip:
        out["llama_cpp_rpc"] = rpc_part(machine, repeats)
        log(f"llama_cpp_rpc: {json.dumps(out['llama_cpp_rpc'])}")
    if "vllm" not in args.skip and not args.quick:
        try:
            out["vllm_tp2"] = vllm_part(machine, repeats)
        except Exception as e:  # noqa: BLE001  (recorded as this script's failure, apart from any reason vLLM gave)
            out["vllm_tp2"] = {"benchmark_error": f"{type(e).__name__}: {e}"[-2000:]}
        log(f"vllm_tp2: {json.dumps(out['vllm_tp2'])}")
    if "replicas" not in args.skip:
        out["replicas"] = replicas_part(machine, 1 if args.quick else args.capacity_rounds)
    out["load_avg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    raise SystemExit(main())
