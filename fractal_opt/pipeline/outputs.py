"""The run folder's files, written so a kill at any moment leaves each one whole.

Each output is written to a fresh temporary file in the same folder (:func:`tempfile.mkstemp`:
an unpredictable name opened with ``O_EXCL``, so a planted file or symlink cannot redirect the
write), flushed and fsynced, then renamed over the old one (:func:`os.replace`, atomic on one
file system), and the folder is fsynced so the rename itself survives a power cut. The three
outputs are staged first and renamed back to back: a kill can still fall between two renames
(POSIX has no atomic rename of several files), which leaves each file whole and at most one step
apart; the journal (:mod:`.journal`) is the record they are rendered from.

Example:
    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> write_outputs(folder, {"a.txt": "one", "b.txt": "two"})
    >>> sorted(p.name for p in folder.iterdir()), (folder / "b.txt").read_text()
    (['a.txt', 'b.txt'], 'two')
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from ..core.errors import RecipeError

__all__ = ["OUTPUTS", "check_writable", "fsync_dir", "write_outputs"]

# mkstemp creates files only the owner can read; an output gets the mode a plain open() would give.
_UMASK = os.umask(0o022)
os.umask(_UMASK)

# What a run writes besides its journal: a folder holding any of them holds a run.
OUTPUTS = ("trace.json", "report.md", "report.html", "recipe.yaml")


def check_writable(folder: Path, *, flag: str = "--out") -> None:
    """Create ``folder`` if needed and prove a file can be created in it, before any model loads.

    Raises:
        RecipeError: the path is a file, lies under a file, or the folder cannot be written.
    """
    if folder.exists() and not folder.is_dir():
        raise RecipeError(f"{flag} {str(folder)!r} is a file, not a folder: give a folder for trace.json, report.md and recipe.yaml.")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".write-check.", suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise RecipeError(f"{flag} {str(folder)!r} cannot be written: {e.strerror or e}. Give a folder you can write to.") from None


def write_outputs(folder: Path, files: Mapping[str, str]) -> None:
    """Replace each ``folder/name`` with its text: all staged and fsynced first, then renamed."""
    staged: list[tuple[str, Path]] = []
    try:
        for name, text in files.items():
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
            staged.append((name, Path(tmp)))
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                os.fchmod(fd, 0o666 & ~_UMASK)
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        for name, tmp in staged:
            os.replace(tmp, folder / name)
    finally:
        for _, tmp in staged:  # left only when a write or rename failed
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    fsync_dir(folder)


def fsync_dir(folder: Path) -> None:
    """Make a rename or a new file in ``folder`` durable (no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
