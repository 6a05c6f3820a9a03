"""Layer 1, hardware: where and how the math runs.

Passes: ``runtime`` (the inference engine: transformers, llama.cpp, vLLM), ``device`` (one
device, or accelerate's ``device_map`` over several with CPU/disk offload), ``dtype``, ``threads``, ``attention`` (kernel),
``flash_attention`` (llama.cpp's kernel switch), ``llama_batch`` (llama.cpp's ``n_batch`` /
``n_ubatch``); torch's own switches (``matmul_precision``, ``compile``, ``prepack``) are in
:mod:`.hardware_torch` and re-exported here. GPU-only options
say so in ``check``; what a runtime cannot do with a plan, the runtime refuses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from ..core.errors import RecipeError, closest
from ..core.machine import Machine, resolve_device
from ..core.validate import MAX_TOKENS
from ..engine.registry import RUNTIMES
from ..tower.batch_sizes import batch_problems
from ..tower.passes import Layer, Pass, register
from ..tower.plan import Plan

__all__ = ["Attention", "Compile", "Device", "Dtype", "FlashAttention", "LlamaBatch", "MatmulPrecision", "Prepack", "Runtime", "Threads"]

@register
@dataclass(frozen=True, kw_only=True)
class Runtime(Pass):
    """Serve the plan on another inference engine: llama.cpp (GGUF, CPU) or vLLM (GPU serving).

    The largest speed-up on a CPU: llama.cpp decodes the embedded GGUF several times faster than
    transformers does the same weights dequantized to float32. The other layers' passes keep their
    meaning; each runtime maps the plan's fields onto its own settings or refuses them (the step is
    then skipped with the runtime's reason). A runtime that changes outputs passes the same quality
    guards as a quantization.
    """

    name = "runtime"
    layer = Layer.HARDWARE

    backend: str = "llama_cpp"  # a registered runtime (fractal_opt.runtimes: transformers, llama_cpp, vllm, or a plugin's)
    # vllm: the `vllm` executable (None = $FRACTAL_OPT_VLLM, then .venv-vllm); llama_cpp: a
    # llama-server executable to run as a child process, or "native" for the one
    # `make setup-llama-native` builds for this CPU (None = xllamacpp in this process).
    path: str | None = None
    # vllm only: a running server (None = $FRACTAL_OPT_VLLM_URL), and how many GPUs one layer
    # (tensor) or the stack of layers (pipeline) is split over.
    url: str | None = None
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    # The weight type to compute in on the new runtime, switched with it (None = the plan's): a
    # second candidate such as {backend: llama_cpp, dtype: bfloat16} is the same runtime on the
    # same weights widened, for when the first one's kernels fail the quality guards.
    dtype: Literal["float32", "bfloat16", "float16"] | None = None

    def __post_init__(self) -> None:
        if self.backend not in RUNTIMES:
            valid = RUNTIMES.names()
            raise RecipeError(f"pass 'runtime', parameter 'backend': unknown runtime {self.backend!r}. Valid runtimes are: {valid}.{closest(self.backend, valid)}")
        options = RUNTIMES.get(self.backend).options  # the runtime's own table says which parameters it takes
        given = {k: v for k, v in (("path", self.path), ("url", self.url)) if v is not None}
        given.update({k: v for k, v in (("tensor_parallel", self.tensor_parallel), ("pipeline_parallel", self.pipeline_parallel)) if v != 1})
        if extra := {k: v for k, v in given.items() if k not in options}:
            takers = "; ".join(f"{k!r} applies to backends {[c.name for c in RUNTIMES if k in c.options]} only" for k in sorted(extra))
            raise RecipeError(f"pass 'runtime': {takers}; got backend {self.backend!r} with {extra}.")
        for name in ("tensor_parallel", "pipeline_parallel"):
            if getattr(self, name) < 1:
                raise RecipeError(f"pass 'runtime': {name} must be >= 1 (GPUs), got {getattr(self, name)}.")

    def unavailable(self, machine: Machine) -> str | None:
        missing = [p for p in RUNTIMES.get(self.backend).packages if not machine.has_package(p)]
        if missing:
            package = missing[0]
            return f"the {self.backend} runtime needs the {package} package (pip install {package}; make setup installs it)"
        return None

    def apply(self, plan: Plan) -> Plan:
        dtype = {"dtype": self.dtype} if self.dtype is not None else {}
        return plan.replace_section("hardware", runtime=self.backend, runtime_path=self.path, runtime_url=self.url,
                                    tensor_parallel=self.tensor_parallel, pipeline_parallel=self.pipeline_parallel, **dtype)


@register
@dataclass(frozen=True, kw_only=True)
class FlashAttention(Pass):
    """Switch llama.cpp's flash-attention kernel on or off (its default, auto, decides per model).

    A fused attention kernel reads keys/values once per tile instead of materializing the score
    matrix: it attacks prefill time on long prompts. Only llama.cpp reads this field; the
    transformers runtime chooses its kernel with the ``attention`` pass and refuses this one.
    """

    name = "flash_attention"
    layer = Layer.HARDWARE

    mode: Literal["auto", "on", "off"] = "on"

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("hardware", flash_attention=self.mode)


@register
@dataclass(frozen=True, kw_only=True)
class LlamaBatch(Pass):
    """Set llama.cpp's batch sizes: n_batch (tokens per decode call) and n_ubatch (tokens per forward pass).

    llama.cpp feeds a prompt in decode calls of at most ``n_batch`` tokens (its server puts every
    slot's tokens of one step in a call) and runs each call as forward passes of at most
    ``n_ubatch`` tokens: they set the matmul shapes of prefill and the size of the compute buffer,
    and a smaller ``n_batch`` cuts a long prefill into shorter steps, so slots that are decoding
    wait a shorter step for their next token. Which sizes are faster is for the run to measure.
    null keeps llama.cpp's default (2048 / 512). A recipe with ``n_ubatch > n_batch`` is refused
    (llama.cpp would silently run ``n_batch``). Only llama.cpp reads these fields; the
    transformers and vLLM runtimes refuse them.

    Example:
        >>> LlamaBatch(n_batch=512, n_ubatch=256).apply(Plan(source="m")).hardware.n_ubatch
        256
    """

    name = "llama_batch"
    layer = Layer.HARDWARE

    n_batch: int | None = field(default=None, metadata={"bounds": (1, MAX_TOKENS)})
    n_ubatch: int | None = field(default=None, metadata={"bounds": (1, MAX_TOKENS)})

    def __post_init__(self) -> None:
        if problems := batch_problems(self.n_batch, self.n_ubatch):
            msg = "; ".join(f"pass 'llama_batch', parameter {name!r}: got {getattr(self, name)!r}, which {why}" for name, why in problems.items())
            raise RecipeError(msg + ".")

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("hardware", n_batch=self.n_batch, n_ubatch=self.n_ubatch)


@register
@dataclass(frozen=True, kw_only=True)
class Dtype(Pass):
    """Run weights and activations in a narrower float type (fewer bytes per decode token).

    On a CPU without bf16 matrix instructions the half types read half the bytes per decode step
    but compute prefill in slow emulated kernels: a trade the policy judges, not this pass.
    """

    name = "dtype"
    layer = Layer.HARDWARE

    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if plan.hardware.dtype == self.dtype:  # the runner would skip it too; this says it in the user's words
            return f"the plan already runs in {self.dtype}"
        device = plan.hardware.device
        if device.startswith("cuda") and self.dtype == "bfloat16" and machine.has_cuda and not machine.cuda_bf16:
            return "this GPU has no bfloat16 support (compute capability < 8.0); use float16"
        if device == "mps" and self.dtype == "bfloat16":
            return "bfloat16 is not supported on every MPS device; use float16"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("hardware", dtype=self.dtype)


@register
@dataclass(frozen=True, kw_only=True)
class Threads(Pass):
    """Set the compute thread count (``auto`` = the physical cores): torch's intra-op threads, or llama.cpp's / vLLM's.

    A count equal to what the plan already runs is refused (a measured no-op only lets noise
    decide). Without a count the plan runs the runtime's own default: torch's is known from the
    machine probe; llama.cpp's and vLLM's are their own, so there the pass is measured.
    """

    name = "threads"
    layer = Layer.HARDWARE

    count: int | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.count, int) and self.count < 1:
            raise RecipeError(f"pass 'threads', parameter 'count': got {self.count}, expected an integer >= 1 or 'auto'.")

    def resolve(self, machine: Machine) -> int:
        """The thread count this pass asks for on ``machine``."""
        return machine.physical_cores if self.count == "auto" else self.count

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if plan.hardware.device != "cpu":
            return f"thread count only matters for CPU inference; the plan runs on {plan.hardware.device}"
        if isinstance(self.count, int) and self.count > machine.logical_cores:
            return f"count={self.count} exceeds the {machine.logical_cores} logical cores of this machine"
        counted = RUNTIMES.of(plan).default_threads  # the Machine attribute counting the runtime's own default, if it has one we know
        default = getattr(machine, counted) if counted else None
        current = plan.hardware.threads if isinstance(plan.hardware.threads, int) else default
        if plan.hardware.threads == "auto":
            current = machine.physical_cores
        if current is not None and self.resolve(machine) == current:
            # Measuring a no-op only invites noise to decide; say so instead.
            return f"the plan already runs {current} intra-op threads (count={self.count} resolves to {self.resolve(machine)} here)"
        return None

    def apply(self, plan: Plan) -> Plan:
        # "auto" stays symbolic in the plan so that a recipe moves between machines; the engine
        # resolves it to the physical cores of the machine it runs on. An int pins it.
        return plan.replace_section("hardware", threads=self.count)


@register
@dataclass(frozen=True, kw_only=True)
class Attention(Pass):
    """Choose the attention kernel: eager (reference), sdpa (torch fused), flash_attention_2 (CUDA)."""

    name = "attention"
    layer = Layer.HARDWARE

    implementation: Literal["eager", "sdpa", "flash_attention_2"] = "sdpa"

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if self.implementation == "flash_attention_2":
            if not plan.hardware.device.startswith("cuda"):
                return "flash_attention_2 needs a CUDA GPU; this plan runs on " + plan.hardware.device
            if plan.hardware.dtype == "float32":
                return "flash_attention_2 runs only in float16 or bfloat16; add a dtype pass first"
        return None

    def unavailable(self, machine: Machine) -> str | None:
        if self.implementation == "flash_attention_2":
            if not machine.has_cuda:
                return "flash_attention_2 needs a CUDA GPU (GPU-only pass)"
            if not machine.has_package("flash-attn"):
                return "flash_attention_2 needs the flash-attn package (pip install flash-attn)"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("hardware", attention=self.implementation)


# --------------------------------------------------------------------------- device / device_map

_DEVICE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
_SIZE = re.compile(r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$", re.IGNORECASE)


def _device_missing(device: str, machine: Machine) -> str | None:
    if device.startswith("cuda"):
        if not machine.has_cuda:
            return f"device {device!r} needs a CUDA GPU and torch sees none on this machine (GPU-only option)"
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= len(machine.cuda_devices):
            return f"device {device!r}: this machine has {len(machine.cuda_devices)} CUDA device(s), cuda:0 to cuda:{len(machine.cuda_devices) - 1}"
    if device == "mps" and not machine.mps:
        return "device 'mps' needs an Apple-silicon GPU (torch.backends.mps.is_available() is False here)"
    return None


@register
@dataclass(frozen=True, kw_only=True)
class Device(Pass):
    """Place the model: one device (cpu / cuda / cuda:N / mps / auto), or spread it with accelerate's device_map.

    ``device_map`` (``auto`` / ``balanced`` / ``balanced_low_0`` / ``sequential``) is how a model
    larger than one GPU runs inside one machine: layers fill the GPUs up to ``max_memory``
    (``{0: 20GiB, 1: 20GiB, cpu: 64GiB}``), spill to CPU RAM, then to ``offload_folder`` on disk.
    Attacks capacity; every spill trades it for bandwidth (PCIe / disk reads per token).
    """

    name = "device"
    layer = Layer.HARDWARE

    device: str = "auto"
    device_map: Literal["auto", "balanced", "balanced_low_0", "sequential"] | None = None
    # YAML: a mapping {0: 20GiB, cpu: 64GiB}; stored as sorted "device=size" strings so the pass
    # stays hashable (recipes detect duplicate passes with a set).
    max_memory: dict[str, str] | tuple[str, ...] = ()
    offload_folder: str | None = None

    def __post_init__(self) -> None:
        if not _DEVICE.match(self.device):
            msg = f"pass 'device', parameter 'device': got {self.device!r}, expected one of 'auto', 'cpu', 'cuda', 'cuda:N', 'mps'."
            raise RecipeError(msg)
        items = self.max_memory.items() if isinstance(self.max_memory, dict) else [tuple(str(m).split("=", 1)) if "=" in str(m) else (m, "") for m in self.max_memory]
        for key, size in items:
            if not (str(key).isdigit() or str(key) in ("cpu", "disk", "mps")) or not _SIZE.match(str(size)):
                msg = (
                    f"pass 'device', parameter 'max_memory': got {{{key!r}: {size!r}}}, expected a GPU index (0, 1, ...) or 'cpu' "
                    "mapped to a size such as '20GiB' or '512MB'."
                )
                raise RecipeError(msg)
        if (self.max_memory or self.offload_folder) and self.device_map is None:
            raise RecipeError("pass 'device': max_memory and offload_folder only apply with a device_map; add device_map: auto.")
        object.__setattr__(self, "max_memory", tuple(sorted(f"{k}={v}" for k, v in items)))

    def memory_spec(self) -> tuple[str, ...]:
        """``max_memory`` as the plan stores it: sorted ``"device=size"`` strings."""
        return tuple(self.max_memory)

    def check(self, plan: Plan, machine: Machine) -> str | None:
        target = resolve_device(self.device, machine)
        if (why := _device_missing(target, machine)) is not None:
            return why
        if self.device_map is not None:
            if not machine.has_package("accelerate"):
                return "device_map needs the accelerate package (pip install accelerate)"
            if not machine.has_cuda and self.offload_folder is None and not self.max_memory:
                return (
                    "device_map spreads a model over GPUs, CPU RAM and disk; this machine has no GPU, so it would put every "
                    "layer on the CPU: nothing to gain. Set offload_folder (and max_memory) to run a model larger than RAM from disk"
                )
        hw = plan.hardware
        now = (resolve_device(hw.device, machine), hw.device_map, hw.max_memory, hw.offload_folder)
        if now == (target, self.device_map, self.memory_spec(), self.offload_folder):
            return f"the plan already places the model on {target}" + (f" with device_map={self.device_map}" if self.device_map else "")
        return None

    def unavailable(self, machine: Machine) -> str | None:
        return _device_missing(resolve_device(self.device, machine), machine)

    def apply(self, plan: Plan) -> Plan:
        # "auto" stays symbolic (like threads: auto) so a recipe moves between machines; the
        # engine resolves it when it builds.
        return plan.replace_section("hardware", device=self.device, device_map=self.device_map, max_memory=self.memory_spec(), offload_folder=self.offload_folder)


# --------------------------------------------------------------------------- matmul precision


from .hardware_torch import Compile, MatmulPrecision, Prepack  # noqa: E402  (registered after the passes above: the listing keeps its order)
