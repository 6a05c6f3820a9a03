"""The machine's ceilings: sustained memory bandwidth and peak matmul throughput, probed once per machine.

:func:`probe_limits` times a large read (sum) and copy and square matmuls per dtype on the device in
use, and caches the answer in ``fractal_opt.models.cache_dir()/machine-<fingerprint>.json`` (the
fingerprint hashes the CPU / GPU names, core and memory counts, thread count and torch version), so
later runs read it back in milliseconds. The probe is kept short (about 2-4 s on a 2-core CPU).

Example:
    >>> from fractal_opt.machine_limits import probe_limits
    >>> limits = probe_limits("cpu")            # doctest: +SKIP
    >>> limits.bandwidth_bytes_per_s / 1e9      # doctest: +SKIP
    24.1
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..machine import Machine

__all__ = ["MachineLimits", "fingerprint", "probe_limits"]

# Bytes moved per bandwidth probe: 256 MiB is 8x a 32 MiB L3 cache, so the sum streams from DRAM
# rather than cache (GPU: 1 GiB, beyond any L2).
_CPU_BYTES = 256 * 2**20
_GPU_BYTES = 2**30
# Matmul probe sizes: 1024^3 multiply-adds is ~0.05-0.2 s on a 2-core AVX2 CPU in fp32; bf16
# without native instructions is ~10x slower, so it gets a smaller square (512).
_MATMUL_N = {"float32": 1024, "bfloat16": 512}
_GPU_MATMUL_N = 4096
_PROBE_VERSION = 2  # bump when the method changes, so stale cache files are not reused
# A probe taken while other work keeps more than this share of the logical cores busy (1-minute
# load average) under-measures the ceilings: it is cached but re-probed on the next run, and
# the cache keeps, per ceiling, the best reading so far (a ceiling is a maximum).
_BUSY_LOAD_SHARE = 0.5


@dataclass(frozen=True, kw_only=True)
class MachineLimits:
    """The device's measured ceilings (bytes/s, FLOP/s) and how they were measured."""

    device: str
    bandwidth_bytes_per_s: float  # sustained read bandwidth (sum of a large tensor)
    copy_bandwidth_bytes_per_s: float  # read + write bytes per second of a large copy
    peak_flops: dict[str, float] = field(default_factory=dict)  # dtype -> matmul FLOP/s
    threads: int = 1
    probe_s: float = 0.0
    fingerprint: str = ""
    cached: bool = False
    load_average: float | None = None  # 1-minute load average when probed (None: unknown)

    def flops_for(self, dtype: str) -> float | None:
        return self.peak_flops.get(dtype) or self.peak_flops.get("float32")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fingerprint(machine: Machine, device: str, threads: int, torch_version: str) -> str:
    """A short hash of what decides the ceilings (hardware, threads, torch)."""
    key = json.dumps([_PROBE_VERSION, machine.cpu, machine.logical_cores, machine.physical_cores, machine.memory_bytes,
                      list(machine.cuda_devices), device, threads, torch_version])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def probe_limits(device: str = "cpu", *, machine: Machine | None = None, cache: bool = True, threads: int | None = None) -> MachineLimits:
    """Measure (or read from the cache) the bandwidth and matmul ceilings of ``device``.

    Args:
        device: "cpu" or "cuda[:i]".
        machine: the probed Machine (probed here when None).
        cache: read and write ``cache_dir()/machine-<fingerprint>.json``.
        threads: intra-op threads to probe with (None = the machine's physical cores, the most a plan uses).
    """
    import torch

    from ..machine import Machine
    from ..models import cache_dir

    machine = machine or Machine.probe()
    threads = threads or machine.physical_cores
    fp = fingerprint(machine, device, threads, torch.__version__)
    path = Path(cache_dir()) / f"machine-{fp}.json"
    previous: MachineLimits | None = None
    if cache and path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            data["cached"] = True
            previous = MachineLimits(**data)
        except (OSError, ValueError, TypeError):
            previous = None  # a corrupt or old cache file is re-measured and overwritten
        if previous is not None and not _was_busy(previous, machine):
            return previous
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        limits = _measure(device)
        limits = MachineLimits(**{**limits.to_dict(), "threads": threads, "probe_s": round(time.perf_counter() - t0, 3), "fingerprint": fp,
                                  "load_average": _load_average()})
        if previous is not None:  # an earlier probe on a busy machine: keep the best of both
            limits = _best_of(previous, limits)
    finally:
        torch.set_num_threads(before)
    if cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(limits.to_dict(), indent=2), encoding="utf-8")
        except OSError:
            pass  # a read-only cache only costs a re-probe next time
    return limits


def _best_time(fn, sync, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up: the sustained ceiling, not the mean."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _bandwidth_times(device: str, n_bytes: int, sync) -> tuple[float, float]:
    """Fastest sum (read) and copy (read + write) of ``n_bytes`` of fp32; the tensors die on return."""
    import torch

    x = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    return _best_time(lambda: x.sum(), sync, 5), _best_time(lambda: y.copy_(x), sync, 3)


def _measure(device: str) -> MachineLimits:
    import torch

    gpu = device.startswith("cuda")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    n_bytes = _GPU_BYTES if gpu else _CPU_BYTES
    read_s, copy_s = _bandwidth_times(device, n_bytes, sync)
    flops: dict[str, float] = {}
    for dtype_name, n in _MATMUL_N.items():
        n = _GPU_MATMUL_N if gpu else n
        dtype = getattr(torch, dtype_name)
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        t = _best_time(lambda a=a, b=b: torch.mm(a, b), sync, 2)
        flops[dtype_name] = 2.0 * n**3 / t  # one multiply-add = 2 FLOPs
    if gpu:
        flops["float16"] = flops["bfloat16"]  # same tensor-core rate on every GPU that has both
    return MachineLimits(device=device, bandwidth_bytes_per_s=n_bytes / read_s, copy_bandwidth_bytes_per_s=2 * n_bytes / copy_s, peak_flops=flops)


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _was_busy(limits: MachineLimits, machine: Machine) -> bool:
    """Whether a cached probe was taken while the machine was busy (so it may under-measure)."""
    return limits.load_average is None or limits.load_average > _BUSY_LOAD_SHARE * machine.logical_cores


def _best_of(old: MachineLimits, new: MachineLimits) -> MachineLimits:
    """Per ceiling, the higher reading; the load average of the newer probe."""
    flops = {k: max(old.peak_flops.get(k, 0.0), v) for k, v in new.peak_flops.items()}
    return MachineLimits(**{**new.to_dict(), "bandwidth_bytes_per_s": max(old.bandwidth_bytes_per_s, new.bandwidth_bytes_per_s),
                            "copy_bandwidth_bytes_per_s": max(old.copy_bandwidth_bytes_per_s, new.copy_bandwidth_bytes_per_s), "peak_flops": flops})
