"""The frontier in report.html: every measured plan on three charts, the Pareto set and the chosen
plan marked, each point linked to its row, and the cost per token with its energy and price line."""

from __future__ import annotations

import re

from fractal_opt.report.frontier import Point, chosen_step, frontier_html, pareto
from fractal_opt.report.html import render_html
from fractal_opt.report.trace import Step, Trace


def _step(name, status, **metrics):
    quality = {"kl_mean": metrics.pop("kl")} if "kl" in metrics else {}
    cost = {"energy": "unavailable: /sys/class/powercap does not exist", "price": "0.5 $/hour (the recipe's machine.price_per_hour)"}
    return Step(pass_name=name, layer="-" if status == "baseline" else "scheduling", params={}, status=status, reason="r",
                metrics={**metrics, "quality": quality, "cost": cost})


def _trace() -> Trace:
    base = _step("baseline", "baseline", throughput_tokens_per_s=10.0, ttft_ms_p90=900.0, decode_tokens_per_s=20.0, peak_memory_mb=500.0, kl=0.0,
                 cpu_s_per_1k_tokens=90.0, usd_per_m_tokens=13.9)
    fast = _step("batching", "kept", throughput_tokens_per_s=30.0, ttft_ms_p90=1500.0, decode_tokens_per_s=18.0, peak_memory_mb=520.0, kl=0.0,
                 cpu_s_per_1k_tokens=40.0, usd_per_m_tokens=4.6)
    worse = _step("queue", "rolled_back", throughput_tokens_per_s=8.0, ttft_ms_p90=1600.0, decode_tokens_per_s=17.0, peak_memory_mb=530.0, kl=0.0,
                  cpu_s_per_1k_tokens=95.0, usd_per_m_tokens=17.4)
    skipped = Step(pass_name="prefix_cache", layer="scheduling", params={}, status="skipped", reason="refused")
    return Trace(recipe={}, baseline=base, steps=[fast, worse, skipped])


def test_pareto_keeps_only_plans_no_other_beats_on_both_axes():
    """A plan worse on both axes than another is off the frontier; a trade-off stays on it."""
    pts = [Point("0", "a", "baseline", 10, 900), Point("1", "b", "kept", 30, 1500), Point("2", "c", "rolled_back", 8, 1600)]
    assert pareto(pts, x_higher=True, y_higher=False) == {"0", "1"}


def test_report_draws_the_frontier_marks_the_chosen_plan_and_links_each_point():
    """report.html has the frontier charts with every measured plan, the Pareto set and the chosen plan marked, and links to rows that exist."""
    page = render_html(_trace())
    points = re.findall(r'<circle[^>]*class="fo-point"[^>]*>', page)
    first_chart = [p for p in points if 'data-metric="metrics.throughput_tokens_per_s"' in p]
    assert len(first_chart) == 3  # baseline, kept and rolled back; the skipped step measured nothing
    on = {re.search(r'data-step="(\d+)"', p).group(1) for p in first_chart if 'data-pareto="1"' in p}
    assert on == {"0", "1"}
    assert [re.search(r'data-step="(\d+)"', p).group(1) for p in first_chart if 'data-chosen="1"' in p] == ["1"]
    for target in set(re.findall(r'href="#(fo-step-\d+)"', page)):
        assert f'id="{target}"' in page
    assert "★ chosen" in page


def test_report_shows_the_cost_per_token_and_why_energy_is_missing():
    """The cost table shows each measured plan's CPU-s per 1k tokens and $/M, and the energy line says why joules are missing."""
    page = render_html(_trace())
    row = re.search(r'<tr id="fo-step-1".*?</tr>', page).group(0)
    assert ">40.0<" in row and ">4.60<" in row
    assert "/sys/class/powercap does not exist" in page and "0.5 $/hour" in page


def test_chosen_plan_is_the_last_kept_step_or_the_baseline():
    """With no kept step the baseline is the chosen plan; a run with one plan draws no frontier."""
    steps = [("0", _trace().baseline)]
    assert chosen_step(steps) == "0"
    assert not any("<svg" in part for part in frontier_html(steps))


def test_browser_shows_the_frontier_and_the_cost_per_token(tmp_path):
    """Headless Chromium renders the frontier's points (each with its step) and the cost table's rows from report.html."""
    import shutil
    import subprocess

    import pytest

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    page = tmp_path / "report.html"
    page.write_text(render_html(_trace()), encoding="utf-8")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([chromium, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120, check=False)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert "<h2>Trade-offs and the cost per token</h2>" in dom.stdout and "<h3>The cost per token</h3>" in dom.stdout
    assert len(re.findall(r'class="fo-point"', dom.stdout)) == 9  # three charts x three measured plans
    assert len(re.findall(r'<tr id="fo-step-\d+"', dom.stdout)) == 3
