"""Layer 2, model: what the model stores and moves.

Passes: ``quantize`` (weight quantization families, mixed precision, sensitivity-driven skip
lists), ``kv_cache`` (dynamic / static / quantized / offloaded / off) and ``context_cap`` (the
longest context a deployment accepts). Calibration data, where a pass needs it, comes from the
shipped reference text (fractal_opt.calibration), never from a download.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..core.errors import RecipeError
from ..core.machine import Machine, resolve_device
from ..engine.registry import capabilities_of
from ..tower.passes import Layer, Pass, register
from ..tower.plan import Plan
from ..tower.quant_select import check_skip
from ..weights.ladder import GGUF_METHODS

__all__ = ["BACKEND_PACKAGES", "METHODS", "ContextCap", "KVCache", "Quantize"]

# Which package implements each backend (for check messages and the machine's package census).
BACKEND_PACKAGES = {"torchao": "torchao", "bitsandbytes": "bitsandbytes", "quanto": "optimum-quanto", "hqq": "hqq", "gguf": "gguf"}

# (backend, bits) -> methods it offers, the default first.
#   torchao  weight_only: int8 per channel / int4 in groups (Intx on CPU, Int4 on CUDA);
#            dynamic: int8 weights and int8 activations quantized per token at run time.
#   bitsandbytes int8: LLM.int8() (outlier columns kept in fp16); nf4 / fp4: 4-bit blocks of 64.
#   quanto   weight_only: qint8 / qint4 weights (int4 in groups of 128, quanto's layout).
#   gguf     the weight ladder: the GGUF file in that ggml type, for the llama_cpp runtime, made by
#            llama.cpp's own converter and llama-quantize (fractal_opt/weights/ladder.py).
METHODS: dict[tuple[str, int], tuple[str, ...]] = {
    ("torchao", 8): ("weight_only", "dynamic"),
    ("torchao", 4): ("weight_only",),
    ("bitsandbytes", 8): ("int8",),
    ("bitsandbytes", 4): ("nf4", "fp4"),
    ("quanto", 8): ("weight_only",),
    ("quanto", 4): ("weight_only",),
    **{("gguf", bits): tuple(m for m, b in GGUF_METHODS.items() if b == bits) for bits in sorted(set(GGUF_METHODS.values()), reverse=True)},
}
# Backends that quantize a loaded model (so one block at a time can be tried: sensitivity).
POST_LOAD_BACKENDS = ("torchao", "quanto")
BNB_METHODS = ("int8", "nf4", "fp4")
# The skip lists the gguf backend honours: the output head kept at its stored type, or nothing kept.
GGUF_SKIPS = ((), ("lm_head",))


@register
@dataclass(frozen=True, kw_only=True)
class Quantize(Pass):
    """Store linear-layer weights in 8 or 4 bits to cut the bytes read per decode token (bandwidth, capacity).

    ``backend: auto`` picks what works: bitsandbytes for its own methods (int8 / nf4 / fp4) and
    on CUDA; torchao otherwise (int8 weight-only decoded SmolLM2 at 9.5 tokens/s on the project's
    CPU against 5.7 for bitsandbytes int8; docs/passes.md, "Measured numbers"). ``method`` picks the
    family within a backend (see METHODS). ``group_size`` sets weights per scale for torchao 4-bit.
    ``skip`` keeps modules in full precision (names, globs, ``first:N`` / ``last:N``; see
    quant_select.py). ``sensitivity: true`` measures each block's KL when quantized alone and keeps
    the most sensitive blocks unquantized until the whole model's KL is at most ``max_kl`` (set it
    to the recipe's kl_mean guard; torchao and quanto only). The build's census says what was
    quantized; a build that quantized nothing fails the pass.

    On the llama_cpp runtime ``backend: auto`` is ``gguf``: the weights become a GGUF of a type of
    llama.cpp's weight ladder (8 bits: q8_0; 6: q6_k; 5: q5_k_m; 4: q4_0 first, q4_k_m, iq4_xs),
    made once by llama.cpp's converter and llama-quantize (fractal_opt/weights/ladder.py), never
    above the source's own bits a weight. ``skip: [lm_head]`` (the default) leaves the output head
    to llama.cpp's own rule (a wider type than the body; a quantized GGUF's head as stored).
    """

    name = "quantize"
    layer = Layer.MODEL

    bits: Literal[8, 6, 5, 4] = 8  # 6 and 5: the gguf backend's K-quants only
    backend: Literal["auto", "torchao", "bitsandbytes", "quanto", "gguf"] = "auto"
    method: Literal["auto", "weight_only", "dynamic", "int8", "nf4", "fp4", "q8_0", "q6_k", "q5_k_m", "q4_0", "q4_k_m", "iq4_xs"] = "auto"
    group_size: int | None = None  # torchao 4-bit only; None = 32 there
    skip: tuple[str, ...] = ("lm_head",)
    sensitivity: bool = False
    max_kl: float = 0.05  # the default kl_mean guard of a recipe

    def __post_init__(self) -> None:
        if self.group_size is not None and (self.group_size < 1 or self.group_size & (self.group_size - 1)):
            raise RecipeError(f"pass 'quantize', parameter 'group_size': got {self.group_size}, expected a power of two such as 32, 64 or 128.")
        if self.max_kl <= 0:
            raise RecipeError(f"pass 'quantize', parameter 'max_kl': got {self.max_kl}, expected a KL above 0 such as 0.05.")
        check_skip(self.skip)
        if self.backend != "auto" or self.method != "auto":
            self.resolve_method(self.resolve_backend(None))  # raises for a method the backend does not offer

    def resolve_backend(self, plan: Plan | None) -> str:
        """The backend this pass uses on ``plan`` (``auto`` resolved from the method, then the device)."""
        if self.backend != "auto":
            return self.backend
        if self.method in BNB_METHODS:
            return "bitsandbytes"
        if self.method in GGUF_METHODS or (plan is not None and capabilities_of(plan).weights == "gguf"):
            return "gguf"
        if self.method != "auto" or plan is None:
            return "torchao"
        return "bitsandbytes" if plan.hardware.device.startswith("cuda") and not self.sensitivity else "torchao"

    def resolve_method(self, backend: str) -> str:
        """The method on ``backend`` (``auto`` = the backend's first). Raises RecipeError if not offered."""
        offered = METHODS.get((backend, self.bits), ())
        if not offered:
            at = sorted(bits for b, bits in METHODS if b == backend)
            raise RecipeError(f"pass 'quantize', parameter 'bits': {backend} does not quantize to {self.bits} bits (it offers {at}).")
        if self.method == "auto":
            return offered[0]
        if self.method not in offered:
            others = sorted(f"{b} {bits}-bit: {', '.join(ms)}" for (b, bits), ms in METHODS.items() if self.method in ms)
            msg = f"pass 'quantize', parameter 'method': {self.method!r} is not offered by {backend} at {self.bits} bits (it offers {list(offered)})."
            raise RecipeError(msg + (f" {self.method!r} exists for " + "; ".join(others) + "." if others else ""))
        return self.method

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if plan.model.weight_bits is not None:
            return f"the plan's weights are already quantized to {plan.model.weight_bits} bits"
        backend = self.resolve_backend(plan)
        try:
            method = self.resolve_method(backend)
        except RecipeError as e:
            return str(e)
        package = BACKEND_PACKAGES[backend]
        if not machine.has_package(package):
            return f"backend {backend!r} needs the {package} package (pip install {package})"
        if backend == "gguf":
            return self._gguf_problem(plan)
        if capabilities_of(plan).weights == "gguf":
            return f"backend {backend!r} quantizes transformers models; the {plan.hardware.runtime} runtime serves a GGUF file (backend: gguf re-quantizes it)"
        device = resolve_device(plan.hardware.device, machine)
        if device == "mps" and backend != "quanto":
            return f"backend {backend!r} has no MPS kernels; use backend quanto"
        if self.group_size is not None and (backend, self.bits) != ("torchao", 4):
            return f"group_size applies to torchao 4-bit only; {backend} {self.bits}-bit ({method}) has a fixed layout"
        if self.sensitivity and backend not in POST_LOAD_BACKENDS:
            return f"sensitivity needs a backend that quantizes a loaded model one block at a time ({', '.join(POST_LOAD_BACKENDS)}); got {backend}"
        if backend == "torchao" and self.bits == 4 and device.startswith("cuda") and plan.hardware.dtype != "bfloat16":
            return "torchao int4 on CUDA (Int4WeightOnlyConfig) needs bfloat16 weights; add a dtype: bfloat16 pass first"
        if plan.hardware.offload_folder is not None:
            # Offloaded layers are placeholders on the meta device between forwards: there are no weights to quantize.
            return f"{backend} cannot quantize layers offloaded to disk (device_map with offload_folder); quantize first, then offload less"
        return None

    def _gguf_problem(self, plan: Plan) -> str | None:
        if plan.hardware.runtime != "llama_cpp":
            return f"backend 'gguf' writes a GGUF file for the llama_cpp runtime; this plan's runtime is {plan.hardware.runtime!r} (add a runtime: llama_cpp pass first)"
        if self.group_size is not None:
            return f"group_size {self.group_size}: the gguf backend writes ggml's fixed blocks of 32 weights"
        if self.sensitivity:
            return "sensitivity needs a backend that quantizes a loaded model one block at a time (torchao, quanto); the gguf backend converts the file"
        if self.skip not in GGUF_SKIPS:
            return f"skip {list(self.skip)}: the gguf backend keeps the output head (skip: [lm_head], the default) or nothing (skip: []); it has no per-module list"
        return None

    def unavailable(self, machine: Machine) -> str | None:
        backend = self.resolve_backend(None)
        if self.backend == "auto" and self.method == "auto" and machine.has_cuda and not self.sensitivity:
            backend = "bitsandbytes"
        package = BACKEND_PACKAGES[backend]
        if not machine.has_package(package):
            return f"backend {backend!r} needs the {package} package (pip install {package})"
        return None

    def apply(self, plan: Plan) -> Plan:
        backend = self.resolve_backend(plan)
        try:
            method = self.resolve_method(backend)
        except RecipeError:
            method = self.method  # check() refuses this plan; keep apply total and pure
        group = (self.group_size or 32) if (backend, self.bits) == ("torchao", 4) else None  # 32: best KL of the CPU Intx layouts
        return plan.replace_section(
            "model",
            weight_bits=self.bits,
            quant_backend=backend,
            quant_method=method,
            quant_group_size=group,
            quant_skip=self.skip,
            quant_sensitivity_max_kl=self.max_kl if self.sensitivity else None,
        )


@register
@dataclass(frozen=True, kw_only=True)
class KVCache(Pass):
    """Choose how attention keys/values are kept between decode steps: dynamic, static, quantized, offloaded, or off.

    ``static`` pre-allocates the cache (sized by context_cap when set) so compiled decode steps
    keep one shape. ``quantized`` stores keys/values in ``bits`` (quanto: 2/4, hqq: 2/4/8; the
    newest 128 tokens stay in full precision) and attacks capacity at long context; the census
    reports the bytes per 1k tokens it saves. ``offloaded`` keeps all but the current layer's
    cache in CPU RAM (GPU only). ``off`` recomputes the sequence at every step, to show what the
    cache buys (the pipeline rolls it back on any workload longer than a few tokens).
    """

    name = "kv_cache"
    layer = Layer.MODEL

    implementation: Literal["dynamic", "static", "quantized", "offloaded", "off"] = "static"
    bits: Literal[2, 4, 8] = 4  # quantized only
    # quantized only: quanto / hqq quantize transformers' cache; native = the runtime's own cache
    # types (llama.cpp q8_0 / q4_0, vLLM fp8), for plans on those runtimes.
    backend: Literal["quanto", "hqq", "native"] = "quanto"

    def __post_init__(self) -> None:
        if self.implementation == "quantized" and self.backend == "quanto" and self.bits == 8:
            raise RecipeError("pass 'kv_cache': the quanto backend stores 2 or 4 bits (got bits: 8); use backend: hqq for 8 bits.")

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if self.implementation == "offloaded" and not resolve_device(plan.hardware.device, machine).startswith("cuda"):
            return "the offloaded KV cache moves layers' keys/values from GPU memory to CPU RAM; this plan already runs on the CPU (GPU-only option)"
        if plan.hardware.compile is not None and self.implementation not in ("static", "dynamic"):
            return f"the plan compiles the decode step, which needs a static KV cache; a {self.implementation} cache would disable compilation"
        return None

    def unavailable(self, machine: Machine) -> str | None:
        package = BACKEND_PACKAGES.get(self.backend)
        if self.implementation == "quantized" and package and not machine.has_package(package):
            return f"the quantized KV cache with backend {self.backend!r} needs the {package} package (pip install {package})"
        if self.implementation == "offloaded" and not machine.has_cuda:
            return "the offloaded KV cache needs a CUDA GPU (GPU-only option)"
        return None

    def _quant(self) -> tuple[int | None, str | None]:
        return (self.bits, self.backend) if self.implementation == "quantized" else (None, None)

    def apply(self, plan: Plan) -> Plan:
        bits, backend = self._quant()
        return plan.replace_section("model", kv_cache=self.implementation, kv_bits=bits, kv_backend=backend)


@register
@dataclass(frozen=True, kw_only=True)
class ContextCap(Pass):
    """Cap the context a request may use (prompt + generated tokens); longer requests are rejected.

    Attacks capacity: the static KV cache and any memory reserve are sized for ``tokens`` instead
    of the model's maximum (SmolLM2: 8192), and compiled decode steps keep one cache shape. A
    request over the cap raises ``RequestRejected`` naming both numbers; an application-layer
    ``prompt_budget`` pass trims prompts before they reach the cap (it runs later in the tower and
    decides truncation; this pass only enforces the limit).
    """

    name = "context_cap"
    layer = Layer.MODEL

    tokens: int = 2048

    def __post_init__(self) -> None:
        if self.tokens < 16:  # below this not even a chat template plus one answer token fits
            raise RecipeError(f"pass 'context_cap', parameter 'tokens': got {self.tokens}, expected an integer >= 16 (e.g. 2048).")

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("model", context_cap=self.tokens)
