"""Machine: what this computer has, probed once per run and passed to every ``check``.

Constructing a Machine stores values; :meth:`Machine.probe` is the one place that reads the
environment (and imports torch). Tests build Machines by hand to exercise ``check`` on hardware
they do not have.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import os
import platform
from dataclasses import dataclass, field
from typing import Any

from .errors import RecipeError

__all__ = ["OPTIONAL_PACKAGES", "Machine", "MachinePrice", "cpu_flags", "resolve_device"]

# Packages whose presence decides whether a pass can run (kernels, quantization backends).
OPTIONAL_PACKAGES = ("torch", "transformers", "accelerate", "bitsandbytes", "torchao", "optimum-quanto", "hqq", "flash-attn", "nvidia-ml-py", "xllamacpp", "gguf")


@dataclass(frozen=True, kw_only=True)
class Machine:
    """Facts about the machine that decide which passes can run."""

    cpu: str = "unknown"
    logical_cores: int = 1
    physical_cores: int = 1
    memory_bytes: int = 0
    cpu_flags: frozenset[str] = frozenset()
    cuda_devices: tuple[str, ...] = ()  # device names, index = CUDA ordinal
    cuda_memory_bytes: tuple[int, ...] = ()
    cuda_bf16: bool = False
    mps: bool = False
    torch_threads: int | None = None  # torch's intra-op thread count when probed (its default here)
    packages: dict[str, str | None] = field(default_factory=dict)  # name -> version or None
    price_per_hour: float | None = None  # the recipe's machine: {price_per_hour} (dollars), for the cost per token

    @property
    def has_cuda(self) -> bool:
        return bool(self.cuda_devices)

    @property
    def cpu_native_bf16(self) -> bool:
        """True when the CPU has bf16 matrix instructions (AVX512-BF16 or AMX)."""
        return bool({"avx512_bf16", "amx_bf16"} & self.cpu_flags)

    def has_package(self, name: str) -> bool:
        return self.packages.get(name) is not None

    def device_memory_bytes(self, device: str) -> int:
        """Capacity of ``device`` ("cpu", "cuda", "cuda:1", "mps")."""
        if device.startswith("cuda") and self.cuda_memory_bytes:
            index = int(device.split(":")[1]) if ":" in device else 0
            return self.cuda_memory_bytes[index]
        return self.memory_bytes

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["cpu_flags"] = sorted(f for f in self.cpu_flags if f.startswith(("avx", "amx", "fma", "neon", "sve")))
        data["cuda_devices"] = list(self.cuda_devices)
        data["cuda_memory_bytes"] = list(self.cuda_memory_bytes)
        data["platform"] = platform.platform()
        return data

    @classmethod
    def probe(cls) -> Machine:
        """Read this machine's facts (imports torch)."""
        import psutil
        import torch

        packages = {}
        for name in OPTIONAL_PACKAGES:
            try:
                packages[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                packages[name] = None
        cuda_names: list[str] = []
        cuda_mem: list[int] = []
        cuda_bf16 = False
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(i)
                cuda_names.append(props.name)
                cuda_mem.append(int(props.total_memory))
            cuda_bf16 = bool(torch.cuda.is_bf16_supported())
        mps = bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
        return cls(
            cpu=_cpu_name(),
            logical_cores=os.cpu_count() or 1,
            physical_cores=psutil.cpu_count(logical=False) or os.cpu_count() or 1,
            memory_bytes=int(psutil.virtual_memory().total),
            cpu_flags=cpu_flags(),
            cuda_devices=tuple(cuda_names),
            cuda_memory_bytes=tuple(cuda_mem),
            cuda_bf16=cuda_bf16,
            mps=mps,
            torch_threads=torch.get_num_threads(),
            packages=packages,
        )


def resolve_device(device: str, machine: Machine | None = None) -> str:
    """What ``device`` means on ``machine`` (this machine when None): ``auto`` becomes cuda, then
    mps, then cpu; other names are returned unchanged. The one device resolver of the house."""
    if device != "auto":
        return device
    m = machine or _this_machine()
    if m.has_cuda:
        return "cuda"
    return "mps" if m.mps else "cpu"


@functools.lru_cache(maxsize=1)
def _this_machine() -> Machine:
    # Probed once per process: resolve_device runs on every generate call (the torch knobs).
    return Machine.probe()


def _cpuinfo_field(key: str) -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux lists them in /proc/cpuinfo (empty elsewhere)."""
    return frozenset(_cpuinfo_field("flags").split())


@dataclass(frozen=True, kw_only=True)
class MachinePrice:
    """Recipe key ``machine``: what the machine costs, so each plan's tokens get a price.

    Attributes:
        price_per_hour: dollars an hour for the whole machine (a cloud instance's price, or the
            amortized cost of your own); each round's ``usd_per_m_tokens`` is this price for the
            round's wall time per million output tokens. None: no dollar figures.
    """

    price_per_hour: float | None = None

    def __post_init__(self) -> None:
        value = self.price_per_hour
        if value is not None and not (value > 0 and value != float("inf")):
            raise RecipeError(f"machine, key 'price_per_hour': got {value}, expected dollars per hour > 0 (finite) or null.")

    def on(self, machine: Machine) -> Machine:
        """``machine`` with this price (the probed facts unchanged)."""
        return machine if self.price_per_hour is None else dataclasses.replace(machine, price_per_hour=self.price_per_hour)

    @classmethod
    def from_data(cls, data: Any) -> MachinePrice:
        """Build from the recipe's ``machine`` mapping, naming unknown keys and wrong types."""
        from .validate import build

        return build(cls, data, where="machine")
