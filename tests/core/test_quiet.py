"""Third-party chatter is silenced where our report is the output, and a user's own setting wins."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from fractal_opt.core.quiet import quiet_third_party


def test_quiet_third_party_leaves_user_settings(monkeypatch):
    """Third-party load bars and advisories are silenced unless the user chose otherwise."""
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setenv("TQDM_DISABLE", "")
    quiet_third_party()
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info" and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert os.environ["TQDM_DISABLE"] == ""  # the user's own value stays


def test_bars_are_off_when_stderr_is_a_file_and_left_alone_on_a_terminal(monkeypatch):
    """Into a file or a pipe tqdm's bars are disabled; on a terminal (where a bar redraws in place) they are not."""
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stream, expected in ((io.StringIO(), "1"), (Terminal(), None)):
        monkeypatch.delenv("TQDM_DISABLE", raising=False)
        monkeypatch.setattr(sys, "stderr", stream)
        quiet_third_party()
        assert os.environ.get("TQDM_DISABLE") == expected


def test_a_bar_written_into_a_pipe_leaves_no_line_of_redraws():
    """A child that quiets third-party output, then runs a tqdm bar over 2,000 items into a pipe, writes no bar at all."""
    code = ("from fractal_opt.core.quiet import quiet_third_party; quiet_third_party()\n"
            "from tqdm.auto import tqdm\n"
            "for _ in tqdm(range(2000), desc='Converting and de-quantizing GGUF tensors...', mininterval=0): pass\n")
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=True)
    assert "it/s" not in done.stderr and len(done.stderr) < 200, done.stderr[:300]


def test_every_benchmark_quiets_third_party_output_before_its_first_line():
    """Each benchmarks/*.py script calls quiet_third_party() first thing when run, before its main()."""
    import ast
    from pathlib import Path

    scripts = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))
    assert scripts
    for script in scripts:
        tree = ast.parse(script.read_text(encoding="utf-8"))
        main = next(n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
        calls = [ast.unparse(n.value.func) for n in main.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)]
        assert calls and calls[0] == "quiet_third_party", (script.name, calls)


@pytest.mark.integration  # imports torch and torchao in a child: ~5 s
def test_torchao_and_torch_say_nothing_on_import_once_quieted():
    """torchao's "Failed to load ..._C_mxfp8...so" and torch's pytree deprecations are not printed after quiet_third_party()."""
    pytest.importorskip("torchao")
    code = "from fractal_opt.core.quiet import quiet_third_party; quiet_third_party()\nimport torchao\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert "Failed to load" not in done.stderr and "_pytree" not in done.stderr, done.stderr[:500]
