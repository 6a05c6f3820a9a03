"""``fractal-opt check RECIPE``: validate a recipe without loading any model."""

from __future__ import annotations

import argparse


def add(sub) -> None:
    p = sub.add_parser("check", help="validate a recipe without loading a model")
    p.add_argument("recipe")
    p.set_defaults(func=check)


def check(args: argparse.Namespace) -> int:
    from ..recipe import load_recipe

    recipe = load_recipe(args.recipe)
    print(f"{args.recipe}: valid. Model {recipe.model}; {len(recipe.workload.requests())} requests in suite {recipe.workload.suite!r}; passes:")
    for p in recipe.passes:
        print(f"  {p.layer.section:<12} {p.describe()}")
    return 0
