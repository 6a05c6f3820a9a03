"""``fractal-opt check RECIPE...``: validate recipes without loading any weights.

Every problem of every file is reported (not only the first), so the command fits a pre-commit
hook: ``fractal-opt check recipes/*.yaml --json`` (docs/cli.md). Checked without weights: the
recipe's keys, types and ranges, the suite and eval set files, the model's files (config, weights,
tokenizer, GGUF header) and that every prompt fits the model's positions and the context cap. The
code a recipe would import (``quality.probes``) is listed, never imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add(sub) -> None:
    p = sub.add_parser("check", help="validate recipes without loading weights (every problem of every file)")
    p.add_argument("recipes", nargs="+", metavar="RECIPE", help="recipe files (.yaml)")
    p.add_argument("--json", action="store_true", help="print {valid, files: [{file, valid, problems, imports, model, passes, ...}]} instead of text")
    p.set_defaults(func=check)


def check_file(path: str) -> dict[str, Any]:
    """What ``check`` reports for one file: valid or not, every problem, and the code it would import."""
    from ..core.errors import RecipeError
    from ..core.validate import problems_of
    from ..language.recipe import load_recipe

    report: dict[str, Any] = {"file": path, "valid": False, "problems": [], "imports": _declared_code(path)}
    try:
        recipe = load_recipe(Path(path), complete_model=True)
    except RecipeError as e:
        report["problems"] = problems_of(e)
        return report
    report.update(valid=True, imports=recipe.code(), model=recipe.model, suite=recipe.workload.suite, requests=len(recipe.workload.requests()),
                  passes=[{"layer": p.layer.section, "pass": p.describe()} for p in recipe.passes],
                  trust_remote_code=recipe.base_plan().model.trust_remote_code)
    return report


def _declared_code(path: str) -> list[str]:
    """The probes a file names, read without validating it (so an invalid recipe's code is listed too)."""
    import yaml

    from ..core.errors import RecipeError
    from ..core.validate import MAX_RECIPE_BYTES, parse_yaml, read_text

    try:  # the guarded loader: a hostile file is refused here in milliseconds, as by load_recipe
        data = parse_yaml(read_text(Path(path), what="recipe file", max_bytes=MAX_RECIPE_BYTES), where=path)
        probes = data["quality"]["probes"]
    except (RecipeError, yaml.YAMLError, KeyError, TypeError):  # check_file refuses such a file with its own message
        return []
    return [str(p) for p in probes] if isinstance(probes, list) else []


def check(args: argparse.Namespace) -> int:
    reports = [check_file(path) for path in args.recipes]
    valid = all(r["valid"] for r in reports)
    if args.json:
        print(json.dumps({"valid": valid, "files": reports}, indent=2))
        return 0 if valid else 2
    for r in reports:
        if r["valid"]:
            print(f"{r['file']}: valid. Model {r['model']}; {r['requests']} requests in suite {r['suite']!r}; passes:")
            for p in r["passes"]:
                print(f"  {p['layer']:<12} {p['pass']}")
        elif len(r["problems"]) == 1:
            print(f"fractal-opt: invalid input: {r['problems'][0]}", file=sys.stderr)
        else:
            print(f"fractal-opt: invalid input: {r['file']}: {len(r['problems'])} problems:", file=sys.stderr)
            for problem in r["problems"]:
                print(f"  - {problem}", file=sys.stderr)
        if r["imports"]:
            print(f"  this recipe imports and runs: {', '.join(r['imports'])}" + ("" if r["valid"] else " (refused without quality.allow_code: true)"))
        if r.get("trust_remote_code"):
            print(f"  this recipe runs the model folder's own Python code ({r['model']}: trust_remote_code: true); read that code first")
    if len(reports) > 1:
        bad = sum(not r["valid"] for r in reports)
        print(f"{len(reports)} files: {len(reports) - bad} valid, {bad} invalid.", file=sys.stderr if bad else sys.stdout)
    return 0 if valid else 2
