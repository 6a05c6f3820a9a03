"""``fractal-opt schema``: the JSON Schema of recipes, for editors and pre-commit (docs/cli.md)."""

from __future__ import annotations

import argparse
import json


def add(sub) -> None:
    p = sub.add_parser("schema", help="print the JSON Schema of recipes (yaml-language-server, pre-commit: docs/cli.md)")
    p.set_defaults(func=schema)


def schema(args: argparse.Namespace) -> int:
    from ..language.schema import recipe_schema

    print(json.dumps(recipe_schema(), indent=2))
    return 0
