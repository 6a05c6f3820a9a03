"""report.html's first screen, as a browser lays it out at 1100 x 900 px: the answer to the recipe's question.

Headless Chromium (the Debian ``chromium`` package; skipped with the reason when it is not installed)
opens the page of a trace shaped like `make demo`'s (tests/demo_trace.py) at 1100 px wide, and the
page records where each of the answer's cards ends (``data-answer-ends``): the first screen is its
top 900 px.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from demo_trace import demo_trace

from fractal_opt.report.html import render_html

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--hide-scrollbars")


def _dump(page: Path, tmp_path: Path, size: str) -> str:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium; .ci/run tries it and goes on without it)")
    done = subprocess.run([browser, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={size}", "--dump-dom", page.as_uri()],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _ends(dom: str) -> tuple[int, dict[str, int]]:
    """The window's width and, per card of the answer, the px from the top of the page where it ends."""
    width, *ends = re.search(r'data-answer-ends="([^"]*)"', dom).group(1).split()
    return int(width), {key: int(px) for key, px in (e.rsplit(":", 1) for e in ends)}


def _demo_page(tmp_path: Path) -> Path:
    """The demo's report.html, its header as long as a real run's (versions and the model's fingerprint)."""
    trace = demo_trace()
    trace.run.update(versions={"fractal_opt": "0.1.0", "torch": "2.13.0+cpu", "transformers": "5.25.0"},
                     model={"sha256": "ac2f2739092beef4" * 4, "files": 1, "bytes": 98_000_000})
    page = tmp_path / "report.html"
    page.write_text(render_html(trace), encoding="utf-8")
    return page


@pytest.mark.integration  # a browser start: ~3 s
def test_the_first_screen_shows_one_user_the_offered_load_and_the_answers_kept(tmp_path):
    """At 1100 x 900 px the one-request decode (5.78x with its interval), the throughput at 4 clients
    (2.20x with its interval) and the eval's questions lost and gained are all on the first screen."""
    dom = _dump(_demo_page(tmp_path), tmp_path, "1100,900")
    width, ends = _ends(dom)
    assert width == 1100
    first = {key for key, px in ends.items() if px <= 900}
    assert {"decode_tokens_per_s@1", "throughput_tokens_per_s@4", "answers-kept"} <= first, ends
    card = lambda key: re.search(rf'data-answer="{re.escape(key)}">(.*?)</div></div>', dom, flags=re.S).group(1)  # noqa: E731
    text = lambda key: re.sub(r"<[^>]+>", " ", card(key))  # noqa: E731
    assert "5.78x" in text("decode_tokens_per_s@1") and "[95%: 5.20x, 6.41x]" in text("decode_tokens_per_s@1")
    assert "2.20x" in text("throughput_tokens_per_s@4") and "[95%: 2.06x, 2.34x]" in text("throughput_tokens_per_s@4")
    assert "lost 0, gained 0" in text("answers-kept")


@pytest.mark.integration  # a browser start: ~3 s
def test_a_narrow_window_still_lays_out_every_card(tmp_path):
    """At 800 px wide the cards wrap and all of them are still laid out, lower down than at 1100 px."""
    narrow, wide = _ends(_dump(_demo_page(tmp_path), tmp_path, "800,900")), _ends(_dump(_demo_page(tmp_path), tmp_path, "1100,900"))
    assert narrow[0] == 800 and len(narrow[1]) == len(wide[1]) >= 9
    assert narrow[1]["answers-kept"] > wide[1]["answers-kept"]
