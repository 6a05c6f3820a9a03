"""The weight ladder: a model's weights as a GGUF file of each type llama.cpp offers, made with
llama.cpp's own tools, never "quantized up".

A source has a precision (:func:`source_type`: a folder's checkpoint dtype, a GGUF's file type).
:func:`ladder` lists the block types below it, most bits first: the step an expert tries first is
8 bits, then the K-quants, then 4 bits ("8 bits first, then 4"). A type at or above the source's
bits a weight would store the same information in more bytes, so :func:`type_problem` refuses it
(widening a quantized GGUF to a 16-bit float is the dtype pass's, not the ladder's: llama.cpp then
computes in that type, which can be faster; ``widen=True``).

How each file is made (:func:`gguf_file`), every result cached by content and options:

- a folder -> llama.cpp's converter (:mod:`.convert`) for F32 / BF16 / F16 / Q8_0; any other type
  is ``llama-quantize`` over the folder converted at its own precision;
- a GGUF -> ``llama-quantize --allow-requantize`` (built by ``make setup-llama-native`` beside
  llama-server); without it, the gguf package's rewrite (:mod:`.gguf_rewrite`) for the types it
  writes (Q8_0, Q4_0), and the K-quants are refused naming the build command. Widening a GGUF to
  BF16 / F16 is always the gguf package's rewrite, which keeps the output head as stored.

The output head: ``keep_head`` (the quantize pass's ``skip: [lm_head]``, its default) leaves the
head to llama-quantize's own rule, which keeps it at a higher precision than the body (Q6_K under
the K-quants, Q8_0 under Q8_0; the gguf package keeps it at its stored type); ``keep_head=False``
writes the head and the token embedding in the target type too.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ModelSourceError
from .convert import OUTTYPES, content_digest, folder_to_gguf
from .gguf_rewrite import GGUF_TYPES, requantize
from .llama_tools import native_tool, tool_problem
from .models import ModelSource, cache_dir, gguf_metadata, read_config

__all__ = ["GGUF_METHODS", "LADDER", "WEIGHT_TYPES", "WeightType", "gguf_file", "ladder", "source_type", "type_problem"]


@dataclass(frozen=True)
class WeightType:
    """A GGUF weight type: its name as llama-quantize spells it and its bits a weight."""

    name: str
    bits: float  # bits a weight of its main block type (ggml's block bytes * 8 / block values)
    why: str  # one line for suggest's comments and the docs


# Bits a weight: ggml's block size and bytes per block (gguf.GGML_QUANT_SIZES), e.g. Q8_0 = 34
# bytes for 32 values = 8.5. The mixed K-quant types (_M) keep some tensors in a wider type (the
# head, half of the attention V and FFN down in Q6_K under Q4_K_M), so their files are a little
# larger than the body's type alone says; the order below is that of their files.
WEIGHT_TYPES: dict[str, WeightType] = {t.name: t for t in (
    WeightType("F32", 32.0, "float32: exact, the reference"),
    WeightType("BF16", 16.0, "bfloat16: half the bytes, float32's range"),
    WeightType("F16", 16.0, "float16: half the bytes, a narrower range than bfloat16"),
    WeightType("Q8_0", 8.5, "8-bit blocks of 32: about half of 16-bit's bytes, usually the same answers"),
    WeightType("Q6_K", 6.5625, "6-bit K-quant: close to 8-bit quality in three quarters of its bytes"),
    WeightType("Q5_K_M", 5.5, "5-bit K-quant, the sensitive tensors in 6 bits"),
    WeightType("Q5_0", 5.5, "5-bit blocks of 32"),
    WeightType("Q4_1", 5.0, "4-bit blocks of 32 with a minimum"),
    WeightType("Q4_K_M", 4.85, "4-bit K-quant, the sensitive tensors in 6 bits: the usual 4-bit choice"),
    WeightType("Q4_0", 4.5, "4-bit blocks of 32: the fastest 4-bit kernels on many CPUs (repacked at load)"),
    WeightType("IQ4_XS", 4.25, "4-bit non-linear K-quant: the fewest bytes of the 4-bit types"),
)}
# The types the ladder offers (a source may be of another one, such as Q4_1).
LADDER = ("Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M", "Q4_0", "IQ4_XS")
# The quantize pass's gguf methods (lower case, as recipes write them) and the bits each is filed
# under; the first of each bits is that bits' default (Q4_0 at 4: its kernels are repacked for the CPU).
GGUF_METHODS: dict[str, int] = {"q8_0": 8, "q6_k": 6, "q5_k_m": 5, "q4_0": 4, "q4_k_m": 4, "iq4_xs": 4}
_FLOATS = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_QUANTIZE_TIMEOUT_S = 3600.0


def source_type(source: ModelSource) -> str:
    """The source's weight type: a folder's checkpoint dtype (``dtype`` / ``torch_dtype`` in
    config.json; float32 when it names none, as transformers loads it) or a GGUF's ``general.file_type``."""
    assert source.path is not None, "a hub id not in the local cache has no weight type (models.hub_problem)"
    if source.folder is not None:
        config = read_config(source.folder)
        dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
        return _FLOATS.get(str(dtype), "F32")
    import gguf

    file_type = gguf_metadata(str(source.path)).get("general.file_type")
    try:
        name = gguf.LlamaFileType(int(file_type)).name if file_type is not None else "ALL_F32"
    except ValueError:
        return f"file type {file_type}"
    return "F32" if name == "ALL_F32" else name.removeprefix("MOSTLY_")


def ladder(source: ModelSource) -> tuple[str, ...]:
    """The weight types below the source's bits a weight, most bits first."""
    own = WEIGHT_TYPES.get(source_type(source))
    return tuple(t for t in LADDER if own is None or WEIGHT_TYPES[t].bits < own.bits)


def type_problem(source: ModelSource, name: str, *, widen: bool = False) -> str | None:
    """Why ``source`` cannot be made into a GGUF of type ``name`` here, or None.

    ``widen``: a 16-bit float copy of a quantized GGUF (the dtype pass on llama.cpp) is allowed.
    """
    if name not in WEIGHT_TYPES:
        return f"weight type {name!r}: llama.cpp's types here are {list(WEIGHT_TYPES)}"
    own_name = source_type(source)
    own = WEIGHT_TYPES.get(own_name)
    if own is not None and WEIGHT_TYPES[name].bits >= own.bits and name != own_name and not (widen and name in ("BF16", "F16", "F32")):
        return (f"the source is {own_name} ({own.bits:g} bits a weight): {name} ({WEIGHT_TYPES[name].bits:g}) would store the same information in "
                f"more bytes, not more precision; the ladder below it: {', '.join(ladder(source)) or 'none'}")
    if source.folder is not None and name.lower() in OUTTYPES:
        return None
    if name.lower() in GGUF_TYPES or name == own_name:
        return None
    return tool_problem(native_tool("llama-quantize"))


def gguf_file(source: ModelSource, name: str | None, *, keep_head: bool = True, progress: Callable[[str], None] = print) -> Path:
    """The GGUF file of ``source`` in weight type ``name`` (None: the source's own: a GGUF as it
    is, a folder converted at its own precision), made once and cached.

    Raises:
        ModelSourceError: the type cannot be made here (:func:`type_problem`), or a tool failed.
    """
    assert source.path is not None
    own = source_type(source)
    name = name or own
    folder = source.folder
    if folder is None and name == own:
        return source.path
    problem = type_problem(source, name, widen=True)
    if problem:
        raise ModelSourceError(f"model: {source.spec!r} as {name}: {problem}")
    if folder is not None and name.lower() in OUTTYPES:  # the converter's Q8_0 is llama-quantize's (the head in Q8_0 too)
        return folder_to_gguf(folder, name.lower(), progress=progress)
    if folder is None and name in ("BF16", "F16"):
        # Widening a quantized GGUF (the dtype pass): the gguf package keeps the head as stored (a
        # tied Q8_0 head widened would read twice its bytes a token for the same values).
        return requantize(source.path, name.lower(), keep_head=True, progress=progress)
    base = folder_to_gguf(folder, own.lower() if own.lower() in OUTTYPES else "f32", progress=progress) if folder is not None else source.path
    if tool_problem(native_tool("llama-quantize")) is None:
        return _llama_quantize(base, name, keep_head=keep_head, requantize=folder is None, progress=progress)
    return requantize(base, name.lower(), keep_head=keep_head, progress=progress)


def _quantized_path(base: Path, name: str, keep_head: bool) -> Path:
    """Keyed by the base file's content (a GGUF copied elsewhere is the same entry) and the options."""
    digest = hashlib.sha256(f"{content_digest(base)}:{name}:{keep_head}".encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{base.stem}-{name}-{digest}.gguf"


def _llama_quantize(base: Path, name: str, *, keep_head: bool, requantize: bool, progress: Callable[[str], None]) -> Path:
    """``llama-quantize`` ``base`` to ``name`` (once; cached), its last lines in the error when it fails."""
    target = _quantized_path(base, name, keep_head)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".quantizing-", suffix=".gguf", dir=target.parent)
    os.close(fd)
    argv = [str(native_tool("llama-quantize"))]
    argv += ["--allow-requantize"] if requantize else []
    argv += [] if keep_head else ["--output-tensor-type", name.lower(), "--token-embedding-type", name.lower()]
    argv += [str(base), tmp, name, str(os.cpu_count() or 1)]
    progress(f"quantizing {base.name} to {name} once with llama.cpp's llama-quantize; cached in {target}")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=_QUANTIZE_TIMEOUT_S, check=False)
        if done.returncode != 0:
            tail = "\n    ".join((done.stdout + done.stderr).strip().splitlines()[-8:])
            raise ModelSourceError(f"model: llama-quantize failed on {base.name} -> {name} (exit status {done.returncode}):\n    {tail}")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
