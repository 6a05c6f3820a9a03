"""Layer 1, hardware: the knobs of torch itself, set by the transformers runtime in its own process.

Passes: ``matmul_precision`` (TF32 on CUDA), ``compile`` (torch.compile of the decode step) and
``prepack`` (oneDNN's blocked weight layout for named Linear modules, CPU). They live apart from
:mod:`.hardware` (where the model runs, its dtype and threads) because each is one torch switch with
its own GPU / CPU condition; :mod:`.hardware` re-exports them, so both import paths name the same
classes. No torch at module level: ``check`` reads the plan and the machine only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..core.errors import RecipeError
from ..core.machine import Machine, resolve_device
from ..tower.passes import Layer, Pass, register
from ..tower.plan import Plan

__all__ = ["Compile", "MatmulPrecision", "Prepack"]

@register
@dataclass(frozen=True, kw_only=True)
class MatmulPrecision(Pass):
    """Let float32 matmuls use TF32 (CUDA, compute capability >= 8.0) or bf16 passes: torch.set_float32_matmul_precision.

    ``high`` = TF32 (10-bit mantissa inputs, fp32 accumulate), ``medium`` = bf16. Attacks compute
    (tensor cores run TF32 ~8x faster than fp32 FMA). Only float32 plans are affected. On CPUs the
    knob reaches oneDNN's bf16 path only where bf16 matrix units exist (AVX512-BF16 / AMX).
    """

    name = "matmul_precision"
    layer = Layer.HARDWARE

    precision: Literal["highest", "high", "medium"] = "high"

    def unavailable(self, machine: Machine) -> str | None:
        # A machine-only reason: with neither a TF32 GPU nor CPU bf16 matrix units, `check` would
        # refuse every plan here, so `fractal-opt passes` must not call the pass available.
        if self.precision == "highest" or machine.cuda_bf16 or machine.cpu_native_bf16:
            return None
        gpu = "this GPU is older than compute capability 8.0" if machine.has_cuda else "there is no CUDA GPU"
        return f"lower matmul precision needs TF32 (a CUDA GPU of compute capability >= 8.0) or CPU bf16 matrix units (AVX512-BF16 or AMX); {gpu} and this CPU has no bf16 units"

    def check(self, plan: Plan, machine: Machine) -> str | None:
        hw = plan.hardware
        if hw.dtype != "float32":
            return f"matmul precision changes float32 matmuls only; the plan runs in {hw.dtype}"
        device = resolve_device(hw.device, machine)
        if device.startswith("cuda"):
            if machine.has_cuda and not machine.cuda_bf16:
                return "TF32 needs a GPU of compute capability >= 8.0 (Ampere or newer); this one has none"
            return None
        if device == "cpu" and self.precision != "highest" and not machine.cpu_native_bf16:
            return (
                f"matmul precision {self.precision!r} only changes CPU matmuls on CPUs with bf16 matrix units (AVX512-BF16 or AMX); "
                "this CPU has none, so there is nothing to gain (TF32 is a CUDA feature)"
            )
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("hardware", matmul_precision=self.precision)


# --------------------------------------------------------------------------- compile


@register
@dataclass(frozen=True, kw_only=True)
class Compile(Pass):
    """torch.compile the decode step (with a static KV cache, so every step has one shape).

    Attacks per-token overhead (Python, kernel launches, unfused elementwise ops). The compile
    itself runs at start-up: the pipeline records it as ``compile_s`` and keeps it out of the
    steady-state numbers. ``reduce-overhead`` adds CUDA graphs (CUDA only); ``max-autotune``
    also benchmarks kernel variants (minutes of start-up). A context_cap pass fixes the static
    cache size, so prompts of different lengths reuse one compiled graph instead of recompiling.
    """

    name = "compile"
    layer = Layer.HARDWARE

    mode: Literal["default", "reduce-overhead", "max-autotune"] = "default"

    def check(self, plan: Plan, machine: Machine) -> str | None:
        hw, mp = plan.hardware, plan.model
        device = resolve_device(hw.device, machine)
        if self.mode == "reduce-overhead" and not device.startswith("cuda"):
            return "mode 'reduce-overhead' captures CUDA graphs and needs a CUDA device; on this plan's device use mode 'default'"
        if mp.kv_cache in ("quantized", "offloaded", "off"):
            return f"compiling the decode step needs a static KV cache; the plan's {mp.kv_cache} cache cannot be compiled"
        if mp.quant_backend == "bitsandbytes":
            return "bitsandbytes-quantized models cannot be compiled by transformers (hf_quantizer.is_compileable is False)"
        if hw.offload_folder is not None or any(m.startswith("cpu=") for m in hw.max_memory):
            return "compiling is not supported with CPU or disk offload (device_map); transformers skips it"
        if hw.prepack:
            return f"the plan prepacks {list(hw.prepack)} for oneDNN (TorchScript modules); compile a plan without prepack"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("hardware", compile=self.mode)


@register
@dataclass(frozen=True, kw_only=True)
class Prepack(Pass):
    """Repack named Linear weights into oneDNN's blocked layout (CPU, float32): a faster matmul kernel.

    torch's default CPU kernel is slow for a wide, shallow matrix such as a small model's output
    head (SmolLM2: 49152 x 576): one decode token's lm_head took 9.4 ms, the prepacked oneDNN
    kernel 3.9 ms, about this machine's bandwidth ceiling (docs/passes.md). Where the head is tied
    to the embedding the packed weight is a second copy (+113 MB on SmolLM2, which the default
    ``weight_mb`` guard refuses), and the sums round differently in the last bits. The engine applies it after loading and quantization, and a
    build fails if a named module is not a float32 ``torch.nn.Linear`` by then.
    """

    name = "prepack"
    layer = Layer.HARDWARE

    modules: tuple[str, ...] = ("lm_head",)

    def __post_init__(self) -> None:
        if not self.modules or not all(isinstance(m, str) and m for m in self.modules):
            raise RecipeError(f"pass 'prepack', parameter 'modules': got {list(self.modules)}, expected module names like ['lm_head'].")

    def unavailable(self, machine: Machine) -> str | None:
        import torch

        if not torch.backends.mkldnn.is_available():
            return "this torch build has no oneDNN (mkldnn) CPU kernels"
        return None

    def check(self, plan: Plan, machine: Machine) -> str | None:
        hw, mp = plan.hardware, plan.model
        if set(self.modules) <= set(hw.prepack):  # the runner would skip it too; this names the modules
            return f"the plan already prepacks {list(self.modules)}"
        if resolve_device(hw.device, machine) != "cpu" or hw.device_map is not None:
            return f"oneDNN prepacking is for CPU inference; the plan runs on {hw.device_map or hw.device}"
        if hw.dtype != "float32":
            return f"prepacking is measured for float32 weights; the plan runs in {hw.dtype}"
        if hw.compile is not None:
            return "the plan compiles the decode step; prepacked (TorchScript) modules would break the graph"
        if mp.weight_bits is not None and (quantized := [m for m in self.modules if m not in mp.quant_skip]):
            return f"the plan quantizes {quantized}; prepacking needs float weights (add them to quantize's skip)"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("hardware", prepack=tuple(sorted({*plan.hardware.prepack, *self.modules})))
