"""One-by-one vs static vs continuous batching under load, on the embedded model.

Each mode serves the same requests (the default suite cycled, mixed output lengths drawn with a
fixed seed, end-of-sequence ignored so every mode generates the same number of tokens) under two
arrival processes: closed-loop (``--concurrency`` requests always in flight) and open-loop
Poisson arrivals (``--rate`` per second). It prints aggregate output tokens/s, TTFT / ITL
percentiles (TTFT as a streaming caller sees it: submission to first token, queueing included),
the throughput ratio to one-by-one serving, and how many requests got exactly the tokens
one-by-one serving gave them (greedy paths must agree).

    python benchmarks/scheduling.py                       # about 4-6 minutes on 2 CPU cores
    python benchmarks/scheduling.py --requests 8 --lengths 8 16   # a quick smoke run
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=16, help="requests per load run")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop clients, static batch size and continuous in-flight limit")
    parser.add_argument("--rate", type=float, default=0.6, help="Poisson arrivals per second")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 96], help="output lengths drawn per request")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--modes", nargs="+", default=["sequential", "static", "continuous"])
    parser.add_argument("--profiles", nargs="+", default=["closed", "poisson"])
    parser.add_argument("--prompts", choices=["all", "short"], default="all",
                        help="all: the default suite (3 short chat prompts and 3 of ~500 tokens); short: only the short ones (decode-bound)")
    parser.add_argument("--gqa", choices=["native", "repeat"], default="native",
                        help="native: fractal_opt's runtime (SDPA takes grouped K/V heads under a mask, CPU); repeat: transformers' default copy (repeat_kv), for comparison")
    args = parser.parse_args()

    import torch

    import fractal_opt.engine

    if args.gqa == "repeat":
        fractal_opt.engine.native_gqa_applies = lambda plan: False  # what plain transformers does

    from fractal_opt.measure.load import build_items, run_load
    from fractal_opt.runtimes import Engine
    from fractal_opt.tower.plan import HardwarePlan, Plan, SchedulingPlan
    from fractal_opt.workloads.workload import LoadProfile, Workload

    if args.threads:
        torch.set_num_threads(args.threads)
    requests = Workload(suite="default").requests()
    if args.prompts == "short":
        requests = [r for r in requests if r.id.startswith("short")]
    print(f"# scheduling benchmark: {args.model}, fp32, sdpa, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} logical CPUs, load average {os.getloadavg()[0]:.2f} at start")
    print(f"# grouped-query attention under a mask: {args.gqa}")
    print(f"# {args.requests} requests per run (default suite, {args.prompts} prompts, cycled), output lengths {args.lengths} (seeded, EOS ignored), "
          f"closed loop {args.concurrency} clients, Poisson {args.rate}/s\n")
    rows = []
    for mode in args.modes:
        sched = {"sequential": SchedulingPlan(), "static": SchedulingPlan(batching="static", batch_size=args.concurrency),
                 "continuous": SchedulingPlan(batching="continuous", max_concurrency=args.concurrency)}[mode]
        engine = Engine.build(Plan(source=args.model, hardware=HardwarePlan(attention="sdpa"), scheduling=sched), progress=lambda m: None,
                              max_new_tokens=max(args.lengths))
        warm = LoadProfile(concurrency=args.concurrency, requests=len(requests), output_tokens=(4,))
        with engine.server(ignore_eos=True) as server:  # every prompt shape through the kernels once
            run_load(server, build_items(requests, warm, default_tokens=4), warm)
        for kind in args.profiles:
            profile = LoadProfile(mode=kind, concurrency=args.concurrency, rate=args.rate if kind == "poisson" else None,
                                  requests=args.requests, output_tokens=tuple(args.lengths), ignore_eos=True, seed=0)
            items = build_items(requests, profile, default_tokens=max(args.lengths))
            t0 = time.perf_counter()
            with engine.server(ignore_eos=True) as server:
                result = run_load(server, items, profile)
            s = result.summary()
            s["tokens"] = {r.id: r.token_ids for r in result.records if r.status == "done"}
            rows.append((mode, kind, s))
            print(f"  {mode:10s} {kind:7s} {s['throughput_tokens_per_s']:7.1f} tok/s  done {s['done']}/{s['requests']}  "
                  f"TTFT p50/p90 {s['ttft_ms_p50']:.0f}/{s['ttft_ms_p90']:.0f} ms  ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    base = {kind: s["throughput_tokens_per_s"] for mode, kind, s in rows if mode == "sequential"}
    base_tokens = {kind: s["tokens"] for mode, kind, s in rows if mode == "sequential"}
    print("| mode | arrivals | done | output tok/s | vs one-by-one | same tokens as one-by-one | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | e2e p90 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for mode, kind, s in rows:
        ratio = f"{s['throughput_tokens_per_s'] / base[kind]:.2f}x" if base.get(kind) else "–"
        ref = base_tokens.get(kind)
        same = f"{sum(ref.get(i) == t for i, t in s['tokens'].items())}/{len(s['tokens'])}" if ref is not None else "–"
        print(f"| {mode} | {kind} | {s['done']}/{s['requests']} | {s['throughput_tokens_per_s']:.1f} | {ratio} | {same} | "
              f"{s['ttft_ms_p50']:.0f} / {s['ttft_ms_p90']:.0f} / {s['ttft_ms_p99']:.0f} | "
              f"{s['itl_ms_p50']:.0f} / {s['itl_ms_p90']:.0f} / {s['itl_ms_p99']:.0f} | {s['e2e_ms_p90']:.0f} |")
    print(f"\n# load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    sys.exit(main())
