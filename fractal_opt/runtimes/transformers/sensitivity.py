"""Mixed precision by measurement: which decoder blocks must stay in full precision.

Called by the loader when a plan sets ``quant_sensitivity_max_kl`` (a ``quantize`` pass with
``sensitivity: true``). It needs the loaded model, so it runs in the engine's build, not in the
pass's pure ``apply``; its outcome is part of the built weights (keyed by ``Plan.weights_key``)
and is recorded in the census (``quantization.sensitivity``).

Method, on the calibration tokens (fractal_opt.calibration: the reference text's tail):

1. the full-precision model's next-token distributions are the reference;
2. each block is quantized alone (a copy swapped in, then swapped back) and its KL measured;
3. the k most sensitive blocks stay in full precision and all other candidates are quantized
   together; the smallest k whose KL is at most ``max_kl`` is found by bisection.

Cost: one forward per block plus about log2(blocks) more, over ``DEFAULT_TOKENS`` tokens
(SmolLM2-135M: 30 + 5 forwards of 256 tokens).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from ...core.errors import EngineError
from ...quality.calibration import calibration_ids
from ...tower.quant_select import skipped

__all__ = ["choose_skips"]


def _blocks(model: Any) -> tuple[str, Any]:
    """The name and ModuleList of the decoder blocks (``model.layers`` in Llama-family models)."""
    import torch

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks") and len(module) > 0:
            return name, module
    raise EngineError("sensitivity: found no list of decoder blocks (a ModuleList named layers, h or blocks) in this model")


def _logprobs(model: Any, ids: Any) -> Any:
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids.view(1, -1).to(model.device), use_cache=False).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


def _kl(base: Any, cand: Any) -> float:
    return float((base.exp() * (base - cand)).sum(-1).clamp_min(0).mean())


def choose_skips(
    model: Any,
    tokenizer: Any,
    *,
    quantize: Callable[[Any, str], None],
    skip: tuple[str, ...],
    n_blocks: int,
    max_kl: float,
) -> dict[str, Any]:
    """Decide which blocks stay in full precision so that KL(full || quantized) <= ``max_kl``.

    Args:
        model: the loaded full-precision model (left as it was on return).
        tokenizer: its tokenizer (for the calibration tokens).
        quantize: ``quantize(block, prefix)`` quantizes one block in place, ``prefix`` being its full name.
        skip: the user's skip specs (blocks they already keep are not candidates).
        n_blocks: decoder blocks in the model (for ``last:N`` specs).
        max_kl: the KL target, usually the recipe's ``kl_mean`` guard.

    Returns:
        ``{"calibration_tokens", "max_kl", "block_kl": {i: kl}, "kept_blocks": [...], "kl": final}``.

    Raises:
        EngineError: when even the least sensitive block alone exceeds ``max_kl`` (nothing can be quantized).
    """
    container_name, blocks = _blocks(model)
    ids = calibration_ids(tokenizer)
    base = _logprobs(model, ids)
    originals = list(blocks)
    quantized, block_kl = _each_block_alone(model, container_name, blocks, ids, base, quantize=quantize, skip=skip, n_blocks=n_blocks)
    order = sorted(block_kl, key=lambda i: -block_kl[i])  # most sensitive first
    measured: dict[int, float] = {}

    def kl_keeping(k: int) -> float:
        """KL with every candidate quantized except the k most sensitive."""
        if k not in measured:
            candidates = order[k:]
            try:
                for i in candidates:
                    blocks[i] = quantized[i]
                measured[k] = _kl(base, _logprobs(model, ids)) if candidates else 0.0
            finally:
                for i in candidates:
                    blocks[i] = originals[i]
        return measured[k]

    high = _fewest_kept(kl_keeping, len(order), max_kl)
    kept = order[:high]
    kl = kl_keeping(high) if high < len(order) else 0.0
    if order and len(kept) == len(order):
        least = min(block_kl.values())
        msg = (
            f"sensitivity: no block can be quantized within max_kl={max_kl}: the least sensitive block alone gives KL {least:.4g} "
            f"on {ids.numel()} calibration tokens. Raise max_kl, use more bits, or drop the quantize pass."
        )
        raise EngineError(msg)
    return {"calibration_tokens": int(ids.numel()), "max_kl": max_kl, "block_kl": block_kl, "kept_blocks": sorted(kept), "kl": round(kl, 6)}


def _each_block_alone(model: Any, container_name: str, blocks: Any, ids: Any, base: Any, *, quantize: Callable[[Any, str], None],
                      skip: tuple[str, ...], n_blocks: int) -> tuple[dict[int, Any], dict[int, float]]:
    """Each candidate block quantized alone (a copy swapped in, then the original back): the
    quantized copies and the KL each gives, by block index. A block whose every Linear the user
    already skips is not a candidate."""
    import torch

    quantized: dict[int, Any] = {}
    block_kl: dict[int, float] = {}
    for i, block in enumerate(list(blocks)):
        prefix = f"{container_name}.{i}"
        linear = [f"{prefix}.{n}" for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)]
        if not linear or all(skipped(n, skip, n_blocks=n_blocks) for n in linear):
            continue  # the user keeps this block already: not a candidate
        q = copy.deepcopy(block)
        quantize(q, prefix)
        blocks[i] = q
        try:
            block_kl[i] = round(_kl(base, _logprobs(model, ids)), 6)
        finally:
            blocks[i] = block
        quantized[i] = q
    return quantized, block_kl


def _fewest_kept(kl_keeping: Callable[[int], float], candidates: int, max_kl: float) -> int:
    """The smallest k with ``kl_keeping(k) <= max_kl``, by bisection: keeping more of the most
    sensitive blocks lowers the KL (monotone in practice), so log2(blocks) forwards instead of one
    per block kept. k = ``candidates`` keeps everything (KL 0) and needs no forward."""
    if not candidates or kl_keeping(0) <= max_kl:
        return 0
    low, high = 1, candidates
    while low < high:
        mid = (low + high) // 2
        if kl_keeping(mid) <= max_kl:
            high = mid
        else:
            low = mid + 1
    return high
