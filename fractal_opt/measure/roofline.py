"""Roofline arithmetic: weight / KV-cache bytes, FLOPs, decode ceilings and the bottleneck label.

The three limits of LLM inference are compute (FLOP/s), memory bandwidth (bytes/s) and memory
capacity (bytes). Decoding one token reads every weight once and the KV cache of every sequence in
the batch, so its ceiling is ``bandwidth / bytes read per step``; prefill multiplies each weight
by every prompt token, so it is bounded by compute (≈ 2 FLOPs per parameter per token).

Everything here is pure arithmetic on a :class:`ModelShape` (read from a config by
:mod:`fractal_opt.budget`) and :class:`~fractal_opt.machine_limits.MachineLimits` numbers; nothing
imports torch.

Example:
    >>> shape = ModelShape(layers=30, hidden=576, heads=9, kv_heads=3, head_dim=64,
    ...                    intermediate=1536, vocab=49152, tied_embeddings=True)
    >>> kv_bytes_per_token(shape, kv_bits=16)
    23040
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import RecipeError, closest

__all__ = [
    "DTYPE_BITS",
    "KV_QUANT_GROUP",
    "ModelShape",
    "bound_label",
    "decode_ceiling_tokens_per_s",
    "dtype_bits",
    "kv_bytes_per_token",
    "kv_values_per_token",
    "prefill_flops",
    "quantized_kv_bytes_per_token",
    "step_roofline",
    "unreliable_shares",
    "weight_bytes",
]

DTYPE_BITS: dict[str, int] = {
    "float32": 32, "fp32": 32, "float": 32,
    "bfloat16": 16, "bf16": 16, "float16": 16, "fp16": 16, "half": 16,
    "float8": 8, "fp8": 8, "int8": 8, "int4": 4, "nf4": 4,
}

# Values per (scale, zero-point) pair of a quantized KV cache: transformers' q_group_size default.
KV_QUANT_GROUP = 64

# Label thresholds (fractions of a ceiling). A step at >= 50% of the bandwidth ceiling in decode is
# limited by memory traffic: the bytes decide, and fewer bytes per token is the fix; well below
# half, something else (Python, kernel launches, dequantization) decides. A rule of thumb, not a
# measurement: the label is advice, the verdicts never read it.
BOUND_FRACTION = 0.5
# A measured rate cannot exceed the machine's ceiling: a share above this means the probe
# under-measured the ceiling (taken under load, or a kernel other than the model's), not that
# the step beat it. Such a share is never reported or used for a label.
MAX_SHARE = 1.0
# Capacity-bound when the measured peak uses >= 90% of the device: the next larger batch or
# context will not fit, whatever the speed.
CAPACITY_FRACTION = 0.9


def dtype_bits(dtype: str) -> int:
    """Bits per element of a dtype name ("float32", "bf16", "int8", ...)."""
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPE_BITS:
        msg = f"unknown dtype {dtype!r}. Valid dtypes are: {sorted(DTYPE_BITS)}.{closest(key, DTYPE_BITS)}"
        raise RecipeError(msg)
    return DTYPE_BITS[key]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The numbers of a decoder-only transformer that decide its memory and FLOPs.

    Attributes:
        layers: transformer blocks.
        hidden: model width (d_model).
        heads: attention (query) heads.
        kv_heads: key/value heads (``num_key_value_heads``: < heads for GQA, 1 for MQA).
        head_dim: width of one head (``head_dim`` in the config, else hidden / heads).
        intermediate: MLP inner width.
        vocab: vocabulary size.
        tied_embeddings: the output projection shares the input embedding matrix.
        gated_mlp: three MLP matrices (gate, up, down: Llama family) rather than two (GPT-2).
        attention_bias: q/k/v projections carry biases (Qwen2).
        experts: MLP experts per layer (1 = dense).
        active_experts: experts each token uses (MoE top-k; 1 = dense).
        model_type: the config's ``model_type`` (for messages).
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    gated_mlp: bool = True
    attention_bias: bool = False
    experts: int = 1
    active_experts: int = 1
    model_type: str = "llama"

    # ------------------------------------------------------------------ parameter counts
    @property
    def attention_params(self) -> int:
        """Parameters of one block's attention: q and o are heads × head_dim wide, k and v kv_heads × head_dim."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.attention_bias else 0
        return q + kv + o + bias

    @property
    def mlp_params(self) -> int:
        """Parameters of one expert's MLP (3 matrices when gated, else 2)."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.intermediate

    @property
    def block_linear_params(self) -> int:
        """Linear-layer weights of all blocks (what weight quantization shrinks), every expert counted."""
        router = self.hidden * self.experts if self.experts > 1 else 0
        return self.layers * (self.attention_params + self.experts * self.mlp_params + router)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def norm_params(self) -> int:
        return self.layers * 2 * self.hidden + self.hidden  # two RMSNorms per block + the final one

    @property
    def params(self) -> int:
        """Total parameters (tied embeddings counted once)."""
        head = 0 if self.tied_embeddings else self.embedding_params
        return self.block_linear_params + self.embedding_params + head + self.norm_params

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies with: all but the unused experts (= params for dense models)."""
        unused = self.layers * (self.experts - self.active_experts) * self.mlp_params
        return self.params - unused


def weight_bytes(shape: ModelShape, *, dtype_bits: int = 32, weights_bits: int | None = None) -> int:
    """Bytes the weights occupy: block linear layers at ``weights_bits`` (when quantized), the
    embeddings, output head and norms at the dtype. Quantization scales are not counted (about
    2-3% extra for per-channel int8, ~6% for 4-bit with groups of 32)."""
    linear_bits = weights_bits or dtype_bits
    rest = shape.params - shape.block_linear_params
    return (shape.block_linear_params * linear_bits + rest * dtype_bits) // 8


def weight_bytes_read_per_token(shape: ModelShape, *, dtype_bits: int = 32, weights_bits: int | None = None) -> int:
    """Weight bytes one decode step reads: every active weight, except the input embedding when it
    is not tied (a token reads one row of it, not the matrix)."""
    linear_bits = weights_bits or dtype_bits
    unused = shape.layers * (shape.experts - shape.active_experts) * shape.mlp_params
    linear = shape.block_linear_params - unused
    rest = shape.params - shape.block_linear_params - (0 if shape.tied_embeddings else shape.embedding_params)
    return (linear * linear_bits + rest * dtype_bits) // 8


def kv_values_per_token(shape: ModelShape) -> int:
    """Values one token of one sequence adds to the KV cache: 2 (K and V) × layers × KV heads × head_dim.

    GQA/MQA-aware: the KV head count is ``num_key_value_heads``, not the attention head count.
    """
    return 2 * shape.layers * shape.kv_heads * shape.head_dim


def kv_bytes_per_token(shape: ModelShape, *, kv_bits: int = 32) -> int:
    """KV-cache bytes one token of one sequence holds: :func:`kv_values_per_token` × bits / 8."""
    return kv_values_per_token(shape) * kv_bits // 8


def quantized_kv_bytes_per_token(shape: ModelShape, *, kv_bits: int, scale_bits: int) -> float:
    """KV bytes per token of a quantized cache: the payload (``kv_bits`` / 8 per value) plus one
    scale and one zero-point of ``scale_bits`` each per :data:`KV_QUANT_GROUP` values.

    Example:
        >>> shape = ModelShape(layers=4, hidden=128, heads=4, kv_heads=2, head_dim=64, intermediate=256, vocab=512)
        >>> quantized_kv_bytes_per_token(shape, kv_bits=4, scale_bits=32)  # 1024 values x (0.5 + 8 / 64)
        640.0
    """
    per_value = kv_bits / 8 + 2 * (scale_bits // 8) / KV_QUANT_GROUP
    return kv_values_per_token(shape) * per_value


def prefill_flops(params: int, prompt_tokens: int) -> float:
    """FLOPs of a prefill: ≈ 2 per parameter per token (one multiply-add); attention's
    quadratic term is left out (under 10% below ~2k tokens for models of this shape)."""
    return 2.0 * params * prompt_tokens


def decode_ceiling_tokens_per_s(*, weight_read_bytes: float, kv_bytes_per_token: float, context: float, batch: int, bandwidth_bytes_per_s: float) -> float:
    """Aggregate decode tokens/s if memory bandwidth were the only limit.

    One decode step reads the weights once and the KV cache of every sequence
    (``batch × context × kv_bytes_per_token``) and produces ``batch`` tokens.
    """
    step_bytes = weight_read_bytes + batch * context * kv_bytes_per_token
    return batch * bandwidth_bytes_per_s / step_bytes if step_bytes > 0 else 0.0


def bound_label(*, bandwidth_fraction: float | None, compute_fraction: float | None, capacity_fraction: float | None) -> str:
    """Which limit a step hits: capacity-bound, bandwidth-bound, compute-bound or overhead-bound.

    Capacity first (running out of memory trumps speed), then the larger of the two speed
    fractions if it reaches :data:`BOUND_FRACTION`; otherwise the step is far below both ceilings
    and its time goes to overhead (Python, kernel launches, dequantization). "unknown" when no
    fraction could be computed.
    """
    if capacity_fraction is not None and capacity_fraction >= CAPACITY_FRACTION:
        return "capacity-bound"
    bw, fl = bandwidth_fraction or 0.0, compute_fraction or 0.0
    if bandwidth_fraction is None and compute_fraction is None:
        return "unknown"
    if max(bw, fl) < BOUND_FRACTION:
        return "overhead-bound"
    return "bandwidth-bound" if bw >= fl else "compute-bound"


def step_roofline(
    *,
    weight_read_bytes: float,
    kv_bytes_per_token: float,
    params: int,
    prompt_tokens: float | None,
    new_tokens: float | None,
    batch: int,
    decode_tokens_per_s: float | None,
    prefill_ms: float | None,
    peak_memory_bytes: float | None,
    capacity_bytes: float | None,
    bandwidth_bytes_per_s: float | None,
    peak_flops: float | None,
) -> dict[str, Any]:
    """The roofline numbers of one measured step (what trace.json stores under ``roofline``).

    Shares of a ceiling are within [0, 1]: a share above :data:`MAX_SHARE` is left out (its key
    absent, so no report prints it and no label uses it) and recorded under ``unreliable``
    (``{"bandwidth_fraction": 13.17}``: the probe under-measured that ceiling; the pipeline
    re-probes once, see :func:`unreliable_shares`).

    ``decode_tokens_per_s`` is one request's rate: in a batch every request advances one token per
    step, so it is also the step rate; ``prefill_ms`` is one prefill call (all rows of a batch). The KV read is taken at the mean decode context
    (prompt + half the new tokens).
    """
    out: dict[str, Any] = {}
    context = (prompt_tokens or 0.0) + (new_tokens or 0.0) / 2
    step_bytes = weight_read_bytes + batch * context * kv_bytes_per_token
    out["bytes_per_decode_step"] = round(step_bytes)
    out["bytes_per_token"] = round(step_bytes / max(1, batch))
    out["kv_bytes_per_token"] = round(kv_bytes_per_token)
    out["mean_context_tokens"] = round(context, 1)
    bw_fraction = fl_fraction = cap_fraction = None
    if decode_tokens_per_s:
        achieved = step_bytes * decode_tokens_per_s
        out["achieved_bandwidth_gbs"] = round(achieved / 1e9, 3)
        if bandwidth_bytes_per_s:
            ceiling = decode_ceiling_tokens_per_s(weight_read_bytes=weight_read_bytes, kv_bytes_per_token=kv_bytes_per_token, context=context, batch=batch, bandwidth_bytes_per_s=bandwidth_bytes_per_s)
            out["decode_ceiling_tokens_per_s"] = round(ceiling, 2)
            bw_fraction = _share(out, "bandwidth_fraction", achieved / bandwidth_bytes_per_s)
    if prompt_tokens and prefill_ms:
        flops = prefill_flops(params, int(prompt_tokens) * batch)  # a batch pre-fills every row
        out["prefill_flops"] = flops
        achieved_flops = flops / (prefill_ms / 1000)
        out["achieved_gflops"] = round(achieved_flops / 1e9, 2)
        if peak_flops:
            fl_fraction = _share(out, "compute_fraction", achieved_flops / peak_flops)
    if peak_memory_bytes and capacity_bytes:
        cap_fraction = peak_memory_bytes / capacity_bytes
        out["capacity_fraction"] = round(cap_fraction, 4)
    out["decode_bound"] = bound_label(bandwidth_fraction=bw_fraction, compute_fraction=None, capacity_fraction=cap_fraction)
    out["prefill_bound"] = bound_label(bandwidth_fraction=None, compute_fraction=fl_fraction, capacity_fraction=cap_fraction)
    out["bound"] = bound_label(bandwidth_fraction=bw_fraction, compute_fraction=fl_fraction, capacity_fraction=cap_fraction)
    return out


def _share(out: dict[str, Any], key: str, value: float) -> float | None:
    """Store a share of a ceiling under ``key`` when it is within [0, MAX_SHARE]; else record it
    under ``out["unreliable"]`` and return None (the label then ignores it)."""
    if value > MAX_SHARE:
        out.setdefault("unreliable", {})[key] = round(value, 4)
        return None
    out[key] = round(max(0.0, value), 4)
    return out[key]


def unreliable_shares(roofline: dict[str, Any]) -> dict[str, float]:
    """The shares of a step's roofline that exceeded their ceiling (``{}`` when all are plausible)."""
    return dict(roofline.get("unreliable") or {})
