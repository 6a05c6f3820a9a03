"""Does the verdict rule tell noise from a real change? Measured on the embedded SmolLM2-135M-Instruct.

(a) A/A: the same plan measured against itself, interleaved, must be reported "no change" in at
    least 95% of trials.
(b) A real slowdown: the candidate spins before handing each generated token over, for 10% of the
    measured decode time per token (re-sized after every trial from the previous plan's latest
    ms/token; decode tokens/s falls by 1 - 1/1.1 = 9.1%); it must be
    detected ("worse beyond noise") in at least 95% of trials.

Each trial is one pipeline comparison, decided with the pipeline's rule: measure_pair (A B / B A
rounds, extended in pairs while unsettled), paired t interval over rounds of decode tokens/s,
band = max(min_effect, inner half-width). A/A and slowdown trials alternate, so machine load falls
on both alike. The spin's measured effect is printed (median over trials): on a VM whose speed
drifts (a 2-core Intel Xeon VM, 2026-12-01) it was −12% rather than the intended −9.1% (docs/metrics.md).

    python benchmarks/noise.py                       # 20 + 20 trials, 2 requests x 16 tokens, 4-16 rounds
    python benchmarks/noise.py --trials 5 --tokens 24 --requests 3

Prints the A/A false-change rate (target <= 5%) and the slowdown detection rate (target >= 95%),
with the machine's load before and after (load average and the other busy processes,
fractal_opt.measure.busy): on a busy machine the rates say more about the machine than the rule.
Exits 1 when either target is missed. Every number printed is measured in this run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


class SlowModel:
    """A model proxy whose generate() spends ``delay_s`` before each generated token reaches the streamer.

    The delay sits inside the generation loop, between one decode step and the next, so it is
    timed exactly like slower kernels would be.
    """

    def __init__(self, model: Any, delay_s: float):
        self._model = model
        self._delay_s = delay_s

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def generate(self, *args: Any, streamer: Any = None, **kwargs: Any) -> Any:
        return self._model.generate(*args, streamer=_SleepyStreamer(streamer, self._delay_s) if streamer is not None else None, **kwargs)


class _SleepyStreamer:
    def __init__(self, inner: Any, delay_s: float):
        self.inner, self.delay_s, self.prompt_seen = inner, delay_s, False

    def put(self, value: Any) -> None:
        if self.prompt_seen:  # the first put is the prompt; every later put is a decode step's token
            # Spin rather than sleep: time.sleep oversleeps by ~1 ms and more under load (a 5.5 ms
            # sleep slowed decode by ~20% instead of 9%); spinning adds exactly delay_s of work.
            end = time.perf_counter() + self.delay_s
            while time.perf_counter() < end:
                pass
        self.prompt_seen = True
        self.inner.put(value)

    def end(self) -> None:
        self.inner.end()


def main(argv: list[str] | None = None) -> int:
    from fractal_opt.language.policy import Policy

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials of each kind (default 20)")
    parser.add_argument("--requests", type=int, default=2, help="requests of the default suite per round (default 2, the short ones)")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens per request (default 16)")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds per comparison before any extension (default 4: two A B / B A pairs)")
    parser.add_argument("--max-rounds", type=int, default=16, help="adaptive budget: rounds are added in pairs while the verdict is unsettled "
                        "(default 16: on a 2-core Intel Xeon VM a round's paired log-ratio moved by 4-10%%, and 8 rounds found 16/20 slowdowns)")
    parser.add_argument("--slowdown", type=float, default=0.10, help="extra time per decode step, as a fraction of the measured step (default 0.10)")
    parser.add_argument("--min-effect", type=float, default=Policy.min_effect, help=f"policy.min_effect (default {Policy.min_effect}, the policy's)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the physical cores, the plan's `auto`; on a machine "
                        "shared with other jobs try 1, since a second OpenMP thread then spin-waits against them)")
    args = parser.parse_args(argv)

    import torch

    from fractal_opt.measure.busy import snapshot
    from fractal_opt.measure.noise import band
    from fractal_opt.measure.runner import measure, measure_pair, paired_changes
    from fractal_opt.runtimes import Engine
    from fractal_opt.runtimes.transformers.engine import TransformersEngine
    from fractal_opt.tower.plan import HardwarePlan, Plan
    from fractal_opt.workloads.workload import Workload

    start = snapshot()
    print(f"before: {start.describe()}" + (" -- BUSY" if start.busy else ""), flush=True)
    plan = Plan(source="smollm2-135m-instruct", hardware=HardwarePlan(threads=args.threads or "auto"))
    engine = Engine.build(plan, progress=lambda m: print(m, file=sys.stderr))
    wl = Workload(suite="default", limit=args.requests, max_new_tokens=args.tokens, repeats=args.rounds, max_repeats=args.max_rounds, warmup=0)
    warm = measure(engine, Workload(suite="default", limit=args.requests, max_new_tokens=args.tokens, repeats=2, warmup=1))
    ms_per_token = statistics.median(s.decode_ms_per_token for s in warm.samples if s.decode_ms_per_token)
    delay_s = args.slowdown * ms_per_token / 1000
    slow = TransformersEngine(plan, SlowModel(engine.model, delay_s), engine.tokenizer, max_new_tokens=args.tokens)
    print(f"torch {torch.__version__}, {args.threads or torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}; "
          f"{args.requests} requests x {args.tokens} tokens, {args.rounds} rounds (max {args.max_rounds or args.rounds}); "
          f"decode {ms_per_token:.1f} ms/token -> injected {delay_s * 1000:.2f} ms per decode step ({args.slowdown:.0%})")

    metric = "decode_tokens_per_s"
    aa_same = slow_found = 0
    aa_changes: list[float] = []
    slow_changes: list[float] = []
    t0 = time.perf_counter()
    for t in range(args.trials):
        for kind, candidate in (("A/A", engine), ("slow", slow)):
            before, after = measure_pair(engine, candidate, wl, objective=metric, min_effect=args.min_effect, warm_previous=False)
            iv = paired_changes(before, after, [metric])[metric]
            b = band(iv, min_effect=args.min_effect)
            verdict = "no change" if abs(iv.change) <= b else ("worse" if iv.change < 0 else "better")
            if kind == "A/A":
                aa_same += verdict == "no change"
                aa_changes.append(iv.change)
            else:
                slow_found += verdict == "worse"
                slow_changes.append(iv.change)
            # Re-size the sleep from this trial's previous-plan decode time, so the injected
            # slowdown stays 10% of the current step as the machine's load drifts.
            ms_now = statistics.median(s.decode_ms_per_token for s in before.samples if s.decode_ms_per_token)
            slow.model._delay_s = args.slowdown * ms_now / 1000
            print(f"trial {t + 1:2d} {kind:4s}: change {iv.change:+.1%} [{iv.low:+.1%}, {iv.high:+.1%}], band ±{b:.1%}, {len(after.repeats)} rounds -> {verdict}", flush=True)
    n = args.trials
    false_change = n - aa_same
    end = snapshot()
    print()
    print(f"A/A false change:        {false_change}/{n} = {false_change / n:.0%} (target <= 5%; median |change| {statistics.median(abs(c) for c in aa_changes):.1%})")
    print(f"{args.slowdown:.0%} slowdown found:      {slow_found}/{n} = {slow_found / n:.0%} (target >= 95%; median change {statistics.median(slow_changes):+.1%}, "
          f"expected {1 / (1 + args.slowdown) - 1:+.1%})")
    print(f"wall time {time.perf_counter() - t0:.0f} s")
    print(f"before: {start.describe()}")
    print(f"after:  {end.describe()}")
    ok = false_change / n <= 0.05 and slow_found / n >= 0.95
    if not ok and (start.busy or end.busy):
        print("the machine was busy during the run: re-run on a quiet machine before reading the rates as the rule's")
    return 0 if ok else 1


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    sys.exit(main())
