"""``fractal-opt doctor [RECIPE]``: the troubleshooting checklist, each check with a verdict and what to do."""

from __future__ import annotations

import argparse
import json


def add(sub) -> None:
    p = sub.add_parser("doctor", help="check the environment (device, versions, load, memory) before trusting a measurement")
    p.add_argument("recipe", nargs="?", help="a recipe whose model and plan are checked too (memory headroom, context)")
    p.add_argument("--build", action="store_true", help="also build the recipe's plan: parameter dtypes (did quantization apply?) and slow fallbacks")
    p.add_argument("--json", action="store_true", help="print the checks as JSON")
    p.set_defaults(func=doctor)


def doctor(args: argparse.Namespace) -> int:
    from ..advice.doctor import FAIL, render
    from ..advice.doctor import doctor as run_checks

    checks = run_checks(args.recipe, build=args.build)
    if args.json:
        print(json.dumps([c.to_dict() for c in checks], indent=2))
    else:
        print(render(checks))
    return 1 if any(c.verdict == FAIL for c in checks) else 0
