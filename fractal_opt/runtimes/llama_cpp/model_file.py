"""Which GGUF file llama.cpp loads for a plan: the plan's weight type, asked of fractal_opt.weights.

llama.cpp computes in the stored weight types, so a plan's weights are one GGUF file: the quantize
pass (backend gguf) names a block type of the weight ladder (``quant_method``: q8_0, q4_k_m, ...),
which replaces a 16-bit dtype kept before it (BF16 -> Q8_0 is the ladder's next rung, from the
source's own weights); a 16-bit dtype names a float type; otherwise the source serves as it is (a
GGUF) or as float32 (a model folder, converted exactly). The runtime converts nothing itself: :func:`model_file` asks
:func:`fractal_opt.weights.ladder.gguf_file`, which runs llama.cpp's converter and llama-quantize.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ...core.errors import ModelSourceError
from ...tower.plan import Plan
from ...weights.convert import conversion_problem
from ...weights.ladder import gguf_file, type_problem
from ...weights.models import ModelSource, hub_problem, resolve

__all__ = ["DTYPE_TYPES", "model_file", "source_problem", "weight_type"]

# plan.hardware.dtype -> GGUF type: on llama.cpp a 16-bit dtype is a copy of the weights in that float type.
DTYPE_TYPES = {"bfloat16": "BF16", "float16": "F16"}


def weight_type(plan: Plan, source: ModelSource) -> str | None:
    """The GGUF weight type ``plan`` asks for; None: the source GGUF as it is."""
    if plan.model.quant_backend == "gguf" and plan.model.quant_method:
        return plan.model.quant_method.upper()
    if plan.hardware.dtype in DTYPE_TYPES:
        return DTYPE_TYPES[plan.hardware.dtype]
    return "F32" if source.folder is not None else None


def source_problem(plan: Plan) -> str | None:
    """Why llama.cpp cannot get ``plan``'s weights here: a hub id not cached, a folder whose
    architecture the converter does not know (or no converter), a weight type above the source's
    or one that needs llama-quantize. Reads headers and config.json only."""
    try:
        source = resolve(plan.source)
        if (problem := hub_problem(source)) is not None:
            return problem
        if source.folder is not None and (problem := conversion_problem(source.folder)) is not None:
            return f"source={plan.source!r}: {problem}"
        wanted = weight_type(plan, source)
        if wanted is None:
            return None
        problem = type_problem(source, wanted, widen=plan.model.quant_backend != "gguf")
    except ModelSourceError as e:
        return str(e)
    return f"{_field(plan)}: {problem}" if problem else None


def _field(plan: Plan) -> str:
    if plan.model.quant_backend == "gguf":
        return f"model.quant_method={plan.model.quant_method!r}"
    return f"hardware.dtype={plan.hardware.dtype!r}"


def model_file(plan: Plan, *, progress: Callable[[str], None] = print) -> Path:
    """The GGUF file llama.cpp loads for ``plan`` (made and cached on first use).

    Raises:
        ModelSourceError: the file cannot be made here (the reason names the tool or the type).
    """
    source = resolve(plan.source)
    if (problem := hub_problem(source)) is not None:
        raise ModelSourceError(problem)
    keep_head = plan.model.quant_backend != "gguf" or "lm_head" in plan.model.quant_skip
    return gguf_file(source, weight_type(plan, source), keep_head=keep_head, progress=progress)
