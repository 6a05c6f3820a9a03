"""``fractal-opt suggest MODEL``: a short baseline, its bottleneck per phase, and a commented recipe of the passes that attack it."""

from __future__ import annotations

import argparse


def add(sub) -> None:
    p = sub.add_parser("suggest", help="measure a short baseline, label each phase's bottleneck, and write a recipe of the passes that attack it")
    p.add_argument("model", help="embedded model name, model folder, .gguf file or hub id")
    p.add_argument("--workload", default="default", help="suite to measure (a packaged suite name or a YAML file; default: default)")
    p.add_argument("--targets", default=None, help="targets to write into the recipe, e.g. decode_tokens_per_s=30,ttft_ms_p90=800")
    p.add_argument("--out", default="suggested.yaml", help="where to write the recipe (default: ./suggested.yaml)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=suggest)


def suggest(args: argparse.Namespace) -> int:
    from ..advice.suggest import parse_target_arg
    from ..advice.suggest import suggest as run_suggest

    targets = parse_target_arg(args.targets) if args.targets else None
    advice = run_suggest(args.model, workload=args.workload, targets=targets, progress=None if args.quiet else print)
    advice.write(args.out)
    print(advice.summary())
    print(f"Wrote {args.out}: run it with fractal-opt run {args.out}")
    return 0
