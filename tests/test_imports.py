"""The public surface: importing is cheap, every exported name exists, the command starts."""

from __future__ import annotations

import subprocess
import sys

import fractal_opt


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_import_does_not_load_torch_or_transformers():
    """`import fractal_opt` leaves torch and transformers out of sys.modules (apps import it for free)."""
    code = "import sys, fractal_opt; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"import fractal_opt pulled in heavy modules: {proc.stdout.strip()}"


def test_registry_lookup_does_not_load_torch():
    """Listing the passes (recipe validation) does not import torch either: passes are pure plan arithmetic."""
    code = "import sys, fractal_opt; fractal_opt.registry(); print('torch' in sys.modules)"
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_every_exported_name_resolves():
    """Every name in fractal_opt.__all__ is an attribute of the package (lazy ones included)."""
    missing = [name for name in fractal_opt.__all__ if getattr(fractal_opt, name, None) is None]
    assert not missing, f"names in __all__ that do not resolve: {missing}"
    assert len(set(fractal_opt.__all__)) == len(fractal_opt.__all__), "__all__ lists a name twice"


def test_unknown_attribute_raises_attribute_error():
    """A name that is not exported raises AttributeError naming it (no silent None)."""
    try:
        fractal_opt.no_such_thing  # noqa: B018
    except AttributeError as e:
        assert "no_such_thing" in str(e)
    else:
        raise AssertionError("fractal_opt.no_such_thing did not raise AttributeError")


def test_cli_help():
    """`python -m fractal_opt.cli --help` exits 0 and lists the subcommands."""
    proc = _run("-m", "fractal_opt.cli", "--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("run", "check", "passes", "generate"):
        assert command in proc.stdout
