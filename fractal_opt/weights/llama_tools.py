"""Where llama.cpp's own tools live on this machine: the converter, ``llama-quantize``,
``llama-server`` and ``rpc-server``.

All of them come from the llama.cpp sources inside the sdist of the installed ``xllamacpp``
version (the same llama.cpp the in-process runtime runs), so a GGUF the converter writes is one
that llama.cpp here loads:

- ``scripts/install-llama-convert.sh`` (part of ``make setup``) unpacks the converter
  (``convert_hf_to_gguf.py``, its ``conversion`` package and llama.cpp's own ``gguf-py``) into
  :func:`converter_dir`: pure Python, the same for every CPU.
- ``scripts/build-llama-server.sh`` (``make setup-llama-native``) compiles ``llama-server``,
  ``llama-quantize`` and ``rpc-server`` for this CPU into :func:`native_dir`: one folder per
  instruction set (:func:`cpu_tag`), so a cache shared between hosts never runs a build that
  dies of an illegal instruction.

Only paths are computed here; nothing is run or imported.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
from collections.abc import Iterable
from pathlib import Path

from .models import cache_dir

__all__ = ["BUILD_HINT", "CONVERT_HINT", "converter_dir", "converter_script", "cpu_tag", "llama_version", "native_dir", "native_tool", "tool_problem"]

BUILD_HINT = "make setup-llama-native (scripts/build-llama-server.sh) builds llama.cpp's tools for this CPU in about 6 minutes"
CONVERT_HINT = "make setup (scripts/install-llama-convert.sh) unpacks llama.cpp's converter from the xllamacpp sdist in about a minute"

# The CPU flags (Linux /proc/cpuinfo names) that decide what GGML_NATIVE=ON (-march=native) may
# emit: vector and bit-manipulation extensions. Others (vulnerabilities, "hypervisor", power
# management) differ between hosts of one CPU model and do not change the code.
_ISA_FLAG = re.compile(r"^(sse\w*|ssse3|pni|avx\w*|fma\w*|f16c|bmi\d|amx\w*|\w*vnni\w*|popcnt|movbe|abm|adx|aes|vaes|pclmulqdq|vpclmulqdq|gfni|sha_ni|xsave\w*)$")


def llama_version() -> str:
    """The installed xllamacpp version, whose sdist's llama.cpp the tools are built from ("unknown" without it)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xllamacpp")
    except PackageNotFoundError:
        return "unknown"


def cpu_tag(flags: Iterable[str] | None = None) -> str:
    """A short name for this CPU's instruction set: the machine type and a hash of its ISA flags
    (e.g. ``x86_64-3f9c1a2b``). ``flags``: the CPU's feature flags (:func:`fractal_opt.core.machine.cpu_flags`
    when None); without any (not Linux) the hash is of the processor's name."""
    from ..core.machine import cpu_flags

    isa = sorted(f for f in (cpu_flags() if flags is None else flags) if _ISA_FLAG.match(f))
    basis = " ".join(isa) if isa else platform.processor()
    return f"{platform.machine() or 'cpu'}-{hashlib.sha1(basis.encode()).hexdigest()[:8]}"


def native_dir() -> Path:
    """``cache_dir()/llama-native/<xllamacpp version>/<cpu_tag()>``: the tools built for this CPU."""
    return cache_dir() / "llama-native" / llama_version() / cpu_tag()


def native_tool(name: str) -> Path:
    """The path of a tool ``scripts/build-llama-server.sh`` builds (``llama-server``,
    ``llama-quantize``, ``rpc-server``); it may not exist."""
    return native_dir() / name


def converter_dir() -> Path:
    """``cache_dir()/llama-native/<xllamacpp version>/convert``: llama.cpp's converter (any CPU)."""
    return cache_dir() / "llama-native" / llama_version() / "convert"


def converter_script() -> Path:
    """``convert_hf_to_gguf.py`` inside :func:`converter_dir`; it may not exist."""
    return converter_dir() / "convert_hf_to_gguf.py"


def tool_problem(path: Path, *, hint: str = BUILD_HINT) -> str | None:
    """Why ``path`` cannot be run, or None (it is an executable file)."""
    if path.is_file() and os.access(path, os.X_OK if path.suffix != ".py" else os.R_OK):
        return None
    return f"no {path.name} at {path}: {hint}"
