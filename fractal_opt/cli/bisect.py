"""``fractal-opt bisect RUN_DIR``: which kept pass makes a tuned plan slower (or worse) on a workload."""

from __future__ import annotations

import argparse


def add(sub) -> None:
    p = sub.add_parser("bisect", help="find the kept pass (or pair) that makes a tuned plan slower on a workload, by rolling back halves")
    p.add_argument("run_dir", help="a run's output folder (trace.json from fractal-opt run)")
    p.add_argument("--workload", default=None, help="suite to measure on (a packaged suite name or a YAML file; default: the run's own)")
    p.add_argument("--metric", default=None, help="the number that got worse (default: the run's objective for its kept passes, decode_tokens_per_s)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=bisect)


def bisect(args: argparse.Namespace) -> int:
    from ..advice.bisect import bisect_run

    result = bisect_run(args.run_dir, workload=args.workload, metric=args.metric, progress=None if args.quiet else print)
    print(result.to_text())
    return 0
