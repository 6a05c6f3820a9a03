"""Where a model's config comes from: a dict, a config.json, a model folder, a GGUF header or the hub.

:func:`load_config` answers ``(label, config dict)`` for every source the budget calculator and
the pre-flight accept, without loading weights: a GGUF file (the embedded model included) gives
its metadata as a transformers-style config, a hub id its cached or fetched ``config.json``.
What cannot be read raises :class:`~fractal_opt.core.errors.ModelSourceError` naming the source and
what was tried.

Example:
    >>> from fractal_opt.measure.config_source import load_config
    >>> load_config({"model_type": "llama", "hidden_size": 64})
    ('llama', {'model_type': 'llama', 'hidden_size': 64})
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..core.errors import ModelSourceError
from ..weights.model_headers import gguf_header

__all__ = ["load_config"]


def load_config(source: str | Path | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(label, config dict) from a dict, a config.json, a model folder, an embedded name, a .gguf
    file or a hub id. Raises ModelSourceError with what was tried when none can be read."""
    if isinstance(source, Mapping):
        return str(source.get("_name_or_path") or source.get("model_type") or "config"), dict(source)
    spec = str(source)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".json":
        return spec, _read_json(path)
    from ..weights import models

    src = models.resolve(spec)  # raises with the embedded names and the closest match
    if src.folder is not None:  # a folder, or a hub id's snapshot in the local cache
        return spec, models.read_config(src.folder)  # names the file and what is wrong with it
    if src.kind in ("embedded", "gguf"):
        assert src.path is not None
        models.check_files(src, complete=False)  # a junk or truncated GGUF header: a clear error, not gguf's ValueError
        return spec, _gguf_config(src.path)
    return spec, _hub_config(spec)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelSourceError(f"config {str(path)!r} could not be read: {e}") from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"config {str(path)!r}: expected a JSON object, got {type(data).__name__}.")
    return data


def _gguf_config(path: Path) -> dict[str, Any]:
    """A transformers-style config from GGUF metadata (the header only: no tensor data is read)."""
    header = gguf_header(path)  # cached per file version
    meta = header.metadata
    arch = meta.get("general.architecture") or "llama"
    vocab = meta.get(f"{arch}.vocab_size") or header.array_lengths.get("tokenizer.ggml.tokens")
    config = {
        "model_type": arch,
        "num_hidden_layers": meta.get(f"{arch}.block_count"),
        "hidden_size": meta.get(f"{arch}.embedding_length"),
        "intermediate_size": meta.get(f"{arch}.feed_forward_length"),
        "num_attention_heads": meta.get(f"{arch}.attention.head_count"),
        "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv"),
        "head_dim": meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count"),
        "vocab_size": vocab,
        # GGUF stores no separate output matrix when the head is tied to the token embedding.
        "tie_word_embeddings": not any(t.name == "output.weight" for t in header.tensors),
    }
    return {k: v for k, v in config.items() if v is not None}  # a key the header lacks takes the architecture's default


def _hub_config(repo_id: str) -> dict[str, Any]:
    """config.json of a hub model: the local HF cache first, then the hub (after a 3 s reachability
    check, so an offline machine fails at once instead of after huggingface_hub's ~25 s of retries)."""
    import os
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import hf_hub_download

    try:
        return _read_json(Path(hf_hub_download(repo_id, "config.json", local_files_only=True)))
    except Exception:
        pass  # not cached: ask the hub
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    hint = "Pass a local model folder or a config.json path instead."
    if not offline:
        try:
            socket.create_connection((host, 443), timeout=3).close()
        except OSError as e:
            offline = True
            hint = f"({host} is unreachable: {e}). " + hint
    if offline:
        raise ModelSourceError(f"model {repo_id!r}: it is a hub id, its config.json is not in the local Hugging Face cache, and this machine is offline {hint}")
    try:
        path = hf_hub_download(repo_id, "config.json")
    except Exception as e:  # unknown or gated repo: the cause is in the message
        raise ModelSourceError(f"model {repo_id!r}: could not fetch its config.json from the hub ({type(e).__name__}: {str(e)[:200]}). {hint}") from None
    return _read_json(Path(path))
