"""Every package module has a test module mirroring it, or a line in tests/README.md saying where it is tested."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "fractal_opt"


def _mirror(module: Path) -> Path | None:
    """tests/<folders>/test_<module>.py for a module; test_<package>.py beside the folder for an __init__."""
    rel = module.relative_to(PACKAGE)
    if module.name == "__main__.py" or (module.name == "__init__.py" and rel.parent == Path(".")):
        return None
    if module.name == "__init__.py":
        return ROOT / "tests" / rel.parent.parent / f"test_{rel.parent.name}.py"
    return ROOT / "tests" / rel.parent / f"test_{module.stem}.py"


def _named_in_readme() -> set[str]:
    """The modules tests/README.md lists: 'fractal_opt/a/b.py, c.py: ...' names a/b.py and a/c.py."""
    named: set[str] = set()
    for line in (ROOT / "tests" / "README.md").read_text(encoding="utf-8").splitlines():
        m = re.match(r"- (fractal_opt/[\w/]*?)([\w]+\.py(?:, [\w]+\.py)*):", line)
        if m:
            named.update(m.group(1) + name for name in m.group(2).split(", "))
    return named


def test_every_module_has_a_mirror_or_a_reason():
    """A module added without a test module and without a line in tests/README.md is named here."""
    named = _named_in_readme()
    missing = [str(p.relative_to(ROOT)) for p in sorted(PACKAGE.rglob("*.py"))
               if str(p.relative_to(ROOT)) not in named and not ((mirror := _mirror(p)) is not None and mirror.exists())]
    assert not missing, f"no test module and no line in tests/README.md for: {missing}"


def test_the_readme_names_only_modules_that_exist():
    """A line left behind for a module that moved or went away is named, so the list stays true."""
    stale = sorted(name for name in _named_in_readme() if not (ROOT / name).exists())
    assert not stale, f"tests/README.md lists modules that do not exist: {stale}"


def test_test_file_names_are_unique():
    """pytest's default import mode needs each test file name once (the folders have no __init__.py)."""
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
