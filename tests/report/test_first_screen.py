"""The first screen answers the recipe's question: per objective, in a user's units, with its interval and status."""

from __future__ import annotations

from demo_trace import demo_trace, entry

from fractal_opt.report.first_screen import first_screen, markdown_lines, text_lines
from fractal_opt.report.trace import Step, Trace


def test_groups_are_one_user_then_the_offered_load_then_the_cost_and_the_answers():
    """The demo: one request at a time (decode, the hardware objective), then 4 clients (throughput and e2e objectives,
    TTFT and ITL p90 with the SLO), the cost per 1,000 tokens, and the eval's questions lost and gained."""
    screen = first_screen(demo_trace())
    assert [g.title for g in screen.groups] == ["One user, one request at a time (2 rounds)", "At the offered load, 4 clients at once (3 rounds)"]
    one, load = screen.groups
    assert [(i.figure.metric, i.role) for i in one.lines[0].items] == [("decode_tokens_per_s", "hardware objective")]
    roles = [(i.figure.metric, i.role) for line in load.lines for i in line.items]
    assert roles[:2] == [("throughput_tokens_per_s", "scheduling objective"), ("e2e_ms", "application objective")]
    assert ("itl_ms_p90", "") in roles and next(i for line in load.lines for i in line.items if i.figure.metric == "itl_ms_p90").slo == "within its SLO of 100 ms"
    assert screen.cost is not None and screen.cost.lines[0].items[0].figure.metric == "cpu_s_per_1k_tokens"
    assert (screen.answers.lost, screen.answers.gained, screen.answers.eval_name) == (0, 0, "basics")


def test_a_trade_is_a_line_under_the_figure_it_cost():
    """Throughput traded by the token cap: the note sits under the throughput figure, with the step's change."""
    load = first_screen(demo_trace()).groups[1]
    throughput = next(line for line in load.lines if line.items[0].figure.metric == "throughput_tokens_per_s")
    assert throughput.notes == ("Traded by application/max_new_tokens for answer time (-15.6% in that step), a cost no guard forbids",)


def test_a_run_without_a_load_profile_has_one_group_with_what_one_user_gets_and_the_throughput():
    """The suite served as the plan schedules it: one group, its objective first, then decode, TTFT, answer time and throughput."""
    metrics = {"decode_tokens_per_s": entry(0.5, 0.45, 0.55, 10.0, 15.0), "ttft_ms": entry(-0.2, -0.25, -0.15, 100.0, 80.0),
               "e2e_ms": entry(-0.3, -0.35, -0.25, 900.0, 630.0), "throughput_tokens_per_s": entry(0.4, 0.35, 0.45, 9.0, 12.6)}
    kept = Step(pass_name="dtype", layer="hardware", params={"dtype": "bfloat16"}, status="kept", reason="")
    final = {"status": "confirmed", "kept": ["hardware/dtype"], "confirmation": {"rounds": 3, "metrics": metrics, "objectives": ["decode_tokens_per_s"]}}
    screen = first_screen(Trace(recipe={"workload": {}}, steps=[kept], final=final))
    assert [g.title for g in screen.groups] == ["The suite as the plan serves it (3 rounds)"]
    shown = [i.figure.metric for line in screen.groups[0].lines for i in line.items]
    assert shown == ["decode_tokens_per_s", "ttft_ms", "e2e_ms", "throughput_tokens_per_s"]
    assert screen.kept == "Kept: hardware/dtype(dtype=bfloat16)"


def test_before_a_confirmation_nothing_is_claimed_against_the_baseline():
    """A provisional plan is named as the best so far; no figure, no change."""
    trace = demo_trace()
    trace.final = {"status": "provisional", "kept": ["hardware/runtime"], "metrics": {"decode_tokens_per_s": 93.9}}
    screen = first_screen(trace)
    assert screen.groups == () and screen.cost is None
    assert screen.title.startswith("The answer: Best plan so far: hardware/runtime (not yet measured against the baseline")
    assert "93.9" not in "\n".join(text_lines(screen))


def test_report_md_writes_objectives_in_bold_and_the_answers_kept():
    """report.md's first screen: a section of its own, objectives in bold, the answers kept in bold under them."""
    md = markdown_lines(first_screen(demo_trace()))
    assert md[0] == "## The answer"
    assert "- **decode 15.3 -> 88.4 tokens/s per stream: 5.78x [95%: 5.20x, 6.41x], confirmed (hardware objective)**" in md
    assert any(line.startswith("**Answers kept: eval basics: 35 of 45 right (baseline 35), lost 0, gained 0") for line in md)
