"""``fractal-opt compare A B``: two run folders or recipes side by side; ``--measure`` re-measures both here."""

from __future__ import annotations

import argparse


def add(sub) -> None:
    p = sub.add_parser("compare", help="two run folders or recipes side by side: the plan diff, the numbers, the targets each meets")
    p.add_argument("a", help="a run folder (with trace.json) or a recipe")
    p.add_argument("b", help="a run folder (with trace.json) or a recipe")
    p.add_argument("--measure", action="store_true", help="re-measure both plans interleaved on this machine")
    p.add_argument("--workload", default=None, help="suite for --measure (default: A's workload)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=compare)


def compare(args: argparse.Namespace) -> int:
    from ..advice.compare import compare as run_compare

    print(run_compare(args.a, args.b, measure=args.measure, workload=args.workload, progress=None if args.quiet else print).to_text())
    return 0
