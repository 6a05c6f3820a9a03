"""Pinning a part of a placed plan to its cores (taskset)."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import EngineError
from fractal_opt.runtimes.cores import core_blocks, pinned


def test_blocks_are_disjoint_and_in_order():
    assert core_blocks(2, 2, cpus=[0, 1, 2, 3]) == [[0, 1], [2, 3]]
    assert core_blocks(1, 1, cpus=[5, 3]) == [[3]]


def test_more_cores_than_there_are_is_an_error_naming_them():
    with pytest.raises(ValueError, match="only 2 CPUs"):
        core_blocks(3, 1, cpus=[0, 1])


def test_pinned_runs_the_command_under_taskset_on_those_cores():
    command = pinned(["llama-server", "--port", "1"], [0, 1])
    assert command[0].endswith("taskset") and command[1:3] == ["--cpu-list", "0,1"] and command[3:] == ["llama-server", "--port", "1"]
    assert pinned(["x"], []) == ["x"]


def test_pinning_without_taskset_is_refused(monkeypatch):
    """Asked for cores without util-linux's taskset, the runtime says so rather than running unpinned."""
    monkeypatch.setenv("PATH", "")
    with pytest.raises(EngineError, match="taskset"):
        pinned(["x"], [0])
