"""Measure every application-layer pass on the embedded SmolLM2-135M-Instruct and print the ratios.

Each case measures a plain plan and the plan with one application pass, on the suite the pass is
meant for, with fractal_opt.measure (warm-up excluded, medians over repeats, per-request paired
ratios). Nothing here is asserted: the numbers depend on the machine and its load, which the
header prints. Run:

    python benchmarks/application.py                 # every case (~8 minutes on 2 shared cores)
    python benchmarks/application.py --only prompt_lookup --repeats 3
    python benchmarks/application.py --match no_repeat
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

from fractal_opt.core.errors import FractalOptError
from fractal_opt.measure.runner import measure, paired_changes
from fractal_opt.quality.probes import agreement_between
from fractal_opt.runtimes import Engine
from fractal_opt.tower.plan import ApplicationPlan, Plan
from fractal_opt.workloads.workload import Workload

MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class Case:
    name: str  # the pass
    label: str  # what the candidate plan does
    suite: str
    app: dict[str, Any]
    max_new_tokens: int = 48
    limit: int | None = None
    base: dict[str, Any] = field(default_factory=dict)  # application fields of the plain plan


CASES = [
    Case("max_new_tokens", "cap 16 tokens (budget 48)", "default", {"max_new_tokens": 16}, limit=3),
    Case("max_new_tokens", "stop at a blank line", "default", {"stop": ("\n\n",)}, limit=3),
    Case("decoding", "beam search, 4 beams", "default", {"num_beams": 4}, limit=3),
    Case("decoding", "repetition_penalty 1.2", "default", {"repetition_penalty": 1.2}, limit=3),
    Case("decoding", "no_repeat_ngram_size 3", "default", {"no_repeat_ngram_size": 3}, limit=3),
    Case("decoding", "sampling T=0.7 top_p=0.9 (seeded)", "default", {"do_sample": True, "temperature": 0.7, "top_p": 0.9}, limit=3),
    Case("prompt_budget", "head_tail, 512 tokens", "long-context", {"prompt_budget": 512, "prompt_strategy": "head_tail"}),
    Case("prompt_budget", "drop_chunks, 320 tokens", "rag", {"prompt_budget": 320, "prompt_strategy": "drop_chunks"}, max_new_tokens=64),
    Case("response_cache", "exact", "faq", {"response_cache": "exact"}),
    Case("response_cache", "semantic, threshold 0.9", "faq", {"response_cache": "semantic", "cache_threshold": 0.9}),
    Case("prompt_lookup", "10 tokens, RAG (answers quote the context)", "rag", {"prompt_lookup_tokens": 10}, max_new_tokens=64),
    Case("prompt_lookup", "10 tokens, multi-turn chat", "chat", {"prompt_lookup_tokens": 10}),
]


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


def ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or b is None else f"{b / a:.2f}x"


def run_case(case: Case, repeats: int) -> list[str]:
    wl = Workload(suite=case.suite, max_new_tokens=case.max_new_tokens, repeats=repeats, warmup=1, limit=case.limit)
    before_plan = Plan(source=MODEL, application=ApplicationPlan(**case.base))
    after_plan = before_plan.replace_section("application", **case.app)
    before = measure(Engine.build(before_plan, progress=lambda m: None), wl)
    t0 = time.perf_counter()
    try:
        engine = Engine.build(after_plan, progress=lambda m: None)
    except FractalOptError as e:  # e.g. the semantic cache without its embedding package
        return [case.name, case.label, case.suite, f"could not build: {e}"[:120], *[""] * 6]
    build_s = time.perf_counter() - t0
    after = measure(engine, wl)
    b, a = before.summary(), after.summary()
    e2e = paired_changes(before, after, ["e2e_ms"]).get("e2e_ms")  # geometric mean over requests of the paired ratios
    e2e_change = None if e2e is None else e2e.change
    agree = agreement_between(before.outputs, after.outputs)  # share of requests with identical tokens
    extra = []
    if a.get("hit_cap") != b.get("hit_cap"):
        extra.append(f"hit cap {b['hit_cap']:.0%} -> {a['hit_cap']:.0%}")
    if a.get("cache_hit_rate"):
        extra.append(f"cache hits {a['cache_hit_rate']:.0%}")
    if a.get("prompt_tokens_saved"):
        extra.append(f"prompt tokens saved {a['prompt_tokens_saved']:.0f}/request")
    if build_s > 1:
        extra.append(f"extra build {build_s:.1f} s")
    return [
        case.name,
        case.label,
        case.suite,
        f"{fmt(b['e2e_ms'], '.0f')} -> {fmt(a['e2e_ms'], '.0f')}",
        "–" if e2e_change is None else f"{1 / (1 + e2e_change):.2f}x",
        f"{fmt(b['decode_tokens_per_s'])} -> {fmt(a['decode_tokens_per_s'])}",
        f"{fmt(b['new_tokens'], '.0f')} -> {fmt(a['new_tokens'], '.0f')}",
        f"{fmt(b['prefill_ms'], '.0f')} -> {fmt(a['prefill_ms'], '.0f')}",
        fmt(agree, ".2f"),
        "; ".join(extra),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="pass names to run (default: all)")
    parser.add_argument("--match", help="only cases whose candidate label contains this text")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import torch

    print(f"# application passes on {MODEL}")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; load average before the run: {os.getloadavg()[0]:.2f}")
    print(f"greedy unless noted, warm-up 1, repeats {args.repeats}; speed-up = 1 / (paired geometric-mean e2e ratio); "
          "same output = share of requests whose tokens equal the plain plan's\n")
    headers = ["pass", "candidate", "suite", "e2e ms (median)", "e2e speed-up", "decode tok/s", "new tokens", "prefill ms", "same output", "notes"]
    print("| " + " | ".join(headers) + " |")
    print("|" + "---|" * len(headers))
    for case in CASES:
        if (args.only and case.name not in args.only) or (args.match and args.match not in case.label):
            continue
        print("| " + " | ".join(run_case(case, args.repeats)) + " |", flush=True)
    print(f"\nload average after the run: {os.getloadavg()[0]:.2f}")
    print("assisted_decoding: not measured, no draft model with SmolLM2's tokenizer is available locally (check() refuses without one).")


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    main()
