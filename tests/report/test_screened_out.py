"""A screened-out candidate reads well: its tower row gives the screen's change and interval, the first screen counts what the searches considered."""

from __future__ import annotations

from demo_trace import demo_trace

from fractal_opt.language.policy import Policy
from fractal_opt.report.first_screen import first_screen, text_lines
from fractal_opt.report.html import render_html
from fractal_opt.report.html_charts import tower
from fractal_opt.report.trace import Step

SCREEN = {"metric": "decode_tokens_per_s", "rounds": 1, "min_effect": 0.05, "passed": False, "change": -0.187, "interval": [-0.31, -0.04],
          "before": 88.4, "after": 71.9, "rule": "full rounds only when the screen's 95% interval reaches above +5%"}


def _with_screened() -> object:
    trace = demo_trace()
    screened = Step(pass_name="llama_batch", layer="hardware", params={"n_ubatch": 128}, status="screened_out",
                    reason="screened out: decode_tokens_per_s -18.7% [95%: -31.0%, -4.0%] in 1 paired round against the kept plan",
                    metrics={"decode_tokens_per_s": 71.9, "screen": SCREEN, "comparison": {"mode": "interleaved", "rounds": 1, "screen": SCREEN}})
    trace.steps.insert(2, screened)
    trace.searches.append({"pass": "search", "layer": "hardware", "considered": 3, "screened_out": 1, "kept": 1, "rolled_back": 1,
                           "answer": "3 candidates considered (1 screened out, 2 judged in full, 1 kept): runtime(backend=llama_cpp, dtype=bfloat16)",
                           "summary": "", "not_tried": []})
    return trace


def test_the_tower_row_of_a_screened_out_step_gives_its_screen_numbers():
    """The row says "screened out", the objective's change in its one round and the interval that stopped it."""
    trace = _with_screened()
    steps = [("0", trace.baseline), *((str(i), s) for i, s in enumerate(trace.steps, start=1))]
    svg = tower(steps, Policy())
    row = svg[svg.index('data-status="screened_out"'):]
    assert "screened out" in row[:2000] and "-18.7%" in row[:2000] and "[-31%, -4%] in one round: cannot beat the kept plan by 5%" in row[:2000]


def test_the_first_screen_says_what_the_searches_considered():
    """Under "Kept", how many candidates each layer's search considered, screened out and judged in
    full, and the run's total with the steps the recipe lists (continuous batching, the token cap)."""
    screen = first_screen(_with_screened())
    assert screen.kept.endswith(". Searched: hardware 3 candidates (1 screened out, 2 judged in full); 5 candidates in all, 2 of them listed in the recipe")
    assert any("Searched: hardware 3 candidates" in line for line in text_lines(screen))


def test_the_page_renders_a_screened_out_step_with_its_own_colour():
    """report.html draws the step in the legend's screened-out colour, its reason in the steps table."""
    page = render_html(_with_screened())
    assert "screened out" in page and "#b279a2" in page and "-18.7% [95%: -31.0%, -4.0%]" in page
