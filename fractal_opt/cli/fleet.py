"""``fractal-opt fleet RUN --users N`` (or ``--rate R``): replicas and machines of this kind for a target load."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add(sub) -> None:
    p = sub.add_parser("fleet", help="replicas and machines for a target load, from the run's measured capacity and scaling efficiency")
    p.add_argument("run_dir", help="a run's output folder (its trace.json measured capacity: load: {capacity: true})")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--users", type=float, help="users (conversations) or clients (closed load) to serve at once")
    target.add_argument("--rate", type=float, help="requests per second to serve (poisson arrivals)")
    p.add_argument("--price-per-hour", type=float, default=None, help="a machine's price per hour (default: the recipe's machine.price_per_hour): cost per 1,000 tokens")
    p.add_argument("--scaling", metavar="FILE", default=None, help="the JSON of benchmarks/placement.py --json, when the run has no replicas step")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=fleet)


def fleet(args: argparse.Namespace) -> int:
    from ..advice.fleet import fleet_basis, plan_fleet, scaling_from_benchmark
    from ..core.errors import RecipeError

    path = Path(args.run_dir) / "trace.json" if Path(args.run_dir).is_dir() else Path(args.run_dir)
    try:
        trace = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RecipeError(f"fleet: {str(path)!r} is not a run's trace.json ({type(e).__name__}: {e}); give the --out folder of fractal-opt run") from None
    capacity, measured = fleet_basis(trace)
    scaling = scaling_from_benchmark(args.scaling) if args.scaling else measured
    price = args.price_per_hour if args.price_per_hour is not None else ((trace.get("recipe") or {}).get("machine") or {}).get("price_per_hour")
    option, target = ("users", args.users) if args.users is not None else ("rate", args.rate)
    cores = int((trace.get("machine") or {}).get("physical_cores") or 1)
    answer = plan_fleet(capacity, target=target, option=option, machine_cores=cores, scaling=scaling, price_per_hour=price)
    print(json.dumps(answer.to_dict(), indent=2) if args.json else answer.to_text())
    return 0
