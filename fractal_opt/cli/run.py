"""``fractal-opt run RECIPE``: optimize, writing trace.json, report.md and recipe.yaml as it goes."""

from __future__ import annotations

import argparse


def add(sub) -> None:
    p = sub.add_parser("run", help="optimize a model with a recipe")
    p.add_argument("recipe", help="path to a YAML recipe")
    p.add_argument("--out", default="fractal-out", help="output folder (default: ./fractal-out)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..pipeline.runner import optimize

    result = optimize(args.recipe, out=args.out, progress=not args.quiet)
    print(result.trace.to_text())
    print()
    kept = result.trace.final.get("kept") or []
    print(f"Kept: {', '.join(kept) if kept else 'nothing (the baseline stays)'}")
    vs = result.trace.final.get("vs_baseline") or {}
    if vs:
        print("Final vs baseline: " + ", ".join(f"{k} {v:+.1%}" for k, v in vs.items()))
    print(f"Wrote {args.out}/trace.json, {args.out}/report.md, {args.out}/recipe.yaml")
    return 0
