"""A GGUF file rewritten in another ggml type with the ``gguf`` package (llama.cpp's own Python
library): the weight ladder's writer when llama.cpp's ``llama-quantize`` is not built here
(:mod:`.ladder` prefers that tool), and the widening of a quantized GGUF to a 16-bit float type.

``gguf.quants`` dequantizes and quantizes every ggml block type in numpy (maintained in
llama.cpp's repository) and ``GGUFWriter`` writes the file; only the copy loop is written here.

What changes: every tensor in a block-quantized type other than the target is dequantized and
quantized again to the target. Full-precision tensors (norms) keep their type, and so does the
output head (``output.weight``, or ``token_embd.weight`` when the head is tied to the embedding,
as in SmolLM2, whose head is Q8_0) unless ``keep_head`` is False. Re-quantizing adds the
target type's rounding on top of the source's, so the pipeline's quality guards judge it like any
quantization.

The result is cached next to the conversions (``fractal_opt.weights.models.cache_dir()``), keyed
by the source file (path, size, mtime) and the options, and written to a temporary file that is
renamed into place, so an interrupted rewrite never leaves a broken cache entry.

    python -m fractal_opt.weights.gguf_rewrite model.gguf --type q4_0   # prints the new file's path
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["GGUF_TYPES", "requantize", "requantized_path"]

# Target -> ggml type name: the types the gguf package writes here (block types and 16-bit floats).
GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "bf16": "BF16", "f16": "F16"}
_FULL_PRECISION = frozenset({"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"})
_FILE_TYPES = {"Q8_0": "MOSTLY_Q8_0", "Q4_0": "MOSTLY_Q4_0", "BF16": "MOSTLY_BF16", "F16": "MOSTLY_F16"}


def requantized_path(source: Path, method: str, *, keep_head: bool = True) -> Path:
    """Where the re-quantized copy of ``source`` is cached (it may not exist yet)."""
    from .models import cache_dir

    stat = source.stat()
    key = f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{method}:{keep_head}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{source.stem}-{GGUF_TYPES[method]}-{digest}.gguf"


def requantize(source: Path, method: str, *, keep_head: bool = True, progress: Callable[[str], None] = print) -> Path:
    """The path of ``source`` re-quantized to ``method`` (``q8_0`` | ``q4_0`` | ``bf16`` | ``f16``), converting once.

    Raises:
        ValueError: an unknown method.
    """
    if method not in GGUF_TYPES:
        raise ValueError(f"quant_method={method!r}: the gguf backend writes one of {sorted(GGUF_TYPES)}")
    target = requantized_path(source, method, keep_head=keep_head)
    if target.is_file():
        return target
    progress(f"rewriting {source.name} in {GGUF_TYPES[method]} once with the gguf package (about 6 s for the embedded model); cached in {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".requantizing-", suffix=".gguf", dir=target.parent)
    os.close(fd)
    try:
        _write(source, Path(tmp), GGUF_TYPES[method], keep_head=keep_head)
        os.chmod(tmp, 0o644)  # mkstemp creates it private; the cache is read like any model file
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _head_name(names: set[str]) -> str:
    return "output.weight" if "output.weight" in names else "token_embd.weight"


def _write(source: Path, out: Path, type_name: str, *, keep_head: bool) -> None:
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out), reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for field in reader.fields.values():
        # The architecture and the GGUF.* header fields are written by GGUFWriter itself
        # (as gguf's own scripts/gguf_new_metadata.py copies a file).
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = getattr(gguf.LlamaFileType, _FILE_TYPES[type_name]).value
        writer.add_key_value(field.name, value, kind, sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    target = getattr(GGMLQuantizationType, type_name)
    block = gguf.GGML_QUANT_SIZES[target][0]
    head = _head_name({t.name for t in reader.tensors})
    for t in reader.tensors:
        kind = t.tensor_type
        convert = (kind.name not in _FULL_PRECISION and kind != target and not (keep_head and t.name == head)
                   and int(t.shape[0]) % block == 0)  # ggml's shape[0] is the row length the blocks tile
        if convert:
            values = quants.dequantize(t.data, kind).astype(np.float32)
            writer.add_tensor(t.name, quants.quantize(values, target), raw_dtype=target)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a .gguf file")
    parser.add_argument("--type", choices=sorted(GGUF_TYPES), default="q4_0", help="the block type to write (default q4_0)")
    parser.add_argument("--requantize-head", action="store_true", help="also re-quantize the output head (kept at its stored type by default)")
    args = parser.parse_args(argv)
    if not args.source.is_file():
        print(f"error: {args.source}: no such file", file=sys.stderr)
        return 2
    print(requantize(args.source, args.type, keep_head=not args.requantize_head, progress=lambda m: print(m, file=sys.stderr)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
