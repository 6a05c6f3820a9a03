"""``fractal-opt budget MODEL``: memory and decode-ceiling budget from a model's config (no weights loaded)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable


def _bounded(name: str) -> Callable[[str], int | float]:
    """An argparse ``type`` for one of the calculator's numbers (``measure.budget.BOUNDS``): a value
    out of range exits 2 with ``argument --context: got '1e20', expected an integer from 1 to ...``."""
    from ..measure.budget import BOUNDS, allowed, out_of_bounds

    integer = BOUNDS[name][0]

    def parse(text: str) -> int | float:
        try:
            value: int | float = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}, expected {allowed(name)}") from None
        if out_of_bounds(name, value):
            raise argparse.ArgumentTypeError(f"got {text!r}, expected {allowed(name)}")
        return value

    return parse


def _bits(text: str) -> int:
    from ..measure.budget import BITS

    if not text.isdigit() or int(text) not in BITS:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected one of {', '.join(map(str, BITS))}")
    return int(text)


def add(sub) -> None:
    p = sub.add_parser("budget", help="memory and decode-ceiling budget of a model, from its config (no weights loaded)")
    p.add_argument("model", help="embedded model name, model folder, config.json, .gguf file, or hub id (online)")
    p.add_argument("--context", type=_bounded("context"), default=2048, help="tokens per sequence the KV cache holds (default 2048)")
    p.add_argument("--batch", type=_bounded("batch"), default=1, help="sequences served together (default 1)")
    p.add_argument("--dtype", default="bfloat16", help="weight and KV dtype (default bfloat16)")
    p.add_argument("--weights-bits", type=_bits, default=None, help="bits per weight of the blocks' linear layers after quantization")
    p.add_argument("--kv-bits", type=_bits, default=None, help="bits per KV-cache element (default: the dtype's)")
    p.add_argument("--memory-gb", type=_bounded("memory_gb"), default=None, help="device memory in GB (10^9 bytes): how many sequences fit")
    p.add_argument("--bandwidth-gbs", type=_bounded("bandwidth_gbs"), default=None, help="memory bandwidth in GB/s: the decode ceiling")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.set_defaults(func=budget)


def budget(args: argparse.Namespace) -> int:
    from ..measure.budget import budget as model_budget

    b = model_budget(args.model, context=args.context, batch=args.batch, dtype=args.dtype, weights_bits=args.weights_bits, kv_bits=args.kv_bits,
                     memory_gb=args.memory_gb, bandwidth_gbs=args.bandwidth_gbs)
    if args.json:
        data = b.to_dict()
        data["shape"] = dataclasses.asdict(b.shape)
        print(json.dumps(data, indent=2))
    else:
        print(b.to_text())
    return 0
