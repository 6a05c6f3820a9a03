"""``fractal-opt tune MODEL``: write a recipe that searches the hardware and model layers of a model within a time budget, and run it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add(sub) -> None:
    p = sub.add_parser("tune", help="write a recipe that searches the hardware and model layers of MODEL (runtimes, their knobs, the weight ladder) "
                                    "within a time budget, then run it")
    p.add_argument("model", help="embedded model name, model folder, .gguf file or hub id")
    p.add_argument("--workload", default="default", help="suite to measure (a packaged suite name or a YAML file; default: default)")
    p.add_argument("--budget", default="6m", help="the run's time budget, baseline and final confirmation included (default: 6m)")
    p.add_argument("--recipe", default="tune.yaml", help="where to write the recipe (default: ./tune.yaml)")
    p.add_argument("--out", default="fractal-out", help="output folder of the run (default: ./fractal-out)")
    p.add_argument("--force", action="store_true", help="replace the run in --out")
    p.add_argument("--quiet", action="store_true", help="no progress line")
    p.set_defaults(func=tune)


def tune_recipe(model: str, *, suite: str, budget_s: float) -> dict[str, Any]:
    """A recipe searching ``model``'s hardware and model layers on ``suite`` (its first 4 requests,
    32 new tokens, 3 rounds and up to 4: the quickstart's measurement) within ``budget_s`` seconds."""
    return {"name": f"tune-{Path(model).name}", "model": model,
            "workload": {"suite": suite, "limit": 4, "max_new_tokens": 32, "repeats": 3, "max_repeats": 4, "budget_s": budget_s},
            "passes": {"hardware": ["search"], "model": ["search"]}}


def tune(args: argparse.Namespace) -> int:
    import yaml

    from ..language.recipe import load_recipe
    from ..pipeline.runner import Pipeline
    from ..pipeline.time_budget import parse_duration

    data = tune_recipe(args.model, suite=args.workload, budget_s=parse_duration(args.budget))
    load_recipe(data)  # a bad model or suite is refused before anything is written or loaded
    header = (f"# Written by fractal-opt tune {args.model}: the hardware and model layers searched within {args.budget}\n"
              "# (docs/passes.md, \"search\"). Run it again with: fractal-opt run THIS_FILE\n")
    Path(args.recipe).write_text(header + yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    print(f"Wrote {args.recipe}; running it")
    result = Pipeline(args.recipe, out_dir=args.out, progress=not args.quiet, force=args.force).run()
    print(result.to_text())
    print(f"Wrote {args.out}/trace.json, {args.out}/report.md, {args.out}/report.html, {args.out}/recipe.yaml")
    return 0
