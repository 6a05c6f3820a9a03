"""The machine's ceilings: sustained memory bandwidth and peak matmul throughput, probed once per machine.

:func:`probe_limits` times a large read (sum) and copy and square matmuls per dtype on the device in
use, and caches the answer in ``fractal_opt.weights.models.cache_dir()/machine-<fingerprint>.json`` (the
fingerprint hashes the CPU / GPU names, core and memory counts, thread count and torch version), so
later runs read it back in milliseconds. The probe is kept short (about 2-5 s on a 2-core CPU).

The compute ceiling is the model's own kernel: ``torch.nn.functional.linear`` of a prompt's worth
of tokens at the model's shapes (hidden x hidden, as the attention projections; hidden x
intermediate, as the MLP) in each dtype, so the share of it a prefill reaches is a share of what the
same kernel can do. A square ``torch.mm`` of a size unrelated to the model (the first method) gave a
bf16 ceiling that the model's prefill "reached" 1317% of. Without a shape (no config)
square shapes are used. The bandwidth ceiling is read per dtype (a sum of a large tensor of that
dtype), since a plan reads its weights in its own dtype.

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
    from ..core.machine import Machine
    from .roofline import ModelShape

__all__ = ["MachineLimits", "fingerprint", "linear_shapes", "probe_limits"]

# Bytes moved per bandwidth probe: 256 MiB is 8x a 32 MiB L3 cache, so the sum streams from DRAM
# rather than cache (GPU: 1 GiB, beyond any L2).
_CPU_BYTES = 256 * 2**20
_GPU_BYTES = 2**30
# Matmul probe sizes: 1024^3 multiply-adds is ~0.05-0.2 s on a 2-core AVX2 CPU in fp32; bf16
# without native instructions is ~10x slower, so it gets a smaller square (512).
_MATMUL_N = {"float32": 1024, "bfloat16": 512}
_GPU_MATMUL_N = 4096
# Tokens per F.linear probe: a prompt's worth (the quickstart's long prompts are 400-600 tokens);
# on a CPU it shrinks so one call stays under _CPU_MAX_FLOP (a 7B model's 4096 x 11008 MLP at 512
# tokens is 46 GFLOP: ~10 s per call in bf16 without native instructions).
_PROBE_TOKENS = 512
_GPU_PROBE_TOKENS = 4096
_CPU_MAX_FLOP = 2e9
_MIN_PROBE_TOKENS = 16
# Dtypes whose read bandwidth is probed (a plan reads its weights in one of these; quantized weights
# fall back to the float32 reading: a sum over int8 is a slow reduction, not a bandwidth reading).
_BANDWIDTH_DTYPES = ("float32", "bfloat16")
_PROBE_VERSION = 3  # bump when the method changes, so stale cache files are not reused
# A probe taken while other work keeps more than this share of the logical cores busy (1-minute
# load average) under-measures the ceilings: it is cached but re-probed on the next run, and
# the cache keeps, per ceiling, the best reading so far (a ceiling is a maximum).
_BUSY_LOAD_SHARE = 0.5


@dataclass(frozen=True, kw_only=True)
class MachineLimits:
    """The device's measured ceilings (bytes/s, FLOP/s) and how they were measured."""

    device: str
    bandwidth_bytes_per_s: float  # sustained read bandwidth (sum of a large float32 tensor)
    copy_bandwidth_bytes_per_s: float  # read + write bytes per second of a large copy
    peak_flops: dict[str, float] = field(default_factory=dict)  # dtype -> matmul FLOP/s (best of the probed shapes)
    bandwidth_by_dtype: dict[str, float] = field(default_factory=dict)  # dtype -> read bytes/s of a tensor of that dtype
    flops_shapes: dict[str, list[list[int]]] = field(default_factory=dict)  # dtype -> [tokens, in, out] of each F.linear probe
    threads: int = 1
    probe_s: float = 0.0
    fingerprint: str = ""
    cached: bool = False
    load_average: float | None = None  # 1-minute load average when probed (None: unknown)

    def flops_for(self, dtype: str) -> float | None:
        return self.peak_flops.get(dtype) or self.peak_flops.get("float32")

    def bandwidth_for(self, dtype: str) -> float:
        """Read bandwidth of weights stored in ``dtype`` (the float32 reading when it was not probed)."""
        return self.bandwidth_by_dtype.get(dtype) or self.bandwidth_bytes_per_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fingerprint(machine: Machine, device: str, threads: int, torch_version: str, shapes: list[tuple[int, int]] | None = None) -> str:
    """A short hash of what decides the ceilings (hardware, threads, torch, the probed matmul shapes)."""
    key = json.dumps([_PROBE_VERSION, machine.cpu, machine.logical_cores, machine.physical_cores, machine.memory_bytes,
                      list(machine.cuda_devices), device, threads, torch_version, [list(x) for x in shapes or []]])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def linear_shapes(shape: ModelShape | None) -> list[tuple[int, int]]:
    """The (in, out) widths of the model's linear layers the compute probe times: hidden -> hidden
    (attention projections) and hidden -> intermediate (MLP); [] without a shape (square probes)."""
    if shape is None:
        return []
    return sorted({(shape.hidden, shape.hidden), (shape.hidden, shape.intermediate)})


def probe_limits(device: str = "cpu", *, machine: Machine | None = None, cache: bool = True, threads: int | None = None,
                 shape: ModelShape | None = None, refresh: bool = False) -> MachineLimits:
    """Measure (or read from the cache) the bandwidth and matmul ceilings of ``device``.

    Args:
        device: "cpu" or "cuda[:i]".
        machine: the probed Machine (probed here when None).
        cache: read and write ``cache_dir()/machine-<fingerprint>.json``.
        threads: intra-op threads to probe with (None = the machine's physical cores, the most a plan uses).
        shape: the model's shape: the compute probe runs F.linear at its widths (None: square matmuls).
        refresh: measure again even if a trusted cache file exists (a step reached more than 100%
            of a ceiling, so the ceiling was under-measured); the best reading per ceiling is kept.
    """
    import torch

    from ..core.machine import Machine
    from ..weights.models import cache_dir

    machine = machine or Machine.probe()
    threads = threads or machine.physical_cores
    shapes = linear_shapes(shape)
    fp = fingerprint(machine, device, threads, torch.__version__, shapes)
    path = Path(cache_dir()) / f"machine-{fp}.json"
    previous: MachineLimits | None = None
    if cache and path.is_file():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            data["cached"] = True
            previous = MachineLimits(**data)
        except (OSError, ValueError, TypeError):
            previous = None  # a corrupt or old cache file is re-measured and overwritten
        if previous is not None and not refresh and not _was_busy(previous, machine):
            return previous
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        limits = _measure(device, shapes)
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


def _read_time(device: str, n_bytes: int, dtype_name: str, sync) -> float:
    """Fastest sum of ``n_bytes`` of ``dtype_name``; the tensor dies on return."""
    import torch

    dtype = getattr(torch, dtype_name)
    x = torch.ones(n_bytes // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device)
    return _best_time(lambda: x.sum(), sync, 5)


def _copy_time(device: str, n_bytes: int, sync) -> float:
    """Fastest copy (read + write) of ``n_bytes`` of fp32."""
    import torch

    x = torch.ones(n_bytes // 4, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    return _best_time(lambda: y.copy_(x), sync, 3)


def _linear_flops(device: str, dtype_name: str, tokens: int, d_in: int, d_out: int, sync) -> float:
    """FLOP/s of ``F.linear`` of ``tokens`` rows through a ``d_in -> d_out`` weight, as a model's layer runs."""
    import torch
    import torch.nn.functional as F

    dtype = getattr(torch, dtype_name)
    x = torch.randn(tokens, d_in, device=device).to(dtype)
    w = torch.randn(d_out, d_in, device=device).to(dtype)
    t = _best_time(lambda: F.linear(x, w), sync, 2)
    return 2.0 * tokens * d_in * d_out / t  # one multiply-add = 2 FLOPs


def _probe_tokens(gpu: bool, d_in: int, d_out: int) -> int:
    """Rows of the F.linear probe: a prompt's worth, fewer on a CPU for wide layers (see _CPU_MAX_FLOP)."""
    if gpu:
        return _GPU_PROBE_TOKENS
    return max(_MIN_PROBE_TOKENS, min(_PROBE_TOKENS, int(_CPU_MAX_FLOP / (2 * d_in * d_out))))


def _measure(device: str, shapes: list[tuple[int, int]] | None = None) -> MachineLimits:
    import torch

    gpu = device.startswith("cuda")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    n_bytes = _GPU_BYTES if gpu else _CPU_BYTES
    dtypes = [*_MATMUL_N, "float16"] if gpu else list(_MATMUL_N)
    read = {d: n_bytes / _read_time(device, n_bytes, d, sync) for d in (*_BANDWIDTH_DTYPES, *(["float16"] if gpu else []))}
    copy_s = _copy_time(device, n_bytes, sync)
    flops: dict[str, float] = {}
    probed: dict[str, list[list[int]]] = {}
    for dtype_name in dtypes:
        if shapes:
            runs = [(_probe_tokens(gpu, d_in, d_out), d_in, d_out) for d_in, d_out in shapes]
        else:  # no model shape: a square matmul (the old probe)
            n = _GPU_MATMUL_N if gpu else _MATMUL_N.get(dtype_name, 512)
            runs = [(n, n, n)]
        flops[dtype_name] = max(_linear_flops(device, dtype_name, m, k, n, sync) for m, k, n in runs)
        probed[dtype_name] = [list(r) for r in runs]
    return MachineLimits(device=device, bandwidth_bytes_per_s=read["float32"], copy_bandwidth_bytes_per_s=2 * n_bytes / copy_s, peak_flops=flops,
                         bandwidth_by_dtype=read, flops_shapes=probed)


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
    read = {k: max(old.bandwidth_by_dtype.get(k, 0.0), v) for k, v in new.bandwidth_by_dtype.items()}
    return MachineLimits(**{**new.to_dict(), "bandwidth_bytes_per_s": max(old.bandwidth_bytes_per_s, new.bandwidth_bytes_per_s),
                            "copy_bandwidth_bytes_per_s": max(old.copy_bandwidth_bytes_per_s, new.copy_bandwidth_bytes_per_s), "peak_flops": flops,
                            "bandwidth_by_dtype": read})
