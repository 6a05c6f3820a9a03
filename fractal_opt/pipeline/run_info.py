"""What trace.json records about a run besides its numbers: versions, times and the model's fingerprint.

So a trace read months later says which fractal_opt, torch and transformers measured it, when, and
whether the model files it tuned are still the same ones (``model_fingerprint``).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from datetime import datetime, timezone
from typing import Any

__all__ = ["FINGERPRINT_METHOD", "model_fingerprint", "now", "run_info", "versions"]

# Files at most this large are hashed whole; larger ones by size plus their first and last MiB
# (a safetensors or GGUF header sits at the start and names every tensor, dtype and offset), so a
# 15 GB checkpoint is fingerprinted in milliseconds rather than a minute of reading.
WHOLE_FILE_BYTES = 50 * 2**20
EDGE_BYTES = 2**20
FINGERPRINT_METHOD = "sha256 over every file's relative name and size, the whole content of files up to 50 MiB, and the first and last MiB of larger ones"


def now() -> str:
    """The current time, UTC, ISO 8601 to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def versions(packages: dict[str, Any] | None = None) -> dict[str, str | None]:
    """fractal_opt, torch and transformers versions; ``packages`` (the machine probe's) wins, so
    nothing is imported here (``import fractal_opt`` stays free of torch)."""
    packages = packages or {}
    out: dict[str, str | None] = {}
    for key, dist in (("fractal_opt", "fractal-opt"), ("torch", "torch"), ("transformers", "transformers")):
        value = packages.get(key) if key != "fractal_opt" else None
        if value is None:
            try:
                value = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                value = None
        out[key] = value
    return out


def model_fingerprint(spec: str) -> dict[str, Any]:
    """A hash of the model files a recipe's ``model:`` names, with how it was computed.

    A hub id is not hashed (nothing is downloaded to look), and a model that cannot be resolved
    says why; neither stops a run.
    """
    from ..core.errors import ModelSourceError
    from ..weights.models import local_files, resolve

    try:
        source = resolve(spec)
    except ModelSourceError as e:
        return {"status": f"not hashed: {e}"}
    if source.path is None:
        return {"status": f"not hashed: {source.kind} model {spec!r} (no local files)"}
    root = source.path
    files = local_files(root)
    digest = hashlib.sha256()
    total = 0
    for path in files:
        size = path.stat().st_size
        total += size
        name = path.relative_to(root).as_posix() if root.is_dir() else path.name
        digest.update(f"{name}\0{size}\0".encode())
        with path.open("rb") as f:
            if size <= WHOLE_FILE_BYTES:
                for chunk in iter(lambda: f.read(2**20), b""):
                    digest.update(chunk)
            else:
                digest.update(f.read(EDGE_BYTES))
                f.seek(size - EDGE_BYTES)
                digest.update(f.read(EDGE_BYTES))
    return {"sha256": digest.hexdigest(), "files": len(files), "bytes": total, "kind": source.kind, "method": FINGERPRINT_METHOD}


def run_info(recipe: dict[str, Any], machine: dict[str, Any]) -> dict[str, Any]:
    """What a new trace records at its start: versions, the start time and the model fingerprint."""
    return {
        "versions": versions(machine.get("packages")),
        "started_at": now(),
        "ended_at": None,
        "model": model_fingerprint(str(recipe.get("model", ""))),
    }
