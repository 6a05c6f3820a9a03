"""Which modules a quantization leaves in full precision: the ``skip`` syntax of mixed precision.

A skip list is a tuple of specs; a linear layer stays unquantized when any spec matches its
fully qualified name (``model.layers.3.self_attn.q_proj``). The specs, from plain to clever:

========================  ===================================================================
spec                      matches
========================  ===================================================================
``lm_head``               a module name or a dotted part of one: ``lm_head``, ``self_attn``
                          (the exact name, a name ending in ``.self_attn``, or one under it)
``*.self_attn.*``         a glob over the full name (``fnmatch``: ``*``, ``?``, ``[..]``)
``first:2``               every module inside the first 2 decoder blocks (``layers.0``, ``layers.1``)
``last:2``                every module inside the last 2 decoder blocks
``block:5``               every module inside decoder block 5 (what ``sensitivity`` adds)
``embeddings``            alias of ``embed_tokens`` (token embeddings; no backend here quantizes
                          them, since all four quantize linear layers only, so it documents intent)
``attention``             alias of ``self_attn`` (q/k/v/o projections of every block)
========================  ===================================================================

This module is pure Python (no torch): recipes are validated with it before any model loads,
and the loader applies the same rules to every backend.

Example:
    >>> skipped("model.layers.0.mlp.up_proj", ("first:1",), n_blocks=30)
    True
    >>> skipped("model.layers.5.self_attn.q_proj", ("*.self_attn.*",), n_blocks=30)
    True
    >>> skipped("model.layers.5.mlp.up_proj", ("lm_head", "last:2"), n_blocks=30)
    False
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence

from ..core.errors import RecipeError

__all__ = ["ALIASES", "block_index", "check_skip", "expand", "skipped"]

ALIASES = {"embeddings": "embed_tokens", "attention": "self_attn"}
_BLOCK_SPEC = re.compile(r"^(first|last|block):(.*)$")
# Decoder blocks are "<prefix>.layers.<i>." in Llama/Mistral/Qwen/Gemma ("h.<i>" in GPT-2 style).
_BLOCK_NAME = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)(?:\.|$)")


def check_skip(specs: Iterable[str], *, where: str = "pass 'quantize', parameter 'skip'") -> None:
    """Reject malformed specs before any model loads.

    Raises:
        RecipeError: naming the spec, what is wrong and the accepted forms.
    """
    for spec in specs:
        if not isinstance(spec, str) or not spec.strip():
            raise RecipeError(f"{where}: got {spec!r}, expected a module name, a glob such as '*.self_attn.*', or 'first:N' / 'last:N' / 'block:I'.")
        m = _BLOCK_SPEC.match(spec)
        if m is not None:
            kind, number = m.groups()
            low = 0 if kind == "block" else 1
            if not number.isdigit() or int(number) < low:
                msg = f"{where}: {spec!r} needs a whole number >= {low} after '{kind}:' (e.g. '{kind}:{max(low, 2)}')."
                raise RecipeError(msg)


def block_index(name: str) -> int | None:
    """The decoder-block number inside a module name (``model.layers.7.mlp`` -> 7), or None."""
    m = _BLOCK_NAME.search(name)
    return int(m.group(1)) if m else None


def skipped(name: str, specs: Sequence[str], *, n_blocks: int) -> bool:
    """True when module ``name`` matches any skip spec (``n_blocks`` = decoder blocks in the model)."""
    return any(_matches(name, spec, n_blocks) for spec in specs)


def _matches(name: str, spec: str, n_blocks: int) -> bool:
    m = _BLOCK_SPEC.match(spec)
    if m is not None:
        kind, number = m.groups()
        index = block_index(name)
        if index is None:
            return False
        n = int(number)
        if kind == "first":
            return index < n
        if kind == "last":
            return index >= n_blocks - n
        return index == n
    if any(c in spec for c in "*?["):
        return fnmatch.fnmatchcase(name, spec)
    spec = ALIASES.get(spec, spec)
    return name == spec or name.endswith("." + spec) or name.startswith(spec + ".") or f".{spec}." in f".{name}."


def expand(names: Iterable[str], specs: Sequence[str], *, n_blocks: int) -> list[str]:
    """The module names among ``names`` that ``specs`` keep in full precision (for backends that
    take an explicit list, such as bitsandbytes' ``llm_int8_skip_modules``)."""
    return [n for n in names if skipped(n, specs, n_blocks=n_blocks)]
