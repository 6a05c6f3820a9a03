"""What does the background RSS sampler cost? (It must stay under 2% of decode speed.)

The measurement reads peak memory from Linux's VmHWM (free: nothing runs during the work); other
platforms fall back to a thread that reads the RSS every 50 ms. This script serves the same
requests with the embedded SmolLM2-135M-Instruct inside ``MemoryWindow(method="vmhwm")`` and
``MemoryWindow(method="sampler")``, interleaved (A B / B A rounds), and prints the paired change of
decode tokens/s and throughput with its 95% t interval over rounds, plus both peaks.

    python benchmarks/memory_sampler.py --rounds 6 --requests 2 --tokens 24 --threads 1
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    import time

    import torch

    from fractal_opt.measure.memory import MemoryWindow
    from fractal_opt.measure.metrics import Sample
    from fractal_opt.measure.noise import paired_interval
    from fractal_opt.runtimes import Engine
    from fractal_opt.tower.plan import HardwarePlan, Plan
    from fractal_opt.workloads.workload import Workload

    engine = Engine.build(Plan(source="smollm2-135m-instruct", hardware=HardwarePlan(threads=args.threads)), progress=lambda m: None)
    requests = Workload(suite="default", limit=args.requests).requests()
    engine.serve(requests, max_new_tokens=8)  # warm-up
    rows: dict[str, list[dict]] = {"vmhwm": [], "sampler": []}
    for r in range(args.rounds):
        for method in (("vmhwm", "sampler") if r % 2 == 0 else ("sampler", "vmhwm")):
            with MemoryWindow("cpu", method=method) as mem:
                t0 = time.perf_counter()
                gens = engine.serve(requests, max_new_tokens=args.tokens)
                wall = time.perf_counter() - t0
            decode = {g.request_id: Sample.from_generation(g).decode_tokens_per_s for g in gens}
            rows[method].append({"decode": decode, "throughput": sum(g.new_tokens for g in gens) / wall, "peak_mb": mem.peak_mb, "samples": mem.samples})
    logs: dict[str, list[float]] = {}
    for a, b in zip(rows["vmhwm"], rows["sampler"]):
        for rid, v in a["decode"].items():
            if v and b["decode"].get(rid):
                logs.setdefault(rid, []).append(math.log(b["decode"][rid] / v))
    dec = paired_interval(logs)
    thr = paired_interval({"rounds": [math.log(b["throughput"] / a["throughput"]) for a, b in zip(rows["vmhwm"], rows["sampler"])]})
    print(f"torch {torch.__version__}, {args.threads or torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds x {args.requests} requests x {args.tokens} tokens")
    print(f"sampler vs VmHWM, decode tokens/s: {dec.change:+.2%} [{dec.low:+.2%}, {dec.high:+.2%}]")
    print(f"sampler vs VmHWM, throughput:      {thr.change:+.2%} [{thr.low:+.2%}, {thr.high:+.2%}]")
    print(f"peak MB: VmHWM {statistics.median(x['peak_mb'] for x in rows['vmhwm']):.0f}, sampler {statistics.median(x['peak_mb'] for x in rows['sampler']):.0f} "
          f"({statistics.median(x['samples'] for x in rows['sampler']):.0f} readings per round)")
    # Decided like a pipeline verdict: "under 2%" only when the whole 95% interval is above -2%.
    if dec.low > -0.02:
        print("overhead under 2%: yes (the whole 95% interval of the decode change is above -2%)")
        return 0
    if dec.high < -0.02:
        print("overhead under 2%: NO (the whole 95% interval is below -2%)")
        return 1
    print("overhead under 2%: inconclusive (the interval straddles -2%: too noisy; run more --rounds on a quieter machine)")
    return 2


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    sys.exit(main())
