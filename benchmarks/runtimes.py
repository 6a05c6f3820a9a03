"""The runtimes table of docs/runtimes.md: transformers baseline and best, llama.cpp tuned, vLLM, in one run.

Two measurements, each with every plan interleaved round by round (the order rotates every
round, so load from other processes falls on all plans alike), through the one measurement
runner (:class:`fractal_opt.measure.runner.Runner`, the same rounds the pipeline measures):

1. **Under load**: the chatbot recipe's workload and load profile (``recipes/chatbot.yaml``: the
   chat suite, 8 closed-loop clients, 16 requests per round, output budgets 16/32/48 drawn per
   request, greedy, end-of-sequence honoured) through each engine's ``server()``: aggregate output
   tokens/s (median over rounds), TTFT p50 / p90 and ITL p50 (pooled over rounds; TTFT as a
   streaming caller sees it, queueing included).
2. **One request at a time**: the default suite (3 short + 3 long prompts), 32 new tokens, each
   plan's hardware and model settings with sequential scheduling (one llama.cpp slot; vLLM's
   server with one request in flight): decode tokens/s and TTFT (medians over requests x rounds;
   TTFT also for short and long prompts apart, two populations).

Plans: (1) transformers baseline (the Plan defaults: fp32, sequential); (2) transformers best (the
chatbot recipe's kept scheduling pass: continuous batching, max_concurrency 8); (3) llama_cpp
tuned: continuous, max_concurrency 8, threads auto, the best by load throughput of a few llama.cpp
settings (f16 KV; f16 KV + flash attention on; f16 KV on 1 thread; q8_0 KV (kv_backend native)
+ flash attention on; the GGUF widened to BF16 + flash attention on; and, when ``make
setup-llama-native`` has built llama-server for this CPU, that build as a child process on the
embedded Q4_1 and on BF16 weights), all printed; (4) with ``--vllm``: vLLM fp32 on the CPU, continuous, max_concurrency 8, threads auto,
measured alone after the others are closed (its server process is the heavy one), with the
transformers best plan measured again next to it so its ratio has a same-window reference.

Prints both tables, the project's ratios (llama_cpp tuned throughput / transformers best, target
>= 3x; llama_cpp single-request decode / transformers baseline, target >= 5x) as ratios of the
medians and as paired estimates with their t intervals over rounds, the load average at start and end,
and the versions. Exits 1 when a target is missed.

    python benchmarks/runtimes.py                  # 3 rounds: about 10 minutes on 2 busy CPU cores
    python benchmarks/runtimes.py --vllm           # + vLLM: about 3-4 minutes more (its start is ~80 s)
    python benchmarks/runtimes.py --quick          # 1 round, 8 requests under load: a smoke run, ~3-4 minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

THROUGHPUT_TARGET = 3.0  # the project's aim: llama_cpp tuned / transformers best under the chatbot load
DECODE_TARGET = 5.0  # the project's aim: llama_cpp / transformers baseline, single-request decode tokens/s
SINGLE_TOKENS = 32  # the default suite's budget in docs/runtimes.md's table (and recipes/quickstart.yaml)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("torch", "transformers", "xllamacpp"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} absent")
    return ", ".join(out)


def plans(*, concurrency: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(transformers plans, llama.cpp candidate plans), by the label the tables print."""
    from fractal_opt.tower.plan import Plan

    base = Plan(source="smollm2-135m-instruct")
    continuous = {"batching": "continuous", "max_concurrency": concurrency}
    tf = {"transformers baseline": base, "transformers best": base.replace_section("scheduling", **continuous)}
    llama = base.replace_section("hardware", runtime="llama_cpp", threads="auto").replace_section("scheduling", **continuous)
    candidates = {
        "llama_cpp f16 KV": llama,
        "llama_cpp f16 KV, flash attn": llama.replace_section("hardware", flash_attention="on"),
        # One thread: on 2 cores shared with other work, llama.cpp's OpenMP barriers wait on a
        # descheduled second thread (measured here: 53 vs 38 decode tok/s one at a time).
        "llama_cpp f16 KV, 1 thread": llama.replace_section("hardware", threads=1),
        "llama_cpp q8_0 KV, flash attn": llama.replace_section("hardware", flash_attention="on").replace_section(
            "model", kv_cache="quantized", kv_bits=8, kv_backend="native"),
        # No Q8_0 copy of the embedded Q4_1: the weight ladder refuses to "quantize up" (the same
        # information in more bytes, docs/models.md); BF16 is the 16-bit copy the quickstart keeps.
        "llama_cpp BF16 weights, flash attn": llama.replace_section("hardware", flash_attention="on", dtype="bfloat16"),
    }
    from fractal_opt.runtimes.llama_cpp.process import NATIVE, executable_problem

    if (problem := executable_problem(NATIVE)) is not None:
        log(f"no native llama-server candidates: {problem}")
        return tf, candidates
    # llama-server built for this CPU (make setup-llama-native), as a child process. BF16 weights:
    # the embedded Q4_1 blocks widened to bfloat16 (the dtype pass; within 2^-9 of the stored
    # values), which AVX512_BF16 multiplies fast and the wheel's AVX2 build does not.
    native = llama.replace_section("hardware", flash_attention="on", runtime_path=NATIVE)
    candidates.update({
        "llama_cpp native, flash attn": native,
        "llama_cpp native, BF16 weights, flash attn": native.replace_section("hardware", dtype="bfloat16"),
    })
    return tf, candidates


def sequential(plan: Any) -> Any:
    """The plan's hardware and model settings, one request at a time."""
    from fractal_opt.tower.plan import SchedulingPlan

    return dataclasses.replace(plan, scheduling=SchedulingPlan())


def interleaved(engines: dict[str, Any], workload: Any, *, requests: Sequence[Any] | None = None) -> dict[str, Any]:
    """Measure every engine on ``workload``, round by round, the order rotating each round (the
    generalization of ``measure_pair``'s A B / B A to more than two plans)."""
    from fractal_opt.measure.runner import Runner

    reqs = list(requests if requests is not None else workload.requests())
    runners = {name: Runner(engine, workload, reqs) for name, engine in engines.items()}
    for name, runner in runners.items():
        log(f"warm-up: {name}")
        runner.warm_up()
    names = list(runners)
    for r in range(workload.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            t0 = time.perf_counter()
            runners[name].round()
            log(f"round {r + 1}/{workload.repeats} {name}: {time.perf_counter() - t0:.1f} s")
    return {name: runner.result() for name, runner in runners.items()}


def build_all(plans_by_name: dict[str, Any], *, max_new_tokens: int, machine: Any) -> dict[str, Any]:
    from fractal_opt.runtimes import build

    engines = {}
    for name, plan in plans_by_name.items():
        t0 = time.perf_counter()
        engines[name] = build(plan, machine=machine, progress=log, max_new_tokens=max_new_tokens)
        log(f"built {name} in {time.perf_counter() - t0:.1f} s")
    return engines


def close_all(engines: dict[str, Any]) -> None:
    from fractal_opt.runtimes import clear_cache

    for engine in engines.values():
        engine.close()
    clear_cache()


def settings_of(engine: Any) -> str:
    """What the runtime was loaded with, in a few words."""
    p = engine.plan
    s = p.scheduling
    sched = "sequential" if s.batching == "sequential" else f"{s.batching}, {s.max_concurrency} in flight"
    if p.hardware.runtime == "llama_cpp":
        st = engine.settings
        where = "llama-server child process" if st.executable else "xllamacpp in process"
        return (f"{sched}; {where}, {os.path.basename(st.model_path)}, {st.threads or engine.threads} threads, {st.slots} slot(s), "
                f"KV {st.cache_type} x {st.kv_tokens} tokens, flash attn {st.flash_attention}")
    if p.hardware.runtime == "vllm":
        flags = " ".join(engine.args) or f"the server at {p.hardware.runtime_url}"
        return f"{sched}; {flags}; threads {p.hardware.threads}"
    return f"{sched}; {p.hardware.dtype}, {p.hardware.attention}, {engine.threads} torch threads"


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


def load_table(results: dict[str, Any], engines: dict[str, Any]) -> list[str]:
    lines = ["| plan | settings | output tok/s (median of rounds) | rounds | TTFT p50 / p90 ms | ITL p50 ms | tokens / round | hit budget |",
             "|---|---|---|---|---|---|---|---|"]
    for name, m in results.items():
        s = m.summary()
        per_round = [r["throughput_tokens_per_s"] for r in m.repeats]
        tokens = [r.get("load", {}).get("output_tokens") for r in m.repeats]
        lines.append(f"| {name} | {settings_of(engines[name])} | {fmt(s['throughput_tokens_per_s'])} | {' '.join(fmt(v) for v in per_round)} | "
                     f"{fmt(s['ttft_ms_p50'], '.0f')} / {fmt(s['ttft_ms_p90'], '.0f')} | {fmt(s['itl_ms_p50'])} | "
                     f"{' '.join(str(t) for t in tokens)} | {s['hit_cap']:.0%} |")
    return lines


def ttft_of(m: Any, kind: str) -> float | None:
    vals = [s.ttft_ms for s in m.samples if s.request_id.startswith(kind) and s.ttft_ms is not None]
    return statistics.median(vals) if vals else None


def single_table(results: dict[str, Any], engines: dict[str, Any]) -> list[str]:
    lines = ["| plan (one request at a time) | settings | decode tok/s (median) | TTFT ms (median) | TTFT short / long ms | e2e ms (median) |",
             "|---|---|---|---|---|---|"]
    for name, m in results.items():
        s = m.summary()
        lines.append(f"| {name} | {settings_of(engines[name])} | {fmt(s['decode_tokens_per_s'])} | {fmt(s['ttft_ms'], '.0f')} | "
                     f"{fmt(ttft_of(m, 'short'), '.0f')} / {fmt(ttft_of(m, 'long'), '.0f')} | {fmt(s['e2e_ms'], '.0f')} |")
    return lines


def ratio(results_a: Any, results_b: Any, metric: str) -> tuple[float | None, str]:
    """(b / a of the medians, the paired estimate with its t interval over rounds, as text)."""
    from fractal_opt.measure.runner import paired_changes

    a, b = results_a.median(metric), results_b.median(metric)
    of_medians = b / a if a and b else None
    interval = paired_changes(results_a, results_b, [metric]).get(metric)
    paired = (f"paired {1 + interval.change:.2f}x [{1 + interval.low:.2f}, {1 + interval.high:.2f}] over {interval.pairs} pairs"
              if interval is not None else "paired: no pairs")
    return of_medians, paired


def check(label: str, value: float | None, target: float, paired: str) -> bool:
    ok = value is not None and value >= target
    print(f"{'PASS' if ok else 'FAIL'} {label}: {fmt(value, '.2f')}x of the medians ({paired}); target >= {target:g}x")
    return ok


def measure_vllm(args: argparse.Namespace, load_wl: Any, single_wl: Any, machine: Any, tf_best: Any, concurrency: int) -> list[str]:
    """vLLM under the load profile (next to transformers best again) and one request at a time."""
    from fractal_opt.core.errors import EngineError
    from fractal_opt.runtimes.vllm.process import find_executable
    from fractal_opt.tower.plan import Plan

    try:
        exe = find_executable(None)
    except EngineError as e:  # vLLM is optional: say why it was not measured
        return [f"vLLM skipped: no vLLM environment ({e}); scripts/setup-vllm.sh creates it"]
    plan = (Plan(source="smollm2-135m-instruct").replace_section("hardware", runtime="vllm", threads="auto")
            .replace_section("scheduling", batching="continuous", max_concurrency=concurrency))
    lines = [f"vLLM: {exe}"]
    engines = build_all({"vllm": plan, "transformers best": tf_best}, max_new_tokens=load_wl.max_new_tokens, machine=machine)
    try:
        lines.append(f"vllm start-up (process, weights, KV cache): {engines['vllm'].load_s:.0f} s")
        load = interleaved(engines, load_wl)
        lines += ["", "Under the chatbot load, vLLM next to transformers best (same window):", *load_table(load, engines)]
        r, paired = ratio(load["transformers best"], load["vllm"], "throughput_tokens_per_s")
        lines.append(f"vllm / transformers best throughput: {fmt(r, '.2f')}x of the medians ({paired})")
        # One request in flight on the same server: a sequential plan pointed at its URL starts nothing.
        seq = sequential(plan).replace_section("hardware", runtime_url=engines["vllm"].client.base_url)
        single_engines = build_all({"vllm": seq}, max_new_tokens=SINGLE_TOKENS, machine=machine)
        single = interleaved(single_engines, single_wl)
        lines += ["", *single_table(single, single_engines)]
        lines.append("(vllm single: the continuous server above with one request in flight: a sequential plan on its URL)")
    finally:
        close_all(engines)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per plan and measurement (after one warm-up)")
    parser.add_argument("--vllm", action="store_true", help="also measure vLLM (fp32 CPU); starts `vllm serve`, ~80 s")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 8 requests per load round")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    load_start = os.getloadavg()

    from fractal_opt.core.machine import Machine
    from fractal_opt.language.recipe import load_recipe
    from fractal_opt.workloads.workload import Workload

    machine = Machine.probe()
    chatbot = load_recipe(ROOT / "recipes" / "chatbot.yaml").workload
    profile = chatbot.load_profile()
    load = dict(chatbot.load)
    if args.quick:
        load["requests"] = 8
    load_wl = dataclasses.replace(chatbot, repeats=rounds, max_repeats=None, load=load)
    single_wl = Workload(suite="default", max_new_tokens=SINGLE_TOKENS, repeats=rounds)
    concurrency = profile.concurrency
    tf, candidates = plans(concurrency=concurrency)
    out = [f"# runtimes benchmark: {versions()}; {os.cpu_count()} logical CPUs, {machine.physical_cores} physical cores",
           f"# load average at start: {tuple(round(x, 2) for x in load_start)}",
           f"# under load: recipes/chatbot.yaml workload (suite {load_wl.suite}, {load}), {rounds} round(s) + warm-up, interleaved",
           f"# one at a time: default suite, {SINGLE_TOKENS} new tokens, {rounds} round(s) + warm-up, interleaved"]
    print("\n".join(out), flush=True)

    engines = build_all({**tf, **candidates}, max_new_tokens=load_wl.max_new_tokens, machine=machine)
    try:
        under_load = interleaved(engines, load_wl)
        best = max(candidates, key=lambda n: under_load[n].median("throughput_tokens_per_s") or 0.0)
        single_plans = {"transformers baseline": tf["transformers baseline"], **{n: sequential(candidates[n]) for n in candidates}}
        close_all(engines)
        single_engines = build_all(single_plans, max_new_tokens=SINGLE_TOKENS, machine=machine)
        try:
            one_by_one = interleaved(single_engines, single_wl)
            single_lines = single_table(one_by_one, single_engines)
        finally:
            close_all(single_engines)
    finally:
        close_all(engines)

    print("\n## Under the chatbot load profile (8 closed-loop clients)\n")
    print("\n".join(load_table(under_load, engines)))
    print(f"\nllama_cpp tuned = {best!r} (highest median load throughput of the llama.cpp settings above; the pick and the ratio use the same rounds)")
    print("\n## One request at a time (default suite, 32 new tokens)\n")
    print("\n".join(single_lines))
    print("(transformers best differs from the baseline only in scheduling, so one at a time it is the baseline plan)\n")

    tput, tput_paired = ratio(under_load["transformers best"], under_load[best], "throughput_tokens_per_s")
    dec, dec_paired = ratio(one_by_one["transformers baseline"], one_by_one[best], "decode_tokens_per_s")
    cb, cb_paired = ratio(under_load["transformers baseline"], under_load["transformers best"], "throughput_tokens_per_s")
    print(f"transformers best / baseline throughput under load: {fmt(cb, '.2f')}x ({cb_paired})")
    ok = check(f"llama_cpp tuned ({best}) / transformers best, throughput under load", tput, THROUGHPUT_TARGET, tput_paired)
    ok = check(f"llama_cpp tuned ({best}, one slot) / transformers baseline, single-request decode", dec, DECODE_TARGET, dec_paired) and ok

    print(f"\n# load average after the transformers and llama.cpp plans: {tuple(round(x, 2) for x in os.getloadavg())}", flush=True)
    if args.vllm:
        print("\n## vLLM\n")
        print("\n".join(measure_vllm(args, load_wl, single_wl, machine, tf["transformers best"], concurrency)))
    print(f"\n# load average at end: {tuple(round(x, 2) for x in os.getloadavg())} (start {tuple(round(x, 2) for x in load_start)})")
    return 0 if ok else 1


if __name__ == "__main__":  # vLLM's engine spawns processes: keep the guard
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    sys.exit(main())
