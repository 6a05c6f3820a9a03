"""The budget calculator: what a model needs in memory and the fastest it can decode, before loading it.

``fractal_opt.budget(model_or_config, ...)`` and ``fractal-opt budget MODEL`` read a config (a
local model folder, a ``config.json`` path, a dict, the embedded model's name, a ``.gguf`` file, or
a hub id when online) and answer: parameter count, weight memory, KV-cache bytes per token and for
``context × batch``, how many sequences of that context fit in a given memory, and the decode
ceiling for a given bandwidth. The pipeline's pre-flight check uses the same arithmetic.

Three files share the work: ``config_source`` finds the config (``load_config``),
``config_shape`` reads the shape from it, and this one counts bytes and answers. A transformers
config is read through ``transformers.AutoConfig`` (nothing is downloaded), so each
architecture's own defaults apply: a GPT-2 config that does not say ``tie_word_embeddings``
is tied, as GPT-2 is. What the arithmetic models beyond the Llama layout: the GPT-2 layout's
biases and learned positions, and sliding-window layers (their KV cache holds at most the window).
What it does not model it says in ``Budget.notes``: multi-head latent attention (DeepSeek), and
hybrid stacks whose layers are not all attention (Mamba / linear attention).

Example:
    >>> from fractal_opt.measure.budget import budget
    >>> b = budget({"model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
    ...             "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
    ...             "vocab_size": 49152, "tie_word_embeddings": True}, context=2048, dtype="bfloat16")
    >>> b.params, b.kv_bytes_per_token
    (134515008, 23040)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..core.errors import RecipeError
from .config_shape import Architecture, architecture, resolve_config, shape_from_config
from .config_source import load_config
from .roofline import (
    ModelShape,
    decode_ceiling_tokens_per_s,
    dtype_bits,
    kv_bytes_per_token,
    weight_bytes,
    weight_bytes_read_per_token,
)

# Architecture, architecture, resolve_config, shape_from_config and load_config live in
# config_shape / config_source; they stay importable from here, where the pre-flight, the census
# and the doctor have always found them.
__all__ = ["BITS", "BOUNDS", "Architecture", "Budget", "allowed", "architecture", "budget", "load_config", "out_of_bounds", "resolve_config", "shape_from_config"]


@dataclass(frozen=True)
class Budget:
    """The answer of :func:`budget` (bytes are exact integers; GB = 10^9 bytes in :meth:`to_text`)."""

    model: str
    shape: ModelShape
    dtype: str
    weights_bits: int
    kv_bits: int
    context: int
    batch: int
    params: int
    active_params: int
    weight_bytes: int
    weight_read_bytes_per_token: int
    kv_bytes_per_token: int
    kv_bytes: int  # context × batch
    total_bytes: int  # weights + KV for context × batch
    memory_bytes: int | None
    sequences_that_fit: int | None  # sequences of `context` tokens that fit next to the weights
    bandwidth_bytes_per_s: float | None
    decode_ceiling_tokens_per_s: float | None  # aggregate over the batch, at the full context
    decode_ceiling_per_sequence: float | None
    other_params: int = 0  # counted beyond the shape's blocks: learned positions, the GPT-2 layout's biases
    sliding_layers: int = 0  # layers whose KV cache holds at most `sliding_window` tokens
    sliding_window: int | None = None
    notes: tuple[str, ...] = ()  # what the arithmetic does not model for this architecture

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_text(self) -> str:
        """A short human-readable table (what ``fractal-opt budget`` prints)."""
        s = self.shape
        gb = 1e9
        lines = [
            f"model            {self.model} ({s.model_type}: {s.layers} layers, hidden {s.hidden}, {s.heads} heads / {s.kv_heads} KV heads x {s.head_dim}, vocab {s.vocab}"
            + (", tied embeddings" if s.tied_embeddings else "") + (f", {s.experts} experts ({s.active_experts} active)" if s.experts > 1 else "") + ")",
            f"parameters       {self.params:,}" + (f" ({self.active_params:,} active per token)" if self.active_params != self.params else ""),
            f"weights          {self.weight_bytes / gb:.3f} GB ({self.dtype}" + (f", block linear layers at {self.weights_bits} bits" if self.weights_bits != dtype_bits(self.dtype) else "") + ")",
            f"KV cache         {self.kv_bytes_per_token:,} bytes/token at {self.kv_bits} bits = 2 x {s.layers} layers x {s.kv_heads} KV heads x {s.head_dim} x {self.kv_bits // 8 if self.kv_bits >= 8 else self.kv_bits / 8} bytes",
            f"KV for context   {self.kv_bytes / gb:.3f} GB ({self.context} tokens x batch {self.batch}"
            + (f"; {self.sliding_layers} of {s.layers} layers hold at most their {self.sliding_window}-token window" if self.sliding_layers else "") + ")",
            f"total            {self.total_bytes / gb:.3f} GB (weights + KV)",
        ]
        if self.memory_bytes is not None:
            fit = self.sequences_that_fit
            lines.append(f"fits in          {self.memory_bytes / gb:.1f} GB: {fit:,} sequences of {self.context} tokens" if fit else
                         f"fits in          {self.memory_bytes / gb:.1f} GB: no (the weights alone need {self.weight_bytes / gb:.3f} GB)")
        if self.bandwidth_bytes_per_s is not None:
            lines.append(f"decode ceiling   {self.decode_ceiling_tokens_per_s:.1f} tokens/s aggregate, {self.decode_ceiling_per_sequence:.1f} per sequence "
                         f"at {self.bandwidth_bytes_per_s / gb:.1f} GB/s ({self.weight_read_bytes_per_token / gb:.3f} GB of weights + KV of {self.context} tokens x {self.batch} per step)")
        lines += [f"warning          {note}" for note in self.notes]
        return "\n".join(lines)


def budget(
    model_or_config: str | Path | Mapping[str, Any],
    *,
    context: int = 2048,
    batch: int = 1,
    dtype: str = "bfloat16",
    weights_bits: int | None = None,
    kv_bits: int | None = None,
    memory_gb: float | None = None,
    bandwidth_gbs: float | None = None,
) -> Budget:
    """Memory and decode-speed budget of a model, from its config alone (no weights are loaded).

    Args:
        model_or_config: a config dict, a ``config.json`` path, a model folder, an embedded model
            name, a ``.gguf`` file, or a hub id (needs the network or the local HF cache).
        context: tokens per sequence (prompt + output) the KV cache must hold.
        batch: sequences served together.
        dtype: storage dtype of weights and (by default) the KV cache.
        weights_bits: bits per weight of the blocks' linear layers after quantization (None = dtype).
        kv_bits: bits per KV-cache element (None = dtype).
        memory_gb: device memory (10^9 bytes) to fit the weights and KV caches into.
        bandwidth_gbs: memory bandwidth (10^9 bytes/s) for the decode ceiling.

    Raises:
        RecipeError: invalid numbers or an unknown dtype; ModelSourceError when no config can be read.
    """
    _check_numbers(context=context, batch=batch, memory_gb=memory_gb, bandwidth_gbs=bandwidth_gbs, weights_bits=weights_bits, kv_bits=kv_bits)
    bits = dtype_bits(dtype)
    label, config = load_config(model_or_config)
    arch = architecture(config, where=label)
    shape = arch.shape
    wbits = weights_bits or bits
    kbits = kv_bits or bits
    w = weight_bytes(shape, dtype_bits=bits, weights_bits=wbits) + arch.other_params * bits // 8
    # A token reads one row of a learned position table, as of the input embedding: only the biases count.
    w_read = weight_bytes_read_per_token(shape, dtype_bits=bits, weights_bits=wbits) + (arch.other_params - arch.position_params) * bits // 8
    kv_tok = kv_bytes_per_token(shape, kv_bits=kbits)
    per_layer = kv_tok // shape.layers
    full_layers = shape.layers - arch.sliding_layers
    kv_seq = per_layer * (full_layers * context + arch.sliding_layers * min(context, arch.sliding_window or context))
    kv = kv_seq * batch
    mem = int(memory_gb * 1e9) if memory_gb is not None else None
    fit = max(0, (mem - w) // kv_seq) if mem is not None else None
    bw = bandwidth_gbs * 1e9 if bandwidth_gbs is not None else None
    # The decode ceiling reads every sequence's cache at the full context: kv_seq / context per token.
    agg = decode_ceiling_tokens_per_s(weight_read_bytes=w_read, kv_bytes_per_token=kv_seq / context, context=context, batch=batch, bandwidth_bytes_per_s=bw) if bw else None
    return Budget(
        model=label, shape=shape, dtype=dtype, weights_bits=wbits, kv_bits=kbits, context=context, batch=batch,
        params=shape.params + arch.other_params, active_params=shape.active_params + arch.other_params, weight_bytes=w, weight_read_bytes_per_token=w_read,
        kv_bytes_per_token=kv_tok, kv_bytes=kv, total_bytes=w + kv, memory_bytes=mem, sequences_that_fit=fit,
        bandwidth_bytes_per_s=bw, decode_ceiling_tokens_per_s=agg, decode_ceiling_per_sequence=agg / batch if agg is not None else None,
        other_params=arch.other_params, sliding_layers=arch.sliding_layers, sliding_window=arch.sliding_window, notes=arch.notes,
    )


# --------------------------------------------------------------------------- bounds

# Sane bounds of the calculator's numbers (without them `--context 1e20` printed 51,200,000,000,000 GB):
# name -> (integer?, lowest, highest, unit). The largest contexts in use are ~10 M tokens, the
# largest accelerator memories and bandwidths a few TB and tens of TB/s; the bounds leave room.
BOUNDS: dict[str, tuple[bool, float, float, str]] = {
    "context": (True, 1, 100_000_000, "tokens"),
    "batch": (True, 1, 1_000_000, "sequences"),
    "memory_gb": (False, 0.001, 1_000_000, "GB"),
    "bandwidth_gbs": (False, 0.001, 1_000_000, "GB/s"),
}
BITS = (2, 3, 4, 5, 6, 8, 16, 32)


def _check_numbers(*, weights_bits: int | None, kv_bits: int | None, **numbers: float | None) -> None:
    """Raise RecipeError naming the first number out of :data:`BOUNDS` or bit width not in :data:`BITS`."""
    for name, value in numbers.items():
        if value is not None and (why := out_of_bounds(name, value)):
            raise RecipeError(f"budget: {name} {why}.")
    for name, value in (("weights_bits", weights_bits), ("kv_bits", kv_bits)):
        if value is not None and value not in BITS:
            raise RecipeError(f"budget: {name} must be one of {', '.join(map(str, BITS))}, got {value!r}.")


def allowed(name: str) -> str:
    """What :data:`BOUNDS` allows for ``name``, in words: ``an integer from 1 to 100,000,000 tokens``."""
    integer, low, high, unit = BOUNDS[name]
    return f"{'an integer' if integer else 'a number'} from {low:,g} to {high:,.0f} {unit}"


def out_of_bounds(name: str, value: Any) -> str | None:
    """Why ``value`` is not a sane ``name`` (``got 1e+20, expected an integer from 1 to ...``), or None."""
    integer, low, high, _ = BOUNDS[name]
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if isinstance(value, bool) or not ok_type or not (math.isfinite(value) and low <= value <= high):
        return f"got {value!r}, expected {allowed(name)}"
    return None
