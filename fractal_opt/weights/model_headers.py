"""A weights file's header without its tensors: one GGUF reader and one safetensors reader.

Recipe validation (:mod:`fractal_opt.weights.models`), the budget calculator's config
(:mod:`fractal_opt.measure.config_source`), llama.cpp's census and vLLM's census all read headers
through here, so a damaged file is refused with the same message wherever it is first met
(:class:`~fractal_opt.core.errors.ModelSourceError` naming the file and what is wrong), before any
model is loaded.

Hand-written rather than ``gguf.GGUFReader`` on purpose: the reader builds every field and
tensor record as numpy views (2.5 s for the embedded 135M model on the project's 2-core CPU),
where validation needs a few numbers and a verdict on the header in milliseconds. The format is
the one ``gguf.constants`` describes: magic, version, tensor and key counts, key/type/value
records, then one record per tensor (name, dimensions, ggml type, offset). The ggml types' block
sizes come from ``gguf.constants`` itself (imported only when a tensor's bytes are asked for).
A safetensors file is an 8-byte little-endian header length and that many bytes of JSON.

Example:
    >>> from fractal_opt.weights.model_headers import gguf_header
    >>> from fractal_opt.weights.models import resolve
    >>> header = gguf_header(str(resolve("smollm2-135m-instruct").path))  # doctest: +SKIP
    >>> header.metadata["general.architecture"], len(header.tensors)  # doctest: +SKIP
    ('llama', 272)
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..core.errors import ModelSourceError

__all__ = ["GGUFHeader", "GGUFTensor", "gguf_header", "safetensors_header"]

# GGUF value types (gguf.GGUFValueType) -> struct format; 8 is a string, 9 an array.
_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor record: its name, dimensions (GGUF order: the fastest-varying first) and ggml type id."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int = 0  # where its data starts, from the start of the file's data section

    @property
    def type_name(self) -> str:
        """The ggml storage type's name (``Q4_1``, ``F32``, ``BF16``, ...)."""
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(self.type_id).name

    @property
    def n_bytes(self) -> int:
        """Bytes of the tensor's data: elements / block size x bytes per block of its type."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.type_id)]
        return math.prod(self.shape) // block * size


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF header holds: scalar and string metadata, the length of every array (the
    vocabulary's among them), and the tensor records. ``metadata`` also carries
    ``"tokenizer.longest_token_bytes"``, the longest token's spelling, for token-count bounds."""

    metadata: dict[str, Any]
    array_lengths: dict[str, int]
    tensors: tuple[GGUFTensor, ...]
    data_start: int = 0  # the data section's first byte: the header's end, aligned to general.alignment


def gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """The header of the GGUF file at ``path`` (cached per file version: path, size, mtime).

    Raises:
        ModelSourceError: not a GGUF file (magic), an unknown version, a truncated or damaged header.
    """
    where = f"model: {str(path)!r}"
    try:
        stat = os.stat(path)
    except OSError as e:
        raise ModelSourceError(f"{where} cannot be read: {e.strerror or e}.") from None
    return _cached(str(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=8)
def _cached(path: str, size: int, mtime_ns: int) -> GGUFHeader:
    where = f"model: {path!r}"
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _Parser(buf, where).header()
    except ValueError:  # mmap of an empty file
        raise ModelSourceError(f"{where} is empty; a GGUF file starts with the bytes b'GGUF'.") from None
    except OSError as e:
        raise ModelSourceError(f"{where} cannot be read: {e.strerror or e}.") from None


class _Truncated(Exception):
    pass


class _Parser:
    """One pass over a GGUF header in a buffer; every read checks it stays inside the buffer."""

    def __init__(self, buf: Any, where: str):
        self.buf, self.where, self.pos = buf, where, 0

    def take(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        if self.pos + n > len(self.buf):
            raise _Truncated
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def string(self) -> bytes:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise _Truncated
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos])

    def header(self) -> GGUFHeader:
        if self.buf[:4] != _GGUF_MAGIC:
            raise ModelSourceError(f"{self.where} is not a GGUF file: it starts with {bytes(self.buf[:4])!r}, a GGUF file with b'GGUF'.")
        self.pos = 4
        try:
            version = self.take("<I")
            if version not in (2, 3):
                raise ModelSourceError(f"{self.where}: GGUF version {version} is not one this reader knows (2 or 3); convert it with a current llama.cpp.")
            tensors, kvs = self.take("<Q"), self.take("<Q")
            if tensors == 0 or tensors > 1_000_000 or kvs > 100_000:
                raise ModelSourceError(f"{self.where}: its GGUF header counts {tensors} tensors and {kvs} metadata keys; the file is damaged (or holds no weights).")
            metadata: dict[str, Any] = {}
            lengths: dict[str, int] = {}
            for _ in range(kvs):
                self.value(self.string().decode("utf-8", "replace"), metadata, lengths)
            records = tuple(self.tensor() for _ in range(tensors))
        except _Truncated:
            raise ModelSourceError(f"{self.where}: the file ends inside its GGUF header ({len(self.buf)} bytes); it is truncated, re-download it.") from None
        align = metadata.get("general.alignment", 32)  # GGUF's default alignment of the data section
        align = align if isinstance(align, int) and align > 0 else 32
        return GGUFHeader(metadata=metadata, array_lengths=lengths, tensors=records, data_start=-(-self.pos // align) * align)

    def value(self, key: str, metadata: dict[str, Any], lengths: dict[str, int]) -> None:
        kind = self.take("<I")
        if kind in _GGUF_SCALAR:
            metadata[key] = self.take(_GGUF_SCALAR[kind])
        elif kind == 8:
            metadata[key] = self.string().decode("utf-8", "replace")
        elif kind == 9:
            item, count = self.take("<I"), self.take("<Q")
            lengths[key] = count
            if item == 8:
                longest = max((len(self.string()) for _ in range(count)), default=0)
                if key == "tokenizer.ggml.tokens":
                    metadata["tokenizer.longest_token_bytes"] = longest
            elif item in _GGUF_SCALAR:
                self.pos += struct.calcsize(_GGUF_SCALAR[item]) * count
                if self.pos > len(self.buf):
                    raise _Truncated
            else:
                raise ModelSourceError(f"{self.where}: metadata key {key!r} has an array of unknown type {item}; the file is damaged.")
        else:
            raise ModelSourceError(f"{self.where}: metadata key {key!r} has unknown value type {kind}; the file is damaged.")

    def tensor(self) -> GGUFTensor:
        name = self.string().decode("utf-8", "replace")
        dims = self.take("<I")
        if dims > 8:  # ggml tensors have at most 4 dimensions (GGML_MAX_DIMS); more is a damaged record
            raise ModelSourceError(f"{self.where}: tensor {name!r} claims {dims} dimensions; the file is damaged.")
        shape = tuple(self.take("<Q") for _ in range(dims))
        type_id = self.take("<I")
        offset = self.take("<Q")  # from the start of the data section
        return GGUFTensor(name=name, shape=shape, type_id=type_id, offset=offset)


def safetensors_header(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a safetensors file: tensor name -> ``{"dtype", "shape", "data_offsets"}``,
    plus ``"__metadata__"`` where the file has one. No tensor is read.

    Raises:
        ModelSourceError: the header length or its JSON is damaged or truncated (naming the file).
    """
    p = Path(path)
    size = p.stat().st_size
    header: Any = None
    with p.open("rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if len(head) == 8 and 2 <= n <= size - 8:
            try:
                header = json.loads(f.read(n).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError):
                header = None
    if not isinstance(header, dict):
        raise ModelSourceError(f"model: weights file {str(p)!r} is not a valid safetensors file (its {size}-byte header is damaged or truncated); re-download it.")
    return header
