"""A transformers model folder as a GGUF file, written by llama.cpp's own converter.

``convert_hf_to_gguf.py`` is the converter llama.cpp maintains for every architecture it runs
(the gguf package on PyPI only reads and edits GGUF files), so it is run as it ships, from the
llama.cpp sources of the installed xllamacpp version (:mod:`.llama_tools`), in a child process:
its imports (its own gguf-py, torch) stay out of this one, and an architecture it does not know
fails there with its own message, which is passed on with the architecture named.

Conversions are cached by content (:func:`content_digest`: every file of the folder, so a folder
copied elsewhere is the same entry and an edited one a new entry) and by output type, written to a
temporary file renamed into place, so an interrupted conversion never leaves a broken entry.

    python -m fractal_opt.weights.convert MODEL_DIR --outtype bf16     # prints the GGUF's path
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ..core.errors import ModelSourceError, closest
from .llama_tools import CONVERT_HINT, converter_dir, converter_script
from .models import cache_dir, local_files, read_config

__all__ = ["OUTTYPES", "architecture", "content_digest", "conversion_problem", "converted_path", "folder_to_gguf", "supported_architectures"]

# The converter's own output types that fractal_opt asks for: exact float32, the two 16-bit
# floats, and Q8_0 (written directly; every other weight type comes from llama-quantize, .ladder).
OUTTYPES = ("f32", "bf16", "f16", "q8_0")
_CONVERT_TIMEOUT_S = 3600.0  # a 70B folder takes tens of minutes; a hung converter must not hold a run forever
_PROGRESS_EVERY_S = 5.0  # how often a long conversion says how far it is
_DIGEST_CHUNK = 1 << 22  # 4 MiB reads while hashing weights


def architecture(folder: Path) -> str:
    """The model class config.json names (``architectures[0]``, e.g. ``LlamaForCausalLM``).

    Raises:
        ModelSourceError: config.json names none.
    """
    config = read_config(folder)
    names = config.get("architectures")
    if not isinstance(names, list) or not names or not isinstance(names[0], str):
        msg = f"model: {str(folder / 'config.json')!r} names no architecture ('architectures': {names!r}); llama.cpp's converter picks its code by that name"
        raise ModelSourceError(msg)
    return names[0]


def supported_architectures() -> frozenset[str] | None:
    """The architectures the installed converter knows (its ``--print-supported-models`` list,
    saved when it was installed), or None when no converter is installed."""
    listing = converter_dir() / "supported-models.txt"
    if not listing.is_file():
        return None
    return frozenset(line.strip()[2:] for line in listing.read_text(encoding="utf-8").splitlines() if line.strip().startswith("- "))


def conversion_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot become a GGUF here (no converter, or an architecture it does not
    know), or None. Reads config.json only."""
    known = supported_architectures()
    if known is None or not converter_script().is_file():
        return f"no llama.cpp converter installed at {converter_dir()}: {CONVERT_HINT}"
    try:
        name = architecture(folder)
    except ModelSourceError as e:
        return str(e).removeprefix("model: ")
    if name not in known:
        return (f"architecture {name!r} (config.json) is not one llama.cpp's converter knows ({len(known)} known).{closest(name, sorted(known))} "
                "Serve it with the transformers runtime, or convert it with a newer llama.cpp and give the .gguf path")
    return None


def content_digest(folder: Path) -> str:
    """A SHA-256 over every file of a model folder (relative name and bytes), or of one file,
    memoized by (path, size, mtime) in the cache, so a model is read in full once and a copy of it
    elsewhere gets the same digest."""
    memo_path = cache_dir() / "digests.json"
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        memo = {}
    total = hashlib.sha256()
    for path in local_files(folder):
        stat = path.stat()
        key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        if key not in memo:
            h = hashlib.sha256()
            with path.open("rb") as f:
                while chunk := f.read(_DIGEST_CHUNK):
                    h.update(chunk)
            memo[key] = h.hexdigest()
        total.update(f"{path.relative_to(folder).as_posix()}\0{memo[key]}\n".encode())
    memo_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(memo), encoding="utf-8")
    os.replace(tmp, memo_path)
    return total.hexdigest()


def converted_path(folder: Path, outtype: str) -> Path:
    """Where the ``outtype`` conversion of ``folder`` is cached (it may not exist yet)."""
    return cache_dir() / "gguf" / f"{folder.name}-{outtype.upper()}-{content_digest(folder)[:16]}.gguf"


def folder_to_gguf(folder: Path, outtype: str = "f32", *, progress: Callable[[str], None] = print) -> Path:
    """``folder`` as a GGUF file of ``outtype`` (one of :data:`OUTTYPES`), converted once.

    Raises:
        ModelSourceError: no converter, an architecture it does not know, or a conversion that
            failed (the converter's last lines, the architecture named).
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype={outtype!r}: the converter writes one of {list(OUTTYPES)}")
    problem = conversion_problem(folder)
    if problem:
        raise ModelSourceError(f"model: {str(folder)!r} cannot be converted to GGUF: {problem}")
    target = converted_path(folder, outtype)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".converting-", suffix=".gguf", dir=target.parent)
    os.close(fd)
    try:
        progress(f"converting {folder.name} ({architecture(folder)}) to a {outtype.upper()} GGUF once with llama.cpp's converter; cached in {target}")
        _run_converter(folder, Path(tmp), outtype, progress)
        os.chmod(tmp, 0o644)  # mkstemp creates it private; the cache is read like any model file
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _run_converter(folder: Path, out: Path, outtype: str, progress: Callable[[str], None]) -> None:
    """Run the converter as a child; pass on how many tensors it has written every few seconds."""
    argv = [sys.executable, str(converter_script()), str(folder), "--outtype", outtype, "--outfile", str(out)]
    # TQDM_DISABLE: the converter's tqdm bar written to a pipe is one line of thousands of characters.
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}
    start = last = time.monotonic()
    tail: list[str] = []
    tensors = 0
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail = [*tail[-19:], line.rstrip()]
            tensors += " --> " in line  # one line per tensor: "blk.0.attn_q.weight, torch.float32 --> F32, shape = {...}"
            now = time.monotonic()
            if now - last >= _PROGRESS_EVERY_S:
                progress(f"  converting {folder.name}: {tensors} tensors in {now - start:.0f} s")
                last = now
            if now - start > _CONVERT_TIMEOUT_S:
                proc.kill()
                break
        code = proc.wait()
    if code != 0:
        detail = "\n    ".join(tail[-8:])
        msg = f"model: llama.cpp's converter failed on {str(folder)!r} (architecture {architecture(folder)!r}, exit status {code}):\n    {detail}"
        raise ModelSourceError(msg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="a transformers model folder (config.json, safetensors, tokenizer)")
    parser.add_argument("--outtype", choices=OUTTYPES, default="f32", help="the GGUF's weight type (default f32: exact)")
    args = parser.parse_args(argv)
    try:
        print(folder_to_gguf(args.folder, args.outtype, progress=lambda m: print(m, file=sys.stderr)))
    except ModelSourceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
