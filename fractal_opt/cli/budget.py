"""``fractal-opt budget MODEL``: memory and decode-ceiling budget from a model's config (no weights loaded)."""

from __future__ import annotations

import argparse
import dataclasses
import json


def add(sub) -> None:
    p = sub.add_parser("budget", help="memory and decode-ceiling budget of a model, from its config (no weights loaded)")
    p.add_argument("model", help="embedded model name, model folder, config.json, .gguf file, or hub id (online)")
    p.add_argument("--context", type=int, default=2048, help="tokens per sequence the KV cache holds (default 2048)")
    p.add_argument("--batch", type=int, default=1, help="sequences served together (default 1)")
    p.add_argument("--dtype", default="bfloat16", help="weight and KV dtype (default bfloat16)")
    p.add_argument("--weights-bits", type=int, default=None, help="bits per weight of the blocks' linear layers after quantization")
    p.add_argument("--kv-bits", type=int, default=None, help="bits per KV-cache element (default: the dtype's)")
    p.add_argument("--memory-gb", type=float, default=None, help="device memory in GB (10^9 bytes): how many sequences fit")
    p.add_argument("--bandwidth-gbs", type=float, default=None, help="memory bandwidth in GB/s: the decode ceiling")
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
