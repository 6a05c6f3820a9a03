"""The ``fractal-opt`` command: one module per subcommand, each with ``add(subparsers)``.

    fractal-opt run RECIPE [--out DIR] [--quiet]   optimize; write trace.json, report.md, recipe.yaml
    fractal-opt check RECIPE                       validate a recipe without loading any model
    fractal-opt passes                             list every pass by layer, and whether it can run here
    fractal-opt generate RECIPE PROMPT             answer one prompt with a (tuned) recipe's deployment
    fractal-opt budget MODEL [--context N] ...     memory and decode-ceiling budget from a model's config

Exit codes: 0 success, 1 the run failed, 2 invalid input (the message says what and how to fix it),
130 interrupted (the steps finished so far are kept).
"""

from __future__ import annotations

import argparse
import sys

from ..errors import FractalOptError, RecipeError
from . import budget, check, generate, passes, run

__all__ = ["build_parser", "main"]

# The subcommands, in the order ``--help`` lists them.
COMMANDS = (run, check, passes, generate, budget)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fractal-opt", description="Measure, change one thing, measure again: optimize LLM inference layer by layer.")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add(sub)
    return parser


def _quiet_third_party() -> None:
    """The terminal belongs to our report: silence import-time chatter of optional packages
    (torchao's missing CUDA kernels on CPU machines, torch pytree deprecations, load bars)."""
    import logging
    import os

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_third_party()
    try:
        return args.func(args)
    except RecipeError as e:
        print(f"fractal-opt: invalid input: {e}", file=sys.stderr)
        return 2
    except FractalOptError as e:
        print(f"fractal-opt: {e}", file=sys.stderr)
        return 2 if type(e).__name__ == "ModelSourceError" else 1
    except KeyboardInterrupt:
        print("\nfractal-opt: interrupted; the steps finished so far are in the output folder.", file=sys.stderr)
        return 130
