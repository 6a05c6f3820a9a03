"""The run folder's files: checked writable before any model loads, replaced whole, no temporary files left."""

from __future__ import annotations

import os
import stat

import pytest

from fractal_opt.core.errors import RecipeError
from fractal_opt.pipeline import outputs
from fractal_opt.pipeline.outputs import check_writable, write_outputs


def test_outputs_replace_the_old_files_and_leave_no_temporary_ones(tmp_path):
    """A second write replaces each file's text; only the named files remain, readable as a plain open() would make them."""
    write_outputs(tmp_path, {"trace.json": "{}", "report.md": "old"})
    write_outputs(tmp_path, {"report.md": "new"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "trace.json"]
    assert (tmp_path / "report.md").read_text(encoding="utf-8") == "new"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "report.md").stat().st_mode) == 0o666 & ~umask


def test_a_failed_rename_keeps_the_old_files_whole(tmp_path, monkeypatch):
    """When the rename fails, the old file keeps its full text and the staged copies are removed."""
    write_outputs(tmp_path, {"report.md": "old"})

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs.os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        write_outputs(tmp_path, {"report.md": "new", "trace.json": "{}"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]
    assert (tmp_path / "report.md").read_text(encoding="utf-8") == "old"


def test_an_out_that_is_a_file_is_refused_naming_it(tmp_path):
    """--out naming a file fails before any model loads, with the path and what to give instead."""
    path = tmp_path / "taken"
    path.write_text("x", encoding="utf-8")
    with pytest.raises(RecipeError, match=r"--out '.*taken' is a file, not a folder: give a folder"):
        check_writable(path)


def test_a_folder_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    """A folder where no file can be created fails the write check with the reason, not later with a traceback."""
    def refuse(**kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(outputs.tempfile, "mkstemp", refuse)  # as a read-only folder answers (root would write through chmod)
    with pytest.raises(RecipeError, match=r"--out '.*' cannot be written: Permission denied. Give a folder you can write to."):
        check_writable(tmp_path)


def test_a_missing_folder_is_created(tmp_path):
    """check_writable creates the folder (and its parents) so the run can write there."""
    folder = tmp_path / "a" / "b"
    check_writable(folder)
    assert folder.is_dir() and list(folder.iterdir()) == []
