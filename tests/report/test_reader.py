"""The one reader of a trace: the final plan's figures come from the confirmation, each objective at the load it was judged on."""

from __future__ import annotations

import doctest
import re

from demo_trace import demo_trace

from fractal_opt.report import reader as reader_module
from fractal_opt.report.first_screen import first_screen
from fractal_opt.report.html import render_html
from fractal_opt.report.markdown import report_md
from fractal_opt.report.reader import Reader
from fractal_opt.report.terminal import summary

PLANTED = 27.77  # a final.metrics figure no measurement of the demo has: it must not be shown


def _disagreeing():
    """The demo's trace with final.metrics saying another decode than the confirmation (an old trace, or a hand-edited one)."""
    trace = demo_trace()
    trace.final["metrics"]["decode_tokens_per_s"] = PLANTED
    return trace


def test_figures_come_from_the_confirmation_at_each_load():
    """decode one request at a time (15.3 -> 88.4) and at the burst of 4 (16.2 -> 32.1), each with its path in trace.json."""
    reader = Reader(demo_trace())
    alone, head = reader.alone(), reader.headline()
    assert (alone.clients, head.clients) == (1, 4) and alone.label == "one request at a time" and head.label == "4 clients at once"
    one = reader.figure("decode_tokens_per_s", alone)
    assert (one.baseline, one.final, one.path) == (15.3, 88.4, "confirmation.at_loads.1.metrics.decode_tokens_per_s")
    assert reader.figure("decode_tokens_per_s").final == 32.1


def test_each_objective_is_judged_where_its_layer_measured_it():
    """Decode (hardware, traded by batching and measured again alone) at one request at a time; throughput and e2e at the offered load."""
    objectives = {o.metric: (o.layers, o.load.clients) for o in Reader(demo_trace()).objectives()}
    assert objectives == {"decode_tokens_per_s": (("hardware",), 1), "throughput_tokens_per_s": (("scheduling",), 4), "e2e_ms": (("application",), 4)}


def test_the_final_plans_metrics_are_the_confirmations_where_it_measured_them():
    """final_metrics takes the confirmation's figure over a disagreeing final.metrics, and keeps what it did not measure (quality)."""
    metrics = Reader(_disagreeing()).final_metrics()
    assert metrics["decode_tokens_per_s"] == 32.1 and metrics["quality"]["eval_passed"] == 35


def test_no_report_shows_a_final_figure_other_than_the_confirmations():
    """report.md, the terminal and report.html of a trace whose final.metrics disagree with its confirmation
    never show that figure, and every report.html number tied to the final plan is the confirmation's."""
    trace = _disagreeing()
    for text in (report_md(trace), summary(trace), render_html(trace)):
        assert "27.77" not in text and "27.8" not in text
    page = render_html(trace)
    finals = re.findall(r'data-step="final" data-metric="([^"]+)"', page)
    assert finals and all(path.startswith("confirmation.") for path in finals), sorted(set(finals))


def test_the_eval_that_guarded_the_run_is_read_from_the_trace_else_the_recipe():
    """The set a step's quality names (eval_set) and why the baseline's says it guarded the run (eval_why);
    for a trace without them, the packaged set the recipe's `auto` names."""
    trace = demo_trace()
    assert Reader(trace).eval_guard() == {"name": "basics"}
    trace.steps[-1].metrics["quality"]["eval_set"] = "basics-completion"
    trace.baseline.metrics["quality"]["eval_why"] = "quality.eval auto: the model has no chat template"
    assert Reader(trace).eval_guard() == {"name": "basics-completion", "why": "quality.eval auto: the model has no chat template"}
    assert first_screen(trace).answers.why == "quality.eval auto: the model has no chat template"


def test_docstring_example_holds():
    """The module's example reads a confirmation's throughput and the final plan's metrics as written there."""
    assert doctest.testmod(reader_module).failed == 0
