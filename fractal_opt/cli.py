"""The ``fractal-opt`` command.

    fractal-opt run RECIPE [--out DIR] [--quiet]   optimize; write trace.json, report.md, recipe.yaml
    fractal-opt check RECIPE                       validate a recipe without loading any model
    fractal-opt passes                             list every pass by layer, and whether it can run here
    fractal-opt generate RECIPE PROMPT             answer one prompt with a (tuned) recipe's deployment
    fractal-opt budget MODEL [--context N] ...     memory and decode-ceiling budget from a model's config

Exit codes: 0 success, 1 the run failed, 2 invalid input (the message says what and how to fix it).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing

from .errors import FractalOptError, RecipeError

__all__ = ["main"]


def _cmd_run(args: argparse.Namespace) -> int:
    from .pipeline.runner import optimize

    result = optimize(args.recipe, out=args.out, progress=not args.quiet)
    print(result.trace.to_text())
    print()
    kept = result.trace.final.get("kept") or []
    print(f"Kept: {', '.join(kept) if kept else 'nothing (the baseline stays)'}")
    vs = result.trace.final.get("vs_baseline") or {}
    if vs:
        print("Final vs baseline: " + ", ".join(f"{k} {v:+.1%}" for k, v in vs.items()))
    print(f"Wrote {args.out}/trace.json, {args.out}/report.md, {args.out}/recipe.yaml")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from .recipe import load_recipe

    recipe = load_recipe(args.recipe)
    print(f"{args.recipe}: valid. Model {recipe.model}; {len(recipe.workload.requests())} requests in suite {recipe.workload.suite!r}; passes:")
    for p in recipe.passes:
        print(f"  {p.layer.section:<12} {p.describe()}")
    return 0


def _cmd_passes(args: argparse.Namespace) -> int:
    from .layers import passes_by_layer
    from .machine import Machine

    machine = Machine.probe()
    for layer, classes in passes_by_layer().items():
        print(f"{layer.value}. {layer.section}")
        for cls in classes:
            hints = typing.get_type_hints(cls)
            params = ", ".join(f"{f.name}: {_type(hints[f.name])} = {f.default!r}" for f in dataclasses.fields(cls))
            why = cls().unavailable(machine)
            here = "available on this machine" if why is None else f"not available here: {why}"
            print(f"   {cls.name:<16} {cls.summary()}")
            print(f"   {'':<16} params: {params or '-'}")
            print(f"   {'':<16} {here}")
            if cls.name == "runtime":
                from .runtimes import availability

                for runtime, reason in availability(machine).items():
                    print(f"   {'':<16}   {runtime:<13} {'runs here' if reason is None else 'not here: ' + reason}")
    return 0


def _type(annotation) -> str:
    from .validate import type_name

    return type_name(annotation)


def _cmd_generate(args: argparse.Namespace) -> int:
    from .runtimes import Engine

    engine = Engine.from_recipe(args.recipe, progress=lambda m: print(m, file=sys.stderr))
    for piece in engine.stream(args.prompt, max_new_tokens=args.max_new_tokens):
        print(piece, end="", flush=True)
    print()
    return 0


def _cmd_budget(args: argparse.Namespace) -> int:
    from .measure.budget import budget

    b = budget(args.model, context=args.context, batch=args.batch, dtype=args.dtype, weights_bits=args.weights_bits, kv_bits=args.kv_bits,
               memory_gb=args.memory_gb, bandwidth_gbs=args.bandwidth_gbs)
    if args.json:
        import json

        data = b.to_dict()
        data["shape"] = dataclasses.asdict(b.shape)
        print(json.dumps(data, indent=2))
    else:
        print(b.to_text())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fractal-opt", description="Measure, change one thing, measure again: optimize LLM inference layer by layer.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="optimize a model with a recipe")
    run.add_argument("recipe", help="path to a YAML recipe")
    run.add_argument("--out", default="fractal-out", help="output folder (default: ./fractal-out)")
    run.add_argument("--quiet", action="store_true", help="no progress line")
    run.set_defaults(func=_cmd_run)
    check = sub.add_parser("check", help="validate a recipe without loading a model")
    check.add_argument("recipe")
    check.set_defaults(func=_cmd_check)
    passes = sub.add_parser("passes", help="list every pass by layer")
    passes.set_defaults(func=_cmd_passes)
    gen = sub.add_parser("generate", help="answer a prompt with a recipe's deployment")
    gen.add_argument("recipe")
    gen.add_argument("prompt")
    gen.add_argument("--max-new-tokens", type=int, default=None)
    gen.set_defaults(func=_cmd_generate)
    bud = sub.add_parser("budget", help="memory and decode-ceiling budget of a model, from its config (no weights loaded)")
    bud.add_argument("model", help="embedded model name, model folder, config.json, .gguf file, or hub id (online)")
    bud.add_argument("--context", type=int, default=2048, help="tokens per sequence the KV cache holds (default 2048)")
    bud.add_argument("--batch", type=int, default=1, help="sequences served together (default 1)")
    bud.add_argument("--dtype", default="bfloat16", help="weight and KV dtype (default bfloat16)")
    bud.add_argument("--weights-bits", type=int, default=None, help="bits per weight of the blocks' linear layers after quantization")
    bud.add_argument("--kv-bits", type=int, default=None, help="bits per KV-cache element (default: the dtype's)")
    bud.add_argument("--memory-gb", type=float, default=None, help="device memory in GB (10^9 bytes): how many sequences fit")
    bud.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth in GB/s: the decode ceiling")
    bud.add_argument("--json", action="store_true", help="print JSON instead of the table")
    bud.set_defaults(func=_cmd_budget)
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


if __name__ == "__main__":
    sys.exit(main())
