"""A model's tokenizer, the one every runtime renders prompts with (:mod:`.prompts`).

A folder (or a hub id's cached snapshot) holds its tokenizer files. A GGUF file holds its
vocabulary in its metadata, which transformers' GGUF loader turns into a tokenizer in about 7 s
(the embedded model, 2-core CPU); it is saved once under the cache, keyed by the file, so every
later load (each llama.cpp engine, each test process) takes a fraction of a second. The saved
tokenizer is the one transformers' GGUF conversion of the whole model also saves
(:func:`.models.materialize`), so the transformers and llama.cpp runtimes of one GGUF tokenize alike.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..core.errors import EngineError
from .models import ModelSource, cache_dir, hub_problem

__all__ = ["load_tokenizer", "tokenizer_dir"]

_LOADED: dict[Path, Any] = {}


def tokenizer_dir(source: ModelSource) -> Path:
    """A folder ``AutoTokenizer.from_pretrained`` reads ``source``'s tokenizer from (for a GGUF,
    made once under the cache).

    Raises:
        EngineError: a hub id that is not in the local cache, or no transformers to read a GGUF with.
    """
    if (problem := hub_problem(source)) is not None:
        raise EngineError(problem)
    if source.folder is not None:
        return source.folder
    assert source.path is not None
    stat = source.path.stat()
    digest = hashlib.sha256(f"{source.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_dir() / "tokenizers" / f"{source.path.stem}-{digest}"
    if not (target / "tokenizer_config.json").is_file():
        _save_gguf_tokenizer(source.path, target)
    return target


def _save_gguf_tokenizer(gguf: Path, target: Path) -> None:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise EngineError("a GGUF's tokenizer is read with transformers (pip install transformers)") from None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=target.parent))
    try:
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(source: ModelSource) -> Any:
    """``source``'s transformers tokenizer (loaded once per process)."""
    folder = tokenizer_dir(source)
    if folder not in _LOADED:
        from transformers import AutoTokenizer

        _LOADED[folder] = AutoTokenizer.from_pretrained(str(folder))
    return _LOADED[folder]
