"""The ``fractal-opt`` command: one module per subcommand, each with ``add(subparsers)``.

    fractal-opt run RECIPE [--out DIR] [--resume|--force]   optimize; write trace.json, report.md/html, recipe.yaml
    fractal-opt check RECIPE... [--json]           validate recipes without loading any weights (every problem)
    fractal-opt passes [--json]                    list every pass by layer, and whether it can run here
    fractal-opt schema                             the JSON Schema of recipes (editors, pre-commit)
    fractal-opt generate RECIPE PROMPT             answer one prompt with a (tuned) recipe's deployment
    fractal-opt budget MODEL [--context N] ...     memory and decode-ceiling budget from a model's config
    fractal-opt doctor [RECIPE]                    the troubleshooting checklist as checks
    fractal-opt suggest MODEL                      short baseline -> bottleneck -> a commented recipe
    fractal-opt tune MODEL [--budget 6m]           a recipe searching the hardware and model layers, written and run
    fractal-opt bisect RUN_DIR                     which kept pass makes the tuned plan slower
    fractal-opt compare A B [--measure]            two runs or recipes side by side
    fractal-opt serve RECIPE_OR_RUN_DIR            an OpenAI-compatible endpoint on the tuned plan
    fractal-opt export RUN_DIR --to TARGET         the plan as another server's launch settings (or a cluster's: --to cluster / kubernetes)
    fractal-opt fleet RUN_DIR --users N            replicas and machines for a target load, from measured capacity and scaling

Exit codes (EXIT_CODES; docs/cli.md): 0 success, 1 the run failed, 2 invalid input (the message
says what and how to fix it), 130 interrupted (the steps finished so far are kept). ``main``
returns the code instead of exiting, argparse's own errors included, so tests call it in-process.
"""

from __future__ import annotations

import argparse
import sys

from ..core.errors import FractalOptError, RecipeError
from ..core.quiet import quiet_third_party
from . import bisect, budget, check, compare, doctor, export, fleet, generate, passes, run, schema, serve, suggest, tune

__all__ = ["EXIT_CODES", "build_parser", "main"]

EXIT_CODES = {0: "success", 1: "the run failed", 2: "invalid input: a recipe, file, model folder or argument (the message says which and what is allowed)",
              130: "interrupted (Ctrl-C); the steps finished so far are kept"}

# The subcommands, in the order ``--help`` lists them.
COMMANDS = (run, check, passes, schema, generate, budget, doctor, suggest, tune, bisect, compare, serve, export, fleet)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    epilog = "exit codes:\n" + "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items())
    parser = argparse.ArgumentParser(prog="fractal-opt", description="Measure, change one thing, measure again: optimize LLM inference layer by layer.",
                                     epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"fractal-opt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help / --version (0) or a bad argument (2, argparse printed why)
        return e.code if isinstance(e.code, int) else 2
    quiet_third_party()  # the terminal belongs to our report (fractal_opt/core/quiet.py)
    try:
        return args.func(args)
    except RecipeError as e:
        print(f"fractal-opt: invalid input: {e}", file=sys.stderr)
        return 2
    except FractalOptError as e:
        print(f"fractal-opt: {e}", file=sys.stderr)
        return 2 if type(e).__name__ == "ModelSourceError" else 1
    except OSError as e:
        import errno

        # A path the OS refuses as given (a 300-character name, a loop of links, a file used as a
        # folder) is the user's input, wherever it is first touched; any other OSError is a failure.
        if e.errno not in (errno.ENAMETOOLONG, errno.ELOOP, errno.ENOTDIR):
            raise
        name = str(e.filename or "")
        shown = repr(name) if len(name) <= 80 else repr(name[:60] + "...") + f" ({len(name)} characters)"
        print(f"fractal-opt: invalid input: the path {shown} cannot be used: {e.strerror}.", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `fractal-opt ... | head`: the reader left; not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("\nfractal-opt: interrupted; the steps finished so far are in the output folder.", file=sys.stderr)
        return 130
