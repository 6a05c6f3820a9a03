"""Where llama.cpp's tools are looked for: per llama.cpp version, per CPU instruction set."""

from __future__ import annotations

from pathlib import Path

from fractal_opt.weights import llama_tools
from fractal_opt.weights.llama_tools import converter_dir, cpu_tag, native_dir, native_tool, tool_problem


def test_native_tools_live_in_one_folder_per_cpu_instruction_set():
    """Two CPUs with different vector extensions get different build folders; the same flags the same one."""
    avx2, avx512 = ["avx", "avx2", "fma"], ["avx", "avx2", "fma", "avx512f"]
    assert cpu_tag(avx2) != cpu_tag(avx512)
    assert cpu_tag(avx2) == cpu_tag([*avx2, "hypervisor"])  # a flag that is not an instruction set changes nothing
    assert native_tool("llama-quantize").parent == native_dir()
    assert native_dir().name == cpu_tag()


def test_the_converter_is_shared_by_every_cpu_of_one_llama_cpp_version(monkeypatch):
    """The converter is Python: its folder sits beside the per-CPU builds, under the same version."""
    monkeypatch.setattr(llama_tools, "llama_version", lambda: "1.2.3")
    assert converter_dir().parent == native_dir().parent
    assert converter_dir().parent.name == "1.2.3"


def test_a_missing_tool_is_named_with_the_command_that_builds_it(tmp_path: Path):
    """tool_problem says which file is missing and how to get it; an executable file has no problem."""
    missing = tool_problem(tmp_path / "llama-quantize")
    assert missing is not None and "llama-quantize" in missing and "make setup-llama-native" in missing
    exe = tmp_path / "rpc-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert tool_problem(exe) is None
