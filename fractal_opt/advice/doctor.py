"""``doctor``: the troubleshooting checklist as checks, each with a verdict and what to do.

The seed's field guide (docs/troubleshooting.md) lists what to look at when something is odd:
slower after optimizing, out of memory, garbled output after quantization, an idle GPU. Each
item is a :class:`Check` here: the device and driver, the package versions and whether they
match, bf16 hardware support, other processes on the GPU, CPU threads against cores and how busy
the machine is, memory headroom for the recipe's weights + KV cache, whether the plan's context
cap fits the model's positions, and, for a built plan (``build=True``), the dtype census (did the
quantization apply?) and slow fallbacks. Without a build it reads only the environment and the
model's config (no weights), in a few seconds.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable
from typing import Any

from ..core.machine import Machine, resolve_device
from .recipe_checks import FAIL, NA, OK, WARN, Check, passes_check, runtimes_check

__all__ = ["Check", "busy_check", "doctor", "render"]

# Weights + KV above this share of the device leave no room for activations, the reference
# logits and the previous plan's model (interleaved measurement holds two).
HEADROOM_SHARE = 0.8
# Models below this many parameters gain little from weight quantization on a CPU: the bytes
# saved are few and dequantizing every matmul costs more (the field guide's 0.5B example).
SMALL_MODEL_PARAMS = 1_000_000_000


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------- environment

def device_check(machine: Machine, device: str) -> Check:
    """The device the plan runs on exists, and what driver serves it."""
    if device.startswith("cuda"):
        if not machine.has_cuda:
            return Check("device and driver", FAIL, f"the recipe runs on {device!r} but torch sees no CUDA device",
                         "install a CUDA build of torch and an NVIDIA driver, or set hardware.device to cpu")
        driver = _nvml_driver() or "unknown (install nvidia-ml-py to read it)"
        names = ", ".join(machine.cuda_devices)
        return Check("device and driver", OK, f"{names}; driver {driver}")
    if machine.has_cuda:
        return Check("device and driver", WARN, f"the plan runs on {device} while {', '.join(machine.cuda_devices)} is idle",
                     "set hardware.device: cuda (or auto) to use the GPU")
    return Check("device and driver", OK, f"{device}: {machine.cpu}, {machine.physical_cores} physical / {machine.logical_cores} logical cores, no CUDA device")


def versions_check(machine: Machine) -> Check:
    """torch / CUDA / bitsandbytes / flash-attn versions, and whether they fit each other and the device."""
    import torch

    torch_cuda = torch.version.cuda
    parts = [f"torch {torch.__version__} (CUDA build {torch_cuda or 'none: CPU-only'})"]
    problems, actions = [], []
    bnb, fa = _version("bitsandbytes"), _version("flash-attn")
    parts.append(f"bitsandbytes {bnb or 'not installed'}")
    parts.append(f"flash-attn {fa or 'not installed'}")
    parts.append(f"transformers {_version('transformers') or 'not installed'}")
    if machine.has_cuda and not torch_cuda:
        problems.append("a GPU is present but torch is a CPU-only build")
        actions.append("install the CUDA build of torch that matches the driver")
    driver_cuda = _nvml_cuda_version()
    if torch_cuda and driver_cuda and _major_minor(torch_cuda) > _major_minor(driver_cuda):
        problems.append(f"torch was built for CUDA {torch_cuda} but the driver supports CUDA {driver_cuda}")
        actions.append("upgrade the NVIDIA driver or install a torch built for an older CUDA")
    if fa and not machine.has_cuda:
        problems.append("flash-attn is installed but there is no CUDA device (it runs only on NVIDIA GPUs)")
        actions.append("ignore it on this machine (sdpa is used), or uninstall it")
    if fa and torch_cuda:
        try:
            import flash_attn  # noqa: F401
        except Exception as e:  # an ABI mismatch shows as an ImportError of its extension
            problems.append(f"flash-attn does not import against this torch ({type(e).__name__}: {str(e)[:80]})")
            actions.append("reinstall flash-attn built for this torch and CUDA")
    if bnb and machine.has_cuda and torch_cuda:
        try:
            import bitsandbytes  # noqa: F401
        except Exception as e:
            problems.append(f"bitsandbytes does not import ({type(e).__name__}: {str(e)[:80]})")
            actions.append("reinstall bitsandbytes for this CUDA version")
    if problems:
        return Check("versions", WARN, "; ".join(parts) + ". " + "; ".join(problems), "; ".join(actions))
    return Check("versions", OK, "; ".join(parts))


def bf16_check(machine: Machine, device: str, wanted: bool) -> Check:
    """Whether bfloat16 runs on hardware units here (or is emulated, and slower than float32)."""
    if device.startswith("cuda") and not machine.has_cuda:
        return Check("bf16 support", NA, "no CUDA device to ask")
    if device.startswith("cuda"):
        if machine.cuda_bf16:
            return Check("bf16 support", OK, "the GPU supports bfloat16")
        return Check("bf16 support", WARN if wanted else OK, "the GPU has no bfloat16 support (pre-Ampere)",
                     "use float16 on this GPU" if wanted else "")
    if machine.cpu_native_bf16:
        return Check("bf16 support", OK, "the CPU has bf16 matrix instructions (AVX512-BF16 / AMX)")
    flags = sorted(f for f in machine.cpu_flags if f.startswith(("avx512", "amx")))
    found = f"the CPU has no AVX512-BF16 / AMX ({'flags: ' + ', '.join(flags[:4]) if flags else 'no AVX-512'}): bfloat16 matmuls are emulated"
    return Check("bf16 support", WARN if wanted else OK, found,
                 "expect the dtype pass to bfloat16 to be rolled back on decode speed here; its saving is memory only" if wanted else "")


def gpu_processes_check(machine: Machine) -> Check:
    """Other processes on the GPU and their memory (NVML): two inference processes on one card
    each allocate memory without knowing about the other."""
    if not machine.has_cuda:
        return Check("other processes on the GPU", NA, "no CUDA device")
    try:
        import pynvml
    except ImportError:
        return Check("other processes on the GPU", NA, "nvidia-ml-py is not installed, so processes cannot be listed",
                     "pip install nvidia-ml-py (the 'gpu' extra), or run nvidia-smi")
    try:
        pynvml.nvmlInit()
        mine = os.getpid()
        others = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid != mine:
                    others.append((i, p.pid, (p.usedGpuMemory or 0) / 2**20))
    except Exception as e:  # NVML present but not usable (containers without the driver's library)
        return Check("other processes on the GPU", NA, f"NVML failed: {type(e).__name__}: {e}")
    if not others:
        return Check("other processes on the GPU", OK, "no other process holds GPU memory")
    listed = ", ".join(f"pid {pid} on GPU {i}: {mb:.0f} MB" for i, pid, mb in others[:5])
    return Check("other processes on the GPU", WARN, f"{len(others)} other process(es): {listed}",
                 "stop them before measuring: their memory and kernels count against every plan")


def threads_check(machine: Machine, plan_threads: int | str | None = None) -> Check:
    """torch's thread count against the physical cores: more threads than cores spin-wait on each other."""
    import torch

    threads = torch.get_num_threads()
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ}
    found = f"torch uses {threads} intra-op threads on {machine.physical_cores} physical / {machine.logical_cores} logical cores"
    if env:
        found += " (" + ", ".join(f"{k}={v}" for k, v in env.items()) + ")"
    if isinstance(plan_threads, int):
        found += f"; the plan asks for {plan_threads}"
        threads = plan_threads
    if threads > machine.physical_cores:
        return Check("CPU threads", WARN, found, f"use at most {machine.physical_cores} threads (the threads pass with count: auto)")
    return Check("CPU threads", OK, found)


def busy_check(machine: Machine, *, sample_s: float = 1.0) -> Check:
    """How busy the machine is with other work: CPU use of every other process over ``sample_s``
    seconds and the load average (:func:`fractal_opt.measure.busy.snapshot`, the reading the
    calibration uses). A busy machine makes every verdict noisy."""
    from ..measure.busy import snapshot

    s = snapshot(sample_s, count_children=True)
    found = f"other processes use {s.others_cores / s.cores:.0%} of the {s.cores} cores over {sample_s:g} s"
    if s.load_average:
        found += f", load average {s.load_average[0]:.2f} on {s.cores} logical cores"
    if s.processes:
        found += "; busiest: " + ", ".join(f"{p['name']} (pid {p['pid']}) {p['cpu']:.0%}" for p in s.processes[:3])
    if s.busy:
        return Check("machine load", WARN, found, "measure on a quiet machine: stop the busiest processes, or expect wide noise bands and rolled-back passes")
    return Check("machine load", OK, found)


# ---------------------------------------------------------------------------- the recipe's model

def memory_check(recipe: Any, machine: Machine, device: str, shape: Any) -> Check:
    """Weights + KV cache of the recipe's plan (every pass applied) at its context, against the device."""
    from ..measure.preflight import preflight

    plan = recipe.plan()
    context = plan.model.context_cap or _context(recipe)
    capacity = machine.device_memory_bytes(device)
    refused, n = preflight(plan, shape, context=context, n_requests=len(recipe.workload.requests()), capacity_bytes=capacity)
    need = n["weight_bytes"] + n["kv_bytes"]
    gb = 1e9
    found = (f"weights {n['weight_bytes'] / gb:.2f} GB + KV {n['kv_bytes'] / gb:.2f} GB ({context} tokens x batch {n['batch']}) = "
             f"{need / gb:.2f} GB of {capacity / gb:.1f} GB on {device}")
    if refused:
        return Check("memory headroom", FAIL, found, "fewer bytes: int8 / 4-bit weights, a smaller context cap, fewer concurrent sequences, KV-cache bits")
    if not device.startswith("cuda"):
        import psutil

        available = psutil.virtual_memory().available
        found += f"; {available / gb:.1f} GB available now"
        if need > available:
            return Check("memory headroom", WARN, found, "other processes hold the memory the plan needs: close them, or the run will swap or be killed")
    if capacity and need > HEADROOM_SHARE * capacity:
        return Check("memory headroom", WARN, found + f" (over {HEADROOM_SHARE:.0%})",
                     "interleaved measurement holds two models: expect back-to-back steps; shrink the context or the weights")
    return Check("memory headroom", OK, found)


def context_check(recipe: Any, config: dict[str, Any]) -> Check:
    """The plan's context cap (or the workload's longest request) against the model's positions."""
    positions = config.get("max_position_embeddings") or config.get("n_positions") or config.get("context_length") or _positions(recipe.model)
    plan = recipe.plan()
    cap = plan.model.context_cap
    need = cap or _context(recipe)
    what = f"context cap {cap}" if cap else f"the workload's longest request (~{need} tokens)"
    if not positions:
        return Check("context vs positions", NA, f"the model's config names no maximum position ({what})")
    if need > positions:
        return Check("context vs positions", FAIL, f"{what} exceeds the model's {positions} positions",
                     f"cap the context at {positions} or less (model pass context_cap); beyond it the output degrades or the model errors")
    return Check("context vs positions", OK, f"{what} fits the model's {positions} positions")


def _positions(model: str) -> int | None:
    """The model's positions from its files (GGUF metadata: the budget's config does not carry them)."""
    try:
        from ..weights.models import positions, resolve

        return positions(resolve(model))
    except Exception:  # an older models.py without positions(), or unreadable metadata
        return None


def _context(recipe: Any) -> int:
    """Tokens one request needs: its longest prompt (≈ 4 characters per token) plus the new tokens."""
    requests = recipe.workload.requests()
    longest = max((sum(len(c) for _, c in r.messages) for r in requests), default=0)
    return longest // 4 + recipe.workload.max_new_tokens


# ---------------------------------------------------------------------------- a built plan

def census_checks(plan: Any, census: dict[str, Any], shape: Any, machine: Machine) -> list[Check]:
    """From a built plan's census: the parameter dtypes (did quantization apply?) and slow fallbacks."""
    by_type = census.get("bytes_by_type") or {}
    total = sum(by_type.values()) or 1
    mix = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]))
    out = []
    linear, quantized = census.get("linear_layers"), census.get("quantized_linear_layers")
    if plan.model.weight_bits:
        if not quantized:
            out.append(Check("parameter dtypes", FAIL, f"the plan asks for {plan.model.weight_bits}-bit weights but no linear layer is quantized ({mix})",
                             "check the quantization backend is installed and supports this device; print the parameter dtypes"))
        else:
            out.append(Check("parameter dtypes", OK, f"{quantized} of {linear} linear layers quantized; storage {mix}"))
    else:
        expected = plan.hardware.dtype
        share = by_type.get(expected, 0) / total
        verdict = OK if share >= 0.9 else WARN
        out.append(Check("parameter dtypes", verdict, f"storage {mix} (plan dtype {expected})",
                         "" if verdict == OK else f"some weights are not in {expected}: check the dtype the model loaded with"))
    device = resolve_device(plan.hardware.device, machine)
    if plan.model.weight_bits and not device.startswith("cuda") and shape is not None and shape.params < SMALL_MODEL_PARAMS:
        out.append(Check("slow fallbacks", WARN, f"{plan.model.weight_bits}-bit weights on a {shape.params / 1e6:.0f}M-parameter model on the CPU: "
                         "dequantizing every matmul can cost more than the bytes saved",
                         "keep the quantization only if the step's measurement shows a gain; otherwise a GGUF runtime (llama.cpp) has fused kernels"))
    elif plan.hardware.dtype == "bfloat16" and not device.startswith("cuda") and not machine.cpu_native_bf16:
        out.append(Check("slow fallbacks", WARN, "bfloat16 on a CPU without bf16 instructions runs emulated kernels", "use float32 here, or int8 weights"))
    else:
        out.append(Check("slow fallbacks", OK, "no known slow path for this plan on this device"))
    return out


def _built(recipe: Any, machine: Machine, build: Callable[..., Any] | None) -> tuple[Any, dict[str, Any]]:
    from .. import runtimes

    plan = recipe.plan()
    engine = (build or runtimes.build)(plan, machine=machine, progress=lambda m: None, max_new_tokens=recipe.workload.max_new_tokens)
    try:
        return plan, engine.census()
    finally:
        engine.close()


# ---------------------------------------------------------------------------- all of it

def doctor(recipe: Any = None, *, machine: Machine | None = None, build: bool | Callable[..., Any] = False, sample_s: float = 1.0) -> list[Check]:
    """Run the checklist. ``recipe``: a Recipe (or path) whose model and plan are checked too;
    ``build``: True (or a build function) also builds the recipe's plan for the census checks."""
    from ..language.recipe import load_recipe

    machine = machine or Machine.probe()
    recipe = load_recipe(recipe) if recipe is not None else None
    plan = recipe.plan() if recipe is not None else None
    device = resolve_device(plan.hardware.device, machine) if plan is not None else resolve_device("auto", machine)
    wants_bf16 = plan is None or plan.hardware.dtype == "bfloat16" or any(p.params().get("dtype") == "bfloat16" for p in recipe.passes)
    checks = [device_check(machine, device), versions_check(machine), bf16_check(machine, device, wants_bf16), gpu_processes_check(machine),
              threads_check(machine, plan.hardware.threads if plan is not None else None), busy_check(machine, sample_s=sample_s)]
    if recipe is None:
        return checks
    checks += [passes_check(recipe, machine), runtimes_check(recipe, machine)]
    shape, config = _shape(recipe.model)
    if shape is None:
        note = f"no readable config for {recipe.model!r} (a hub id that is not downloaded, or an exotic architecture)"
        checks += [Check("memory headroom", NA, note, "download the model, or use fractal-opt budget with a config.json"),
                   Check("context vs positions", NA, note)]
    else:
        checks += [memory_check(recipe, machine, device, shape), context_check(recipe, config)]
    if build:
        try:
            built_plan, census = _built(recipe, machine, build if callable(build) else None)
            checks += census_checks(built_plan, census, shape, machine)
        except Exception as e:  # a plan that does not build is itself the finding
            checks.append(Check("parameter dtypes", FAIL, f"building the plan failed: {type(e).__name__}: {str(e)[:200]}", "run fractal-opt check, then fix the pass the message names"))
    return checks


def _shape(model: str) -> tuple[Any, dict[str, Any]]:
    from ..measure.budget import load_config, shape_from_config

    try:
        label, config = load_config(model)
        return shape_from_config(config, where=label), config
    except Exception:  # offline hub id, GGUF without a readable header, an architecture the budget does not know
        return None, {}


def render(checks: list[Check]) -> str:
    """The checklist for the terminal: one line per check, what to do indented under it."""
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"[{c.verdict:>4}] {c.name:<{width}}  {c.found}")
        if c.action:
            lines.append(f"       {'':<{width}}  -> {c.action}")
    worst = FAIL if any(c.verdict == FAIL for c in checks) else WARN if any(c.verdict == WARN for c in checks) else OK
    lines.append("")
    lines.append({OK: "Nothing found that would skew a measurement.", WARN: "Warnings above: each says what to do.",
                  FAIL: "Failures above: fix them before running."}[worst])
    return "\n".join(lines)


# ---------------------------------------------------------------------------- NVML helpers

def _nvml_driver() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:
        return None


def _nvml_cuda_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        v = int(pynvml.nvmlSystemGetCudaDriverVersion())
        return f"{v // 1000}.{(v % 1000) // 10}"
    except Exception:
        return None


def _major_minor(version: str) -> tuple[int, int]:
    parts = (version.split(".") + ["0"])[:2]
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return (0, 0)
