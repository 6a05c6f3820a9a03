"""Peak memory and GPU telemetry during a measured block (used by :mod:`fractal_opt.measure`).

CPU peak RSS: on Linux the kernel's own high-water mark ``VmHWM`` is reset through
``/proc/self/clear_refs`` before the block and read after it — exact, and free (no thread runs
during the work). Elsewhere a background sampler reads the RSS every ``SAMPLE_S`` seconds; its cost
is measured by ``benchmarks/memory_sampler.py`` (it must stay under 2%). CUDA: ``max_memory_allocated``
and ``max_memory_reserved`` after ``reset_peak_memory_stats``. NVML (``pip install nvidia-ml-py``):
process GPU memory, SM utilization, power and energy; every NVML number is ``None`` with a reason in
``gpu["status"]`` when NVML or a GPU is missing, never a made-up zero.
"""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["SAMPLE_S", "GpuMonitor", "MemoryWindow"]

# Sampler period (s). Every reading takes the GIL from the generate loop: at 10 ms the measured
# cost on SmolLM2 decode was -2.3% [-4.3%, +0.9%] (benchmarks/memory_sampler.py, 1 thread); 50 ms
# wakes it 5x less often and still sees any allocation that lives for one decode step (~50 ms).
SAMPLE_S = 0.05
_NVML_PERIOD_S = 0.1  # NVML refreshes utilization every ~100 ms at best


class MemoryWindow:
    """Peak memory (MiB) during a ``with`` block.

    Args:
        device: "cpu", "cuda[:i]" or "mps".
        method: "auto" (VmHWM on Linux, else the sampler), "vmhwm", "sampler" or "ru_maxrss".
        pids: other processes whose memory counts too (a runtime's child server): with VmHWM each
            one's own peak is added (an upper bound of the peak of the sum, exact when one of them
            holds still); the sampler adds their RSS at every reading.

    After the block: ``peak_mb`` (RSS, or CUDA max allocated on a GPU), ``source`` (how it was
    measured), ``cuda_reserved_mb`` (GPU only) and ``samples`` (sampler readings taken).
    """

    def __init__(self, device: str = "cpu", *, method: str = "auto", pids: Sequence[int] = ()):
        if method not in ("auto", "vmhwm", "sampler", "ru_maxrss"):
            raise ValueError(f"MemoryWindow: unknown method {method!r}; valid: auto, vmhwm, sampler, ru_maxrss")
        self.device = device
        self.method = method
        self.pids = tuple(pids)
        self.peak_mb: float | None = None
        self.cuda_reserved_mb: float | None = None
        self.source = "rss"
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peak_bytes = 0

    def __enter__(self) -> MemoryWindow:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.reset_peak_memory_stats()
            self.source = "cuda_max_allocated"
            return self
        if self.method in ("auto", "vmhwm") and _reset_hwm() and all(_reset_hwm(pid) for pid in self.pids):
            self.source = "vmhwm"
        elif self.method in ("auto", "sampler") and _rss_bytes() is not None:
            self.source = "sampler"
            self._peak_bytes = self._rss()
            self._thread = threading.Thread(target=self._sample, name="fractal-opt-rss-sampler", daemon=True)
            self._thread.start()
        else:
            self.source = "ru_maxrss"  # cannot be reset: the peak since the process started
        return self

    def _rss(self) -> int:
        return sum(_rss_bytes(pid) or 0 for pid in (None, *self.pids))

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._peak_bytes = max(self._peak_bytes, self._rss())
            self.samples += 1

    def __exit__(self, *exc: object) -> None:
        if self.device.startswith("cuda"):
            import torch

            self.peak_mb = torch.cuda.max_memory_allocated() / 2**20
            self.cuda_reserved_mb = torch.cuda.max_memory_reserved() / 2**20
        elif self.source == "vmhwm":
            self.peak_mb = sum(_read_hwm_kb(pid) for pid in (None, *self.pids)) / 1024
        elif self.source == "sampler":
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self._peak_bytes = max(self._peak_bytes, self._rss())  # the last moment counts too
            self.peak_mb = self._peak_bytes / 2**20
        else:
            # ru_maxrss is KiB on Linux, bytes on macOS.
            scale = 1 if os.uname().sysname == "Darwin" else 1024
            self.peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def _reset_hwm(pid: int | None = None) -> bool:
    # Writing 5 to clear_refs resets the peak-RSS counter (VmHWM) of a process (Linux >= 4.0;
    # another process's needs the right to write it: a child of this user's).
    try:
        with open(f"/proc/{pid or 'self'}/clear_refs", "w") as f:
            f.write("5")
        return _read_hwm_kb(pid) > 0
    except OSError:
        return False


def _read_hwm_kb(pid: int | None = None) -> float:
    try:
        with open(f"/proc/{pid or 'self'}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return float(line.split()[1])
    except OSError:
        pass
    return 0.0


def _rss_bytes(pid: int | None = None) -> int | None:
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:  # psutil missing, the process gone, or the platform refuses: the caller falls back
        return None


class GpuMonitor:
    """GPU utilization, power and energy during a ``with`` block, through NVML (nvidia-ml-py).

    After the block ``result()`` returns ``{"status": "ok" | "unavailable: <why>", "gpu_memory_mb",
    "sm_utilization", "power_w", "energy_j"}`` (SM utilization and power are means of samples every
    100 ms; energy is the board's energy counter difference). Every number is None
    when unavailable.
    """

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.status = "ok"
        self._nvml: Any = None
        self._handle: Any = None
        self._util: list[float] = []
        self._power: list[float] = []
        self._energy0: float | None = None
        self._energy_j: float | None = None
        self._mem_mb: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> GpuMonitor:
        if not self.device.startswith("cuda"):
            self.status = f"unavailable: device {self.device!r} is not a CUDA GPU"
            return self
        try:
            import pynvml  # provided by the nvidia-ml-py package
        except ImportError:
            self.status = "unavailable: nvidia-ml-py is not installed (pip install 'fractal-opt[gpu]')"
            return self
        try:
            pynvml.nvmlInit()
            index = int(self.device.split(":")[1]) if ":" in self.device else 0
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
            try:
                self._energy0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1000  # mJ -> J
            except pynvml.NVMLError:
                self._energy0 = None  # pre-Volta boards have no energy counter
        except Exception as e:  # driver missing, no permission
            self.status = f"unavailable: NVML failed ({type(e).__name__}: {e})"
            return self
        self._thread = threading.Thread(target=self._sample, name="fractal-opt-nvml", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        nv, h = self._nvml, self._handle
        while not self._stop.wait(_NVML_PERIOD_S):
            try:
                self._util.append(float(nv.nvmlDeviceGetUtilizationRates(h).gpu))
                self._power.append(nv.nvmlDeviceGetPowerUsage(h) / 1000)  # mW -> W
            except Exception:
                return

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        nv, h = self._nvml, self._handle
        try:
            if self._energy0 is not None:
                self._energy_j = nv.nvmlDeviceGetTotalEnergyConsumption(h) / 1000 - self._energy0
            pid = os.getpid()
            used = [p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == pid and p.usedGpuMemory]
            self._mem_mb = used[0] / 2**20 if used else None
        except Exception as e:
            self.status = f"partial: {type(e).__name__}: {e}"
        finally:
            try:
                nv.nvmlShutdown()
            except Exception:
                pass

    def result(self) -> dict[str, Any]:
        def mean(v: list[float]) -> float | None:
            return round(sum(v) / len(v), 2) if v else None

        return {"status": self.status, "gpu_memory_mb": self._mem_mb, "sm_utilization": mean(self._util), "power_w": mean(self._power), "energy_j": self._energy_j}
