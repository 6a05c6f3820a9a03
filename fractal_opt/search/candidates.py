"""Candidates generated, not typed: what the runtimes, the model, the machine and the load offer a layer.

For the kept plan now, :func:`generate` lists the one-change steps a layer's search may try, each
with a one-line "why" and what the roofline predicts for it:

- **the runtimes** (their capability tables, :class:`~fractal_opt.engine.capabilities.Capabilities`):
  every other runtime that runs here, on the model's own weights and, where it serves GGUF files,
  widened to BF16; the ``knobs`` rows of the plan's runtime (llama.cpp: the build for this CPU,
  flash attention, batch sizes, a q8_0 KV cache; transformers: sdpa, int8 weights);
- **the model**: its weight ladder on a GGUF runtime (:func:`fractal_opt.weights.ladder.ladder`:
  the types below the source's bits a weight, never "quantized up");
- **the machine**: one thread per physical core (and per logical core where there are more), and
  bfloat16 where the CPU or GPU has bf16 units;
- **the load**: continuous batching with slots for the load's concurrency, and a concurrency
  search whose levels start at the requests the load keeps in flight.

The prediction is the roofline's for decode, which reads every weight once a token: a step to
``b`` bits a weight from ``a`` is predicted ``a / b`` times as fast (bandwidth-bound); a knob that
moves no bytes is predicted 1.0 (no prediction: the measurement decides). Candidates are listed
most promising first; the search (:mod:`.search_pass`) drops those the gate would skip.

Example:
    >>> from fractal_opt.tower.plan import Plan
    >>> predicted_ratio(32.0, 8.5)
    3.765
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..core.machine import Machine
from ..layers import get_pass
from ..measure.roofline import dtype_bits
from ..tower.passes import Layer, Pass, SearchContext
from ..tower.plan import Plan

__all__ = ["Candidate", "generate", "plan_weight_bits", "predicted_ratio", "source_bits", "weight_type"]


@dataclass(frozen=True)
class Candidate:
    """One step a search may try: the pass, why (one line) and the roofline's predicted speed-up
    of decode against the kept plan (1.0: the roofline predicts nothing; the measurement decides)."""

    p: Pass
    why: str
    predicted: float = 1.0
    origin: str = ""  # where it came from: runtime table, weight ladder, machine, load
    bits: float = 0.0  # bits a weight the candidate plan reads per token
    bits_now: float = 0.0  # and the kept plan

    @property
    def rung(self) -> bool:
        """Whether it moves the weights to fewer bits a weight: a rung down the weight ladder."""
        return 0 < self.bits < self.bits_now

    def to_dict(self) -> dict[str, Any]:
        return {"pass": self.p.describe(), "why": self.why, "predicted": round(self.predicted, 3), "from": self.origin, "bits": self.bits}


def generate(layer: Layer, context: SearchContext) -> list[Candidate]:
    """The candidates of ``layer`` for ``context``'s kept plan, most promising first (a stable sort
    on the prediction; within a prediction, a runtime's build for this CPU first, then the order of
    the sources above)."""
    plan = context.plan
    own = _source_bits(plan.source)
    makers = {Layer.HARDWARE: _hardware, Layer.MODEL: _model, Layer.SCHEDULING: _scheduling}
    found = list(makers[layer](context)) if layer in makers else []
    out, seen = [], set()
    for name, params, why, origin in found:
        p = get_pass(name).from_params(params, where=f"search candidate ({name})")
        after = p.apply(plan)
        if after in seen:  # two rows that make the same plan (the build for this CPU, on weights already BF16)
            continue
        seen.add(after)
        now, then = plan_weight_bits(plan, own, context), plan_weight_bits(after, own, context)
        out.append(Candidate(p=p, why=why, predicted=predicted_ratio(now, then), origin=origin, bits=then, bits_now=now))
    return sorted(out, key=lambda c: (-c.predicted, not _built_for_this_cpu(c.p)))


def _built_for_this_cpu(p: Pass) -> bool:
    """Whether ``p`` moves the plan to a runtime's build for this CPU (``path: native``): where the
    roofline predicts two candidates alike (the same bytes a token), the build that uses this CPU's
    vector units goes first, and the generic one is then screened against it."""
    return p.name == "runtime" and getattr(p, "path", None) == "native"


def predicted_ratio(bits_now: float, bits_after: float) -> float:
    """Decode speed-up the roofline predicts for a change from ``bits_now`` to ``bits_after`` bits
    a weight (decode reads every weight once a token: bandwidth-bound), rounded to 3 decimals."""
    return round(bits_now / bits_after, 3) if bits_after > 0 else 1.0


def plan_weight_bits(plan: Plan, source_bits: float | None, context: SearchContext) -> float:
    """Bits a weight ``plan`` reads per token: a GGUF weight type it names, a quantization's bits,
    a 16-bit float copy, or (a GGUF runtime without either) the source's own type."""
    from ..weights.ladder import WEIGHT_TYPES

    m = plan.model
    if m.quant_backend == "gguf" and m.quant_method and m.quant_method.upper() in WEIGHT_TYPES:
        return WEIGHT_TYPES[m.quant_method.upper()].bits
    if m.weight_bits:
        return float(m.weight_bits)
    serves_gguf = _serves_gguf(plan, context)
    if serves_gguf and plan.hardware.dtype in ("bfloat16", "float16"):
        return 16.0
    if serves_gguf and source_bits is not None:
        return source_bits
    return float(dtype_bits(plan.hardware.dtype))


def weight_type(plan: Plan) -> str:
    """The weight type ``plan`` computes in, as a person names it: a GGUF type on a GGUF runtime
    (``Q4_K_M``, ``BF16``, the source's own ``Q4_1``), else the dtype and any quantization."""
    m, hw = plan.model, plan.hardware
    if m.quant_backend == "gguf" and m.quant_method:
        return m.quant_method.upper()
    if _gguf_runtime(hw.runtime):
        if hw.dtype in ("bfloat16", "float16"):
            return {"bfloat16": "BF16", "float16": "F16"}[hw.dtype]
        source = _source(plan.source)
        if source is not None and source.folder is None:
            from ..weights.ladder import source_type

            return f"{source_type(source)} (the GGUF's own)"
    return hw.dtype + (f", {m.weight_bits}-bit {m.quant_backend} weights" if m.weight_bits else "")


def _gguf_runtime(name: str) -> bool:
    from ..engine.registry import RUNTIMES

    return name in RUNTIMES and RUNTIMES.get(name).weights == "gguf"


# ---------------------------------------------------------------------------- the sources

Row = tuple[str, dict[str, Any], str, str]  # pass name, params, why, origin


def _hardware(context: SearchContext) -> Iterable[Row]:
    plan, machine = context.plan, context.machine
    unavailable = context.runtimes.availability(machine) if hasattr(context.runtimes, "availability") else {}
    for caps in context.runtimes:
        if unavailable.get(caps.name):  # a runtime that cannot run here (vLLM without a GPU, a missing package)
            continue
        if caps.name != plan.hardware.runtime:
            yield "runtime", {"backend": caps.name}, f"{caps.name}: {caps.summary}; on the model's own weights", "runtime table"
            if caps.weights == "gguf":
                yield ("runtime", {"backend": caps.name, "dtype": "bfloat16"},
                       f"{caps.name} on the weights widened to BF16: where the GGUF's quantized kernels change answers, this keeps them", "runtime table")
        for name, params, why in caps.knobs:
            if get_pass(name).layer is Layer.HARDWARE and (name == "runtime" or caps.name == plan.hardware.runtime):
                yield name, dict(params), why, f"{caps.name} table"
        if caps.name == plan.hardware.runtime and caps.weights == "gguf" and plan.hardware.dtype in ("bfloat16", "float16"):
            yield ("dtype", {"dtype": "float32"}, "the GGUF's own weight type rather than its 16-bit copy: the source's bits a weight, "
                   "if this runtime's kernels for it keep the answers", f"{caps.name} table")
    yield from _machine(plan, machine)


def _machine(plan: Plan, machine: Machine) -> Iterable[Row]:
    """Threads for this machine's cores, and bfloat16 where it has bf16 units (not on a GGUF
    runtime: there a 16-bit copy is the runtime row's, and quantized weights would be widened)."""
    yield "threads", {"count": "auto"}, f"one thread per physical core ({machine.physical_cores}): no two threads spin on one core", "machine"
    if machine.logical_cores > machine.physical_cores:
        yield "threads", {"count": machine.logical_cores}, f"every logical core ({machine.logical_cores}): hyper-threads hide memory stalls", "machine"
    gpu = plan.hardware.device.startswith("cuda")
    if (machine.cuda_bf16 if gpu else machine.cpu_native_bf16) and plan.hardware.dtype == "float32":
        yield "dtype", {"dtype": "bfloat16"}, "bfloat16: half float32's bytes a token, and this hardware has bf16 units", "machine"


def _model(context: SearchContext) -> Iterable[Row]:
    plan = context.plan
    if _serves_gguf(plan, context):
        from ..weights.ladder import GGUF_METHODS, WEIGHT_TYPES, ladder

        source = _source(plan.source)
        for name in ladder(source) if source is not None and source.path is not None else ():
            if name.lower() in GGUF_METHODS:
                yield ("quantize", {"backend": "gguf", "bits": GGUF_METHODS[name.lower()], "method": name.lower()},
                       f"the weight ladder: {name}, {WEIGHT_TYPES[name].why}; the quality gate decides whether it keeps the answers", "weight ladder")
    for caps in context.runtimes:
        if caps.name == plan.hardware.runtime:
            for name, params, why in caps.knobs:
                if get_pass(name).layer is Layer.MODEL:
                    yield name, dict(params), why, f"{caps.name} table"


def _scheduling(context: SearchContext) -> Iterable[Row]:
    """Slots and levels from the load: continuous batching sized to the load's clients, then a
    concurrency search from them (its levels double while the SLOs hold)."""
    profile = context.workload.load_profile() if getattr(context.workload, "load", None) else None
    clients = profile.concurrency if profile is not None and profile.mode == "closed" else None
    if clients is None:
        return
    yield "batching", {"mode": "continuous"}, f"the load keeps {clients} requests in flight: continuous batching serves them in one step each", "load"
    if context.plan.scheduling.batching != "sequential":
        yield ("concurrency", {"mode": "fixed", "limit": clients}, f"slots for the load's {clients} clients, not the runtime's default", "load")
        yield ("concurrency", {"mode": "fixed", "limit": 2 * clients}, f"twice the load's clients ({2 * clients}): room when it grows, if the SLOs hold", "load")


def _serves_gguf(plan: Plan, context: SearchContext) -> bool:
    for caps in context.runtimes:
        if caps.name == plan.hardware.runtime:
            return caps.weights == "gguf"
    return False


@functools.lru_cache(maxsize=8)
def _source(name: str) -> Any:
    """The model source ``name`` names, when this machine has it (None: a test's fake name)."""
    from ..core.errors import FractalOptError
    from ..weights import models

    try:
        source = models.resolve(name)
    except (FractalOptError, OSError, ValueError):
        return None
    return source if source.path is not None else None


def source_bits(name: str) -> float | None:
    """Bits a weight of the model source ``name`` as stored, or None (not a source this machine has)."""
    return _source_bits(name)


@functools.lru_cache(maxsize=8)
def _source_bits(name: str) -> float | None:
    """Bits a weight of the source as it is stored (a GGUF's type; a folder's dtype), or None."""
    from ..weights.ladder import WEIGHT_TYPES, source_type

    source = _source(name)
    if source is None:
        return None
    try:
        own = WEIGHT_TYPES.get(source_type(source))
    except (OSError, ValueError, KeyError):
        return None
    return own.bits if own is not None else None
