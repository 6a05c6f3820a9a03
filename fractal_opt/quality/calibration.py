"""Calibration data: the tokens a pass looks at while it builds (never a download).

Passes that need data at build time (quantization sensitivity today; static activation scales or
GPTQ-style methods later) take it from two local places: the shipped reference text and the
workload's own prompts. The reference text's *tail* is used, while the quality probes score its
*head* (the first ``quality.reference_tokens``, 512 by default), so a pass is not tuned on the very
tokens that judge it whenever the text is longer than probe + calibration windows.

Example:
    >>> ids = calibration_ids(tokenizer, tokens=128)  # doctest: +SKIP
    >>> ids.shape                                      # doctest: +SKIP
    torch.Size([128])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .reference import reference_text

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_TOKENS", "calibration_ids"]

# 256 tokens: one forward of SmolLM2-135M over them takes a fraction of a second on 2 CPU cores,
# and the per-token KL average over 256 positions is stable to about +-10% between slices.
DEFAULT_TOKENS = 256


def calibration_ids(tokenizer: Any, *, tokens: int = DEFAULT_TOKENS, prompts: Sequence[str] = ()) -> torch.Tensor:
    """A 1-D tensor of calibration token ids: the workload ``prompts`` (rendered text) first, then
    the tail of the reference text, cut to ``tokens`` ids in all."""
    import torch

    pieces: list[torch.Tensor] = []
    for text in prompts:
        pieces.append(tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0])
    ref = tokenizer(reference_text(), return_tensors="pt", add_special_tokens=False)["input_ids"][0]
    taken = sum(p.numel() for p in pieces)
    if taken < tokens:
        pieces.append(ref[-(tokens - taken) :])
    ids = torch.cat(pieces)[:tokens] if pieces else ref[-tokens:]
    return ids
