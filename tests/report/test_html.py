"""report.html: written with every run, self-contained, rendered by a real browser with the numbers of trace.json.

The run is on fake engines (fractal_opt.testing.FakeEngine): a kept, a failed, a rolled-back and a
skipped step in a few seconds. The browser test opens the page in headless Chromium (the Debian
``chromium`` package; skipped with the reason when it is not installed), reads the rendered DOM
back and checks every number the page marks (``data-step`` / ``data-metric`` / ``data-value``)
against trace.json, and the text shown next to it against the same number.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import small_recipe_dict

from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.report.html import render_fragment, render_html
from fractal_opt.report.trace import Trace
from fractal_opt.testing import FakeEngine, cpu_machine

LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})
SECTIONS = ("The answer", "The tower", "Objective per layer", "Decode against the bandwidth ceiling", "Latency percentiles",
            "Quality against its guards", "Every step", "Noise calibration", "The machine")
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars")


@pytest.fixture(scope="module")
def run(tiny_dir, tmp_path_factory):
    """A fake-engine run: dtype bfloat16 kept (1.5x faster), float16 failed, the plan's own KV cache skipped, KV cache off
    rolled back, an 8-bit quantization rolled back on KL, a token cap kept."""
    recipe = small_recipe_dict(
        tiny_dir, limit=2, max_new_tokens=8, repeats=2, warmup=0,
        passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}, {"dtype": {"dtype": "float16"}}],
                "model": [{"kv_cache": {"implementation": "dynamic"}}, {"kv_cache": {"implementation": "off"}}, {"quantize": {"bits": 8}}],
                "application": [{"max_new_tokens": {"limit": 4}}]},
    )
    out = tmp_path_factory.mktemp("report-html")
    build = FakeEngine.factory(speed={"hardware.dtype": {"bfloat16": 1.5}, "model.kv_cache": {"off": 0.3}}, drift={"model.weight_bits": {8: 0.5}},
                               fail={"hardware.dtype": {"float16": "simulated out of memory"}})
    result = Pipeline(recipe, out_dir=out, progress=False, machine=cpu_machine(), build=build, refuse=FakeEngine.refuse, limits=LIMITS).run()
    return result, out


class _Marks(HTMLParser):
    """Every element with data-value (its attributes and the text directly inside it), and the root's attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.marks: list[dict[str, str]] = []
        self.root: dict[str, str] = {}
        self.headings: list[str] = []
        self._open: list[dict[str, str] | None] = []
        self._heading = False

    def handle_starttag(self, tag, attrs):
        a = {k: v or "" for k, v in attrs}
        if tag == "html":
            self.root = a
        self._heading = tag in ("h2", "h3")
        mark = {**a, "tag": tag, "text": ""} if "data-value" in a else None
        if mark:
            self.marks.append(mark)
        if tag not in ("line", "rect", "circle", "meta", "br"):  # void or self-closed in the dump
            self._open.append(mark)

    def handle_endtag(self, tag):
        if tag not in ("line", "rect", "circle", "meta", "br") and self._open:
            self._open.pop()
        self._heading = False

    def handle_data(self, data):
        if self._open and self._open[-1] is not None:
            self._open[-1]["text"] += data
        if self._heading:
            self.headings.append(data.strip())


def _lookup(trace: dict, step: str, path: str):
    roots = {"final": trace["final"], "calibration": trace["calibration"], "machine": trace["machine"], "0": trace["baseline"]}
    roots.update({str(i): s for i, s in enumerate(trace["steps"], start=1)})
    value = roots[step]
    for key in path.split("."):
        value = value[int(key)] if isinstance(value, list) else value[key]  # confirmation.at_loads.1.metrics...
    return value


def _expected_text(mark: dict[str, str], value: float) -> float:
    """The number a mark's text shows for ``value``: scaled (bytes as GB), or a change as a ratio (+478% as 5.78x)."""
    if mark.get("data-form") == "ratio":
        return 1 + value
    return value * float(mark.get("data-scale", 1))


def _shown(text: str) -> float | None:
    """The number a mark's text shows ("1,500", "+50.0%", "0.0123"), or None when it shows none."""
    m = re.search(r"[-+]?[\d,]*\.?\d+(e[-+]?\d+)?%?", text.strip())
    if not m or m.group(0) in ("+", "-"):
        return None
    s = m.group(0).replace(",", "")
    return float(s[:-1]) / 100 if s.endswith("%") else float(s)


def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium; .ci/run tries it and goes on without it)")
    return path


def _browser(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_report_html_is_written_next_to_report_md(run):
    """The run folder holds report.html, one file with no reference to anything outside it (no CDN, no script src)."""
    _, out = run
    page = (out / "report.html").read_text(encoding="utf-8")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    outside = [u for u in re.findall(r"(?:src|href)=\"([^\"]+)\"", page) if not u.startswith("#")]  # a link within the page stays inside it + [u for u in re.findall(r"https?://[^\"'\s)]+", page) if "www.w3.org/2000/svg" not in u]
    assert not outside, f"report.html refers to {outside[:3]}"
    for section in SECTIONS:
        assert f"<h2>{section}</h2>" in page, section


def test_every_step_is_in_the_tower_with_its_verdict(run):
    """Each step is one box of the tower, tagged with its status (which picks its colour), in trace.json order."""
    result, out = run
    page = (out / "report.html").read_text(encoding="utf-8")
    statuses = dict(re.findall(r'data-step="(\d+)" data-status="([a-z_]+)"', page))
    expected = {"0": "baseline", **{str(i): s.status for i, s in enumerate(result.trace.steps, start=1)}}
    assert statuses == expected
    assert {"kept", "failed", "rolled_back", "skipped"} <= set(statuses.values())


def test_notebook_view_shows_the_report_content(run):
    """Result._repr_html_ carries the same content as report.html (styles scoped to the output), as the fragment renderer draws it."""
    result, out = run
    fragment = result._repr_html_()
    assert fragment == render_fragment(result.trace)
    assert '<div class="fo-report">' in fragment and "<style>" in fragment
    for section in SECTIONS:
        assert f"<h2>{section}</h2>" in fragment, section
    page = (out / "report.html").read_text(encoding="utf-8")
    assert fragment.count("data-value=") == page.count("data-value=")


def test_an_unfinished_run_says_so(run):
    """A trace of a run that did not finish (killed, failed) renders with a banner saying so."""
    result, _ = run
    data = json.loads(result.trace.to_json())
    data["finished"] = False
    data["steps"] = data["steps"][:2]
    page = render_html(Trace.from_dict(data))
    assert "This run did not finish" in page


def test_browser_renders_the_report_with_the_numbers_of_trace_json(run, tmp_path):
    """Headless Chromium lays out every chart, and every number the page marks equals trace.json's, shown as that number."""
    _, out = run
    dump = _browser(["--dump-dom", (out / "report.html").as_uri()], tmp_path)
    assert dump.returncode == 0, dump.stderr[-2000:]
    parser = _Marks()
    parser.feed(dump.stdout)
    drawn, total = parser.root.get("data-charts-drawn", "0/0").split("/")
    assert int(total) >= 8 and drawn == total, f"charts laid out by the browser: {drawn}/{total}"
    assert [h for h in parser.headings if h in SECTIONS] == list(SECTIONS)
    trace = json.loads((out / "trace.json").read_text())
    checked_text = 0
    steps_seen = set()
    for mark in parser.marks:
        expected = _lookup(trace, mark["data-step"], mark["data-metric"])
        assert float(mark["data-value"]) == pytest.approx(expected, rel=1e-12), mark
        steps_seen.add(mark["data-step"])
        shown = _shown(mark["text"])
        if shown is not None:  # the text a reader sees: the same number, to its printed precision
            assert shown == pytest.approx(_expected_text(mark, expected), rel=0.01, abs=6e-4), mark
            checked_text += 1
    measured = {str(i) for i, s in enumerate(trace["steps"], start=1) if s["metrics"]}
    assert {"0", "final", "calibration", "machine"} | measured <= steps_seen
    assert len(parser.marks) > 100 and checked_text > 40, (len(parser.marks), checked_text)


def test_browser_screenshot_is_a_picture(run, tmp_path):
    """A screenshot of the page is a real PNG of the requested size, large enough to hold charts rather than a blank page."""
    _, out = run
    png = tmp_path / "report.png"
    shot = _browser([f"--screenshot={png}", "--window-size=1100,2400", (out / "report.html").as_uri()], tmp_path)
    assert shot.returncode == 0 and png.is_file(), shot.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", data[16:24]) == (1100, 2400)
    assert len(data) > 60_000, f"{len(data)} bytes: a blank page compresses far below that"


def test_browser_shows_the_frontier_and_the_cost_per_token(run, tmp_path):
    """In the laid-out page: the trade-offs section with every measured plan as a point (the Pareto set and the
    chosen plan marked, each linked to a row), and the cost table's CPU-seconds per 1,000 tokens for each plan."""
    _, out = run
    dump = _browser(["--dump-dom", (out / "report.html").as_uri()], tmp_path)
    assert dump.returncode == 0, dump.stderr[-2000:]
    parser = _Marks()
    parser.feed(dump.stdout)
    assert "Trade-offs and the cost per token" in parser.headings and "The cost per token" in parser.headings
    trace = json.loads((out / "trace.json").read_text())
    measured = {str(i) for i, s in enumerate(trace["steps"], start=1) if s["metrics"]} | {"0"}
    points = [m for m in parser.marks if m.get("class") == "fo-point"]
    assert {p["data-step"] for p in points} == measured
    assert any(p["data-pareto"] == "1" for p in points) and sum(p["data-chosen"] == "1" for p in points) >= 1
    assert all(f'id="fo-step-{p["data-step"]}"' in dump.stdout for p in points), "every point links to a row that exists"
    costs = {m["data-step"] for m in parser.marks if m["data-metric"] == "metrics.cpu_s_per_1k_tokens"}
    assert costs == measured, (costs, measured)


def _chart_texts(page: str) -> list[tuple[str, str]]:
    """``(shown text, tooltip)`` of every SVG <text>: its tspans joined by spaces, and its <title>."""
    texts = []
    for m in re.finditer(r"<text\b[^>]*>(.*?)</text>", page, flags=re.S):
        tip = re.search(r"<title>(.*?)</title>", m.group(1), flags=re.S)
        body = re.sub(r"<title>.*?</title>", "", m.group(1), flags=re.S)
        texts.append((" ".join(t for t in re.split(r"<[^>]+>", body) if t.strip()), tip.group(1) if tip else ""))
    return texts


def test_no_chart_label_is_cut_where_it_fits(run):
    """Step labels such as dtype(dtype=bfloat16) wrap onto a second line; only a sentence too long for two lines ends in "…", whole in its tooltip."""
    _, out = run
    page = (out / "report.html").read_text()
    texts = _chart_texts(page)
    cut = [(t, tip) for t, tip in texts if t.endswith("…") and len(tip) <= 76]  # 76: two lines of the widest label margin
    assert cut == [] and any("dtype(dtype=bfloat16)" in t.replace(" ", "") for t, _ in texts), cut
    assert all(tip for t, tip in texts if t.endswith("…")), "a cut text keeps its whole text in the tooltip"


def test_the_page_shows_one_final_number_per_metric(run):
    """Every number the page ties to the final plan is the confirmation's (the first screen's cards, the waterfalls' final bars)."""
    _, out = run
    trace = json.loads((out / "trace.json").read_text())
    assert trace["final"]["status"] in ("confirmed", "not_confirmed")
    page = (out / "report.html").read_text()
    finals = set(re.findall(r'data-step="final" data-metric="([^"]+)"', page))
    assert "confirmation.metrics.decode_tokens_per_s.final_median" in finals
    assert all(path.startswith("confirmation.") for path in finals), sorted(finals)  # not the last step's own figure beside it


def test_a_noise_band_wider_than_the_value_stops_at_zero():
    """A step whose noise band is ±150% draws its band down to the axis, not below it."""
    from fractal_opt.report.html_charts import _waterfall

    cols = [{"label": "baseline", "kind": "total", "value": 10.0, "step": "0", "path": "metrics.x"},
            {"label": "dtype(dtype=bfloat16)", "kind": "step", "before": 10.0, "value": 12.0, "status": "kept", "step": "1", "path": "metrics.x", "band": 1.5, "change": 0.2}]
    svg = _waterfall(cols, "x")
    band = re.search(r'<rect x="[^"]+" y="([\d.]+)" width="[^"]+" height="([\d.]+)"[^>]*data-metric="bands.x"', svg)
    axis = max(float(y) for y in re.findall(r'<line x1="[^"]+" y1="([\d.]+)"', svg))
    assert band is not None and float(band.group(1)) + float(band.group(2)) <= axis + 0.01


def test_a_poisson_load_is_described_by_its_arrival_rate():
    """The load table says 'Poisson, 1 requests/s' for an open load, not a client count it never had."""
    from fractal_opt.report.html_charts import _offered

    assert _offered({"mode": "poisson", "clients": 8, "rate": 1.0}) == "Poisson, 1 requests/s"
    assert _offered({"mode": "closed", "clients": 8}) == "8 clients"
