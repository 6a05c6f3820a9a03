"""``fractal-opt generate RECIPE PROMPT``: answer one prompt with a (tuned) recipe's deployment."""

from __future__ import annotations

import argparse
import sys


def add(sub) -> None:
    p = sub.add_parser("generate", help="answer a prompt with a recipe's deployment")
    p.add_argument("recipe")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=_positive_tokens, default=None, help="cap on new tokens (default: the plan's)")
    p.set_defaults(func=generate)


def _positive_tokens(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= 1_000_000:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected a whole number of tokens from 1 to 1,000,000")
    return value


def generate(args: argparse.Namespace) -> int:
    from ..runtimes import Engine

    engine = Engine.from_recipe(args.recipe, progress=lambda m: print(m, file=sys.stderr))
    for piece in engine.stream(args.prompt, max_new_tokens=args.max_new_tokens):
        print(piece, end="", flush=True)
    print()
    return 0
