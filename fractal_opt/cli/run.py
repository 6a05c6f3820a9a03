"""``fractal-opt run RECIPE``: optimize, writing trace.json, report.md and recipe.yaml as it goes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add(sub) -> None:
    p = sub.add_parser("run", help="optimize a model with a recipe")
    p.add_argument("recipe", help="path to a YAML recipe")
    p.add_argument("--out", default="fractal-out", help="output folder (default: ./fractal-out)")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.add_argument("--json", action="store_true", help="print a JSON summary (the final plan, every step's verdict, the files) instead of the table")
    again = p.add_mutually_exclusive_group()  # a folder holding a run is refused without one of these
    again.add_argument("--resume", action="store_true",
                       help="continue the run in --out from its journal: finished steps are not measured again (refused if the recipe, model or machine changed)")
    again.add_argument("--force", action="store_true", help="replace the run in --out")
    p.add_argument("--wait-quiet", nargs="?", type=float, const=600.0, default=0.0, metavar="SECONDS",
                   help="before measuring, wait until other processes leave the CPU (at most SECONDS, default 600)")
    p.add_argument("--reconfirm", action="store_true",
                   help="with --resume on a finished run: measure the final confirmation again (default: the journal's, so nothing is measured)")
    p.add_argument("--budget", metavar="DURATION", help="the run's time budget (6m, 90s, 1h), over the recipe's workload.budget_s: searches order "
                   "their work to fit it, and once it is spent the remaining passes are skipped and the best plan found is confirmed")
    p.add_argument("--stop-at-target", action="store_true", help="end the run once every target of the recipe is met (the remaining steps are recorded as skipped)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from ..core.errors import RecipeError
    from ..language.recipe import load_recipe
    from ..pipeline.runner import Pipeline
    from ..pipeline.time_budget import parse_duration

    if not args.out.strip():  # Path("") is the current folder: a run would write its files there
        raise RecipeError(f"run --out: got {args.out!r}, expected a folder path (default: fractal-out).")
    if args.reconfirm and not args.resume:
        raise RecipeError("run --reconfirm measures a finished run's final confirmation again: it goes with --resume.")
    budget_s = parse_duration(args.budget) if args.budget else None  # a bad duration is refused before anything loads
    for spec in load_recipe(args.recipe, check_model=False).code():  # quality.allow_code: the recipe's own code is a trust boundary
        print(f"fractal-opt: this recipe imports and runs: {spec}", file=sys.stderr)
    pipeline = Pipeline(args.recipe, out_dir=args.out, progress=not args.quiet, stop_at_target=args.stop_at_target, wait_quiet=args.wait_quiet,
                        resume=args.resume, force=args.force)
    pipeline.reconfirm = args.reconfirm
    pipeline.budget_s = budget_s
    result = pipeline.run()
    if args.json:
        print(json.dumps(_summary(result.trace, args.out), indent=2, allow_nan=False, default=str))
        return 0
    print(result.to_text())  # the answer first, then every step (fractal_opt/report/terminal.py)
    print(f"Wrote {args.out}/trace.json, {args.out}/report.md, {args.out}/report.html, {args.out}/recipe.yaml")
    return 0


def _summary(trace, out: str) -> dict[str, Any]:
    """What a script needs from a finished run: the final confirmation, each step's verdict, the files."""
    final = trace.final or {}
    return {
        "finished": trace.finished,
        "final": {k: final.get(k) for k in ("status", "kept", "vs_baseline", "confirmation") if k in final},
        "steps": [{"pass": s.pass_name, "layer": s.layer, "params": s.params, "status": s.status, "reason": s.reason} for s in trace.steps],
        "calibration": {k: v for k, v in (trace.calibration or {}).items() if k in ("busy", "resolves", "resolution", "rounds", "min_effect")},
        "files": sorted(str(p) for p in Path(out).iterdir() if p.is_file()),
    }
