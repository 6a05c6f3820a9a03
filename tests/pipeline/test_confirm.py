"""The final confirmation on the fake engine: final vs baseline comes only from measuring them again, interleaved."""

from __future__ import annotations

import json
import random
import time

import pytest
from conftest import small_recipe_dict

from fractal_opt.language.recipe import load_recipe
from demo_trace import demo_trace, final_figures

from fractal_opt.core.text import interval_text
from fractal_opt.measure.machine_limits import MachineLimits
from fractal_opt.measure.rounds import LoadRounds
from fractal_opt.measure.runner import measure_pair
from fractal_opt.pipeline import confirm
from fractal_opt.pipeline.runner import Pipeline
from fractal_opt.report import confirmation as confirm_text
from fractal_opt.pipeline.step_measurement import StepMeasurer
from fractal_opt.serving.server import Server
from fractal_opt.testing import FakeEngine, cpu_machine
from fractal_opt.tower.plan import Plan
from fractal_opt.workloads.workload import Workload

LIMITS = MachineLimits(device="cpu", bandwidth_bytes_per_s=10e9, copy_bandwidth_bytes_per_s=10e9, peak_flops={"float32": 1e11})
# bfloat16 decodes (and prefills) this much faster on the fake engine: the planted speed-up.
PLANTED = 1.10
# A Llama-shaped config (about 10 MB of float32 weights), so the pre-flight can size two models side by side.
LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 512, "vocab_size": 512, "tie_word_embeddings": True, "max_position_embeddings": 4096}


class JitteryEngine(FakeEngine):
    """A fake engine whose every request takes a random 0.95x-1.05x of its nominal time (seeded):
    the planted effect must be found through noise, as on a real machine, not read off exact clocks."""

    rng = random.Random(7)

    def serve(self, requests, **kwargs):
        nominal, prefill = self.per_token_s, self.prefill_s
        out = []
        try:
            for request in requests:
                jitter = self.rng.uniform(0.95, 1.05)
                self.per_token_s, self.prefill_s = nominal * jitter, prefill * jitter
                out += super().serve([request], **kwargs)
        finally:
            self.per_token_s, self.prefill_s = nominal, prefill
        return out



def _run(recipe_dict, out=None, *, builds=None, **fake):
    """One run on jittery fake engines; ``builds`` (a list) collects every plan built."""
    factory = JitteryEngine.factory(per_token_ms=2.0, **fake)

    def build(plan, **kwargs):
        if builds is not None:
            builds.append(plan)
        return factory(plan, **kwargs)

    recipe = load_recipe(recipe_dict, check_model=False)
    return Pipeline(recipe, out_dir=out, progress=False, machine=cpu_machine(), build=build, refuse=FakeEngine.refuse, limits=LIMITS).run()


def _bf16_recipe(fake_model, **workload):
    wl = {"max_new_tokens": 12, "repeats": 4, "limit": 3, **workload}
    return small_recipe_dict(fake_model, passes={"hardware": [{"dtype": {"dtype": "bfloat16"}}]}, **wl)


@pytest.fixture(scope="module")
def planted(fake_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("confirm-out")
    return _run(_bf16_recipe(fake_model), out, speed={"hardware.dtype": {"bfloat16": PLANTED}}), out


@pytest.mark.integration  # jittery rounds until the interval settles: 7-12 s
def test_a_planted_ten_percent_speed_up_is_confirmed_with_an_interval_that_excludes_zero(planted):
    """bfloat16 is 10% faster on the jittery fake: the step keeps it, and measuring the final plan
    against the baseline again finds about +10% decode, its 95% interval above zero."""
    result, _ = planted
    assert [s.status for s in result.trace.steps] == ["kept"], result.trace.steps[0].reason
    final = result.trace.final
    assert final["status"] == "confirmed", final
    decode = final["confirmation"]["metrics"]["decode_tokens_per_s"]
    low, high = decode["interval"]
    assert 0 < low <= decode["change"] <= high, decode
    assert decode["change"] == pytest.approx(PLANTED - 1, abs=0.04)
    assert decode["verdict"] == "better"
    assert final["vs_baseline"]["decode_tokens_per_s"] == decode["change"]
    assert final["confirmation"]["mode"] == "interleaved" and final["confirmation"]["rounds"] >= 4


@pytest.mark.integration  # jittery rounds until the interval settles: 7-12 s
def test_final_vs_baseline_is_printed_from_the_confirmation_only(planted):
    """report.md and the terminal lines quote the confirmation's paired estimate and interval, and
    trace.json holds it (strict JSON: no NaN)."""
    result, out = planted
    decode = result.trace.final["confirmation"]["metrics"]["decode_tokens_per_s"]
    low, high = decode["interval"]
    report = (out / "report.md").read_text()
    assert "Final vs baseline (baseline and final plan measured again after the last step, interleaved" in report
    assert f"| decode_tokens_per_s | {decode['change']:+.1%} [95%: {low:+.1%}, {high:+.1%}] |" in report  # +10%: an interval that bounds it
    assert "Confirmed: decode_tokens_per_s better than the baseline beyond noise." in report
    text = "\n".join(confirm_text.final_lines(result.trace.final, markdown=False))
    assert f"decode_tokens_per_s: paired estimate {decode['change']:+.1%} [95%: {low:+.1%}, {high:+.1%}]" in text
    trace = json.loads((out / "trace.json").read_text(), parse_constant=lambda c: pytest.fail(f"trace.json holds {c}"))
    assert trace["final"]["confirmation"]["metrics"]["decode_tokens_per_s"]["interval"] == [low, high]


def test_identical_plans_give_no_change_and_no_deltas(fake_model, tmp_path):
    """A pass that changes no speed is rolled back; the final plan is the baseline, so nothing is
    measured again and the report says "nothing changed" without a single delta."""
    builds: list[Plan] = []
    result = _run(_bf16_recipe(fake_model, repeats=3), tmp_path, builds=builds)  # no speed table: bfloat16 is as fast
    assert [s.status for s in result.trace.steps] == ["rolled_back"], result.trace.steps[0].reason
    assert result.trace.steps[0].reason.startswith("no change beyond noise"), result.trace.steps[0].reason
    final = result.trace.final
    assert final["status"] == "unchanged" and final["vs_baseline"] == {} and final["confirmation"] == {}
    report = (tmp_path / "report.md").read_text()
    assert "Final plan: the baseline: no pass was kept; nothing changed." in report
    assert "Final vs baseline" not in report
    # Built: the baseline, the candidate, and the baseline again after the rollback; no confirmation build.
    assert [p.hardware.dtype for p in builds] == ["float32", "bfloat16", "float32"]


@pytest.mark.integration  # jittery rounds until the interval settles: 7-12 s
def test_plans_that_do_not_fit_together_are_confirmed_one_after_the_other(tmp_path):
    """On a machine too small for two copies of the model (a Llama config's weights against 16 MB),
    the confirmation measures baseline and final plan back to back, and says so."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA), encoding="utf-8")
    recipe = load_recipe(_bf16_recipe(model), check_model=False)
    build = JitteryEngine.factory(per_token_ms=2.0, speed={"hardware.dtype": {"bfloat16": PLANTED}})
    result = Pipeline(recipe, progress=False, machine=cpu_machine(memory_bytes=16 * 2**20), build=build, refuse=FakeEngine.refuse, limits=LIMITS).run()
    conf = result.trace.final["confirmation"]
    assert conf["mode"] == "back_to_back" and "one after the other" in conf["note"]
    assert result.trace.final["status"] == "confirmed", conf
    assert conf["metrics"]["decode_tokens_per_s"]["interval"][0] > 0


def test_two_measurements_of_the_same_plan_are_within_noise():
    """The confirmation's own rule on two engines of one plan: every headline metric is 'within
    noise', so the same plan is never reported as a change (on a busy machine: +11.8% / -38% on one plan)."""
    build = JitteryEngine.factory(per_token_ms=2.0)
    plan = Plan(source="fake")
    workload = Workload(suite="default", limit=3, max_new_tokens=12, repeats=4, warmup=1)
    before, after = measure_pair(build(plan), build(plan), workload, min_effect=0.05)
    fields = confirm.record(before, after, mode="interleaved", note="same plan twice", objectives=["decode_tokens_per_s"], min_effect=0.05)
    verdicts = {m: e["verdict"] for m, e in fields["confirmation"]["metrics"].items() if m in confirm.HEADLINE}
    assert verdicts and set(verdicts.values()) == {"within noise"}, verdicts
    assert fields["status"] == "not_confirmed"
    assert "decode_tokens_per_s is within noise" in fields["confirmation"]["not_confirmed"]


def test_a_run_in_progress_claims_no_final_vs_baseline():
    """Between steps trace.final is provisional: the best plan so far is named, with no deltas."""
    lines = confirm_text.final_lines({"kept": ["hardware/dtype"], "status": "provisional", "vs_baseline": {}})
    assert lines == ["Best plan so far: hardware/dtype (not yet measured against the baseline: that runs after the last step)."]
    failed = confirm_text.final_lines({"kept": ["hardware/dtype"], **confirm.failed(MemoryError("out of memory"))})
    assert failed[-1] == "Final vs baseline: not measured (the confirmation failed: MemoryError: out of memory); no change is claimed."


def test_a_plan_equal_to_the_baseline_but_for_its_history_is_the_baseline():
    """Kept passes whose settings add up to the baseline's change nothing: no confirmation, no deltas."""
    base = Plan(source="fake")
    again = base.replace_section("hardware", dtype="bfloat16").replace_section("hardware", dtype=base.hardware.dtype).with_applied("dtype")
    assert confirm.same_plan(base, again) and not confirm.same_plan(base, base.replace_section("hardware", dtype="bfloat16"))
    lines = confirm_text.final_lines({"kept": ["hardware/dtype"], **confirm.unchanged()})
    assert lines == ["Final plan: the baseline's settings (kept: hardware/dtype, which together change nothing); nothing changed."]


class SlowedEngine(FakeEngine):
    """A fake engine whose bfloat16 plan decodes ``slowdown[0]`` times slower once set: the final
    plan meeting other conditions in the confirmation than in its own step (another engine resident)."""

    slowdown = [1.0]

    def serve(self, requests, **kwargs):
        nominal = self.per_token_s
        if self.plan.hardware.dtype == "bfloat16":
            self.per_token_s = nominal * self.slowdown[0]
        try:
            return super().serve(requests, **kwargs)
        finally:
            self.per_token_s = nominal


def _slowed_in_the_confirmation(slowdown: float):
    """A build of 1.5x faster bfloat16 fake engines that decode ``slowdown`` times slower once the
    baseline is built again (the confirmation); the test resets ``SlowedEngine.slowdown``."""
    factory = SlowedEngine.factory(per_token_ms=2.0, speed={"hardware.dtype": {"bfloat16": 1.5}})
    base_builds = []

    def build(plan, **kwargs):
        if plan.hardware.dtype != "bfloat16":
            base_builds.append(plan)
            SlowedEngine.slowdown[0] = slowdown if len(base_builds) > 1 else 1.0
        return factory(plan, **kwargs)

    return build


def test_a_final_slower_in_the_confirmation_than_in_its_own_step_is_reported_as_drift(fake_model, tmp_path):
    """The kept bfloat16 plan decodes half as fast in the confirmation as in its step: report.md and
    the terminal lines say "drift: ..." with both numbers; nothing is said when they agree."""
    build = _slowed_in_the_confirmation(2.0)

    recipe = load_recipe(_bf16_recipe(fake_model, repeats=3), check_model=False)
    try:
        result = Pipeline(recipe, out_dir=tmp_path, progress=False, machine=cpu_machine(), build=build, refuse=FakeEngine.refuse, limits=LIMITS).run()
    finally:
        SlowedEngine.slowdown[0] = 1.0
    assert [s.status for s in result.trace.steps] == ["kept"], result.trace.steps[0].reason
    d = result.trace.final["confirmation"]["drift"]
    assert not d["agrees"] and d["change"] == pytest.approx(-0.5, abs=0.1), d
    line = f"drift: the final plan's decode_tokens_per_s is {confirm_text._num(d['confirmed'])} here, {confirm_text._num(d['in_step'])} in its own step (hardware/dtype)"
    assert line in (tmp_path / "report.md").read_text()
    assert any(t.startswith(line) for t in confirm_text.final_lines(result.trace.final, markdown=False))
    agreeing = {**result.trace.final, "confirmation": {**result.trace.final["confirmation"], "drift": {**d, "agrees": True}}}
    assert not any("drift:" in t for t in confirm_text.final_lines(agreeing, markdown=False))


# ---------------------------------------------------------------------------- the offered load

class _Counting(Server):
    """A request server that answers one ticket at a time with the engine's tokens and clock
    readings, and notes on its engine the most requests it ever held at once (the offered load)."""

    def submit(self, request, **kwargs):
        ticket = super().submit(request, **kwargs)
        self._held = [t for t in getattr(self, "_held", []) if not t.finished] + [ticket]
        self._peak = max(getattr(self, "_peak", 0), len(self._held))
        return ticket

    def _run(self) -> None:
        first = True
        while not self._closed.is_set():
            ticket = self._next(0.01)
            if ticket is not None and ticket._start(1):
                if first:  # a fresh server per round: every client's first request is in before any is answered, even on a busy machine
                    time.sleep(0.1)
                    first = False
                (gen,) = self.engine.serve([ticket.request], max_new_tokens=ticket.max_new_tokens)
                ticket._add(list(gen.token_ids), list(gen.token_times))
                self._end(ticket, "done")

    def close(self) -> None:
        self.engine.peaks.append(getattr(self, "_peak", 0))
        super().close()


class LoadEngine(FakeEngine):
    """The fake engine with a request server, so that it can be measured under a load profile."""

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(map(str, token_ids))

    def server(self, *, seed: int = 0, ignore_eos: bool = False) -> Server:
        if not hasattr(self, "peaks"):
            self.peaks: list[int] = []
        return _Counting(self, seed=seed, ignore_eos=ignore_eos)


def _confirm_under_load(final_plan, *, mode="interleaved", alone=(), repeats=2):
    """``confirm()`` of the fake baseline against ``final_plan`` under a closed load of 2 clients;
    the fields and the two engines built (baseline, final)."""
    workload = Workload(suite="default", limit=3, max_new_tokens=6, repeats=repeats, warmup=1, load={"mode": "closed", "concurrency": 2, "requests": 4})
    factory = LoadEngine.factory(per_token_ms=5.0, speed={"scheduling.max_concurrency": {4: 2.0}, "hardware.dtype": {"bfloat16": 2.0}})
    built: dict[str, LoadEngine] = {}

    def build(plan, **kwargs):
        engine = built["final" if confirm.same_plan(plan, final_plan) else "baseline"] = factory(plan)
        return engine

    steps = StepMeasurer(machine=cpu_machine(), workload=workload, requests=workload.requests(), min_effect=0.05, build=build, limits=LIMITS)
    if mode == "back_to_back":
        steps.before_build = lambda *plans: "back_to_back"
    fields = confirm.confirm(steps, baseline_plan=Plan(source="fake"), final_plan=final_plan, build=build, objectives=["decode_tokens_per_s"], alone=alone)
    return fields, built


def test_plans_offered_different_loads_are_compared_at_both_headline_at_the_final_plans():
    """A final plan admitting 4 requests at once is offered 4 clients where the profile (and the
    baseline) has 2: both plans are measured at 4 clients (the headline) and again at 2, each
    comparison labelled; every warm-up and round of either plan held exactly the clients it was offered."""
    fields, built = _confirm_under_load(Plan(source="fake").replace_section("scheduling", max_concurrency=4))
    conf = fields["confirmation"]
    assert conf["clients"] == 4
    assert conf["note"] == "baseline and final plan measured again after the last step, interleaved (A B / B A), at 4 clients (the final plan's offered load)"
    assert [(e["label"], e["whose"], e["headline"]) for e in conf["at_loads"]] == [
        ("at 4 clients", "the final plan's offered load", True), ("at 2 clients", "the baseline's offered load", False)]
    assert conf["at_loads"][0]["metrics"] == conf["metrics"]
    # One warm-up and two rounds at 4 clients, then the same at 2, for each plan.
    assert built["baseline"].peaks == [4, 4, 4, 2, 2, 2] and built["final"].peaks == [4, 4, 4, 2, 2, 2]
    assert fields["status"] == "confirmed" and conf["at_loads"][1]["status"] == "confirmed"
    assert conf["metrics"]["decode_tokens_per_s"]["change"] == pytest.approx(1.0, abs=0.15)  # the planted 2x at either load
    assert conf["at_loads"][1]["metrics"]["decode_tokens_per_s"]["change"] == pytest.approx(1.0, abs=0.15)
    assert fields["vs_baseline"]["decode_tokens_per_s"] == conf["metrics"]["decode_tokens_per_s"]["change"]
    assert set(conf["timings"]) == {"build_s", "measure_s"} and conf["timings"]["measure_s"] > 0


def test_plans_offered_the_same_load_are_compared_once_as_before():
    """A final plan that leaves the offered load alone (bfloat16, 2 clients both): one comparison,
    at that load, the note as before and no second load."""
    fields, built = _confirm_under_load(Plan(source="fake").replace_section("hardware", dtype="bfloat16"))
    conf = fields["confirmation"]
    assert conf["note"] == "baseline and final plan measured again after the last step, interleaved (A B / B A)"
    assert "at_loads" not in conf and conf["clients"] == 2
    assert built["baseline"].peaks == [2, 2, 2] and built["final"].peaks == [2, 2, 2]
    assert fields["status"] == "confirmed"


def test_plans_measured_back_to_back_are_each_built_once_and_measured_at_both_loads():
    """Back to back (the plans do not fit together), each plan is built once and measured at the
    final plan's load, then at the baseline's; the headline is again at the final plan's load."""
    fields, built = _confirm_under_load(Plan(source="fake").replace_section("scheduling", max_concurrency=4), mode="back_to_back")
    conf = fields["confirmation"]
    assert conf["mode"] == "back_to_back" and conf["note"].endswith(", at 4 clients (the final plan's offered load)")
    assert [e["clients"] for e in conf["at_loads"]] == [4, 2]
    assert built["baseline"].peaks == [4, 4, 4, 2, 2, 2] and built["final"].peaks == [4, 4, 4, 2, 2, 2]


def test_a_traded_objective_is_measured_again_one_request_at_a_time():
    """An objective a later step traded (decode, by batching) is compared where its own step
    measured it: after the headline at 2 clients, both plans again at 1 client, labelled, each
    round holding one request; it must improve there for the final to be confirmed."""
    fields, built = _confirm_under_load(Plan(source="fake").replace_section("hardware", dtype="bfloat16"), alone=["decode_tokens_per_s"])
    conf = fields["confirmation"]
    assert [(e["label"], e["whose"], e["headline"]) for e in conf["at_loads"]] == [
        ("at 2 clients", "both plans' offered load", True), ("at 1 client", "one request at a time, where decode_tokens_per_s was kept", False)]
    assert conf["note"].endswith(", at 2 clients (both plans' offered load)")
    assert built["baseline"].peaks == [2, 2, 2, 1, 1, 1] and built["final"].peaks == [2, 2, 2, 1, 1, 1]
    assert fields["status"] == "confirmed" and conf["at_loads"][1]["status"] == "confirmed"
    assert conf["at_loads"][1]["metrics"]["decode_tokens_per_s"]["change"] == pytest.approx(1.0, abs=0.15)


def test_the_one_request_check_stops_after_a_pair_of_rounds_once_its_objective_is_settled():
    """The one-request comparison judges the traded objective alone: with a planted 2x it is
    settled after one A B / B A pair, so it stops there, where the headline runs all 3 rounds."""
    fields, built = _confirm_under_load(Plan(source="fake").replace_section("hardware", dtype="bfloat16"), alone=["decode_tokens_per_s"], repeats=3)
    conf = fields["confirmation"]
    assert built["baseline"].peaks == [2, 2, 2, 2, 1, 1, 1] and built["final"].peaks == [2, 2, 2, 2, 1, 1, 1]  # warm-up + 3, warm-up + 2
    assert [e["rounds"] for e in conf["at_loads"]] == [3, 2]
    assert conf["at_loads"][1]["status"] == "confirmed"


def test_a_traded_objective_that_does_not_hold_alone_leaves_the_final_unconfirmed():
    """The one-request comparison's verdict counts: an objective with no paired number there
    (kl_mean is not timed) makes the final not confirmed, and the reason says where."""
    fields, _ = _confirm_under_load(Plan(source="fake").replace_section("hardware", dtype="bfloat16"), alone=["kl_mean"])
    conf = fields["confirmation"]
    assert conf["at_loads"][0]["status"] == "confirmed" and conf["at_loads"][1]["status"] == "not_confirmed"
    assert fields["status"] == "not_confirmed" and conf["not_confirmed"] == "one request at a time, no paired number for kl_mean"


def test_the_one_request_comparison_is_added_only_where_more_were_in_flight():
    """offered_entries: one request at a time is added for traded objectives under a closed load of
    more than one client; not without a trade, at 1 client already, or where the load is not a client count."""
    both, alone = ["throughput_tokens_per_s"], ["decode_tokens_per_s"]
    assert [c for c, _, _ in confirm.offered_entries([4], both, alone)] == [4, 1]
    assert confirm.offered_entries([4], both, alone)[1][2] == alone
    assert [c for c, _, _ in confirm.offered_entries([16, 8], both, alone)] == [16, 8, 1]
    assert [c for c, _, _ in confirm.offered_entries([4], both, [])] == [4]
    assert [c for c, _, _ in confirm.offered_entries([1], both, alone)] == [1]
    assert [c for c, _, _ in confirm.offered_entries([None], both, alone)] == [None]


def test_report_and_terminal_show_the_other_load_beside_the_headline():
    """report.md and the terminal print the headline at the final plan's load, then the comparison
    at the baseline's load beside it, with its label and verdict."""
    fields, _ = _confirm_under_load(Plan(source="fake").replace_section("scheduling", max_concurrency=4))
    final = {"kept": ["scheduling/concurrency"], **fields}
    other = fields["confirmation"]["at_loads"][1]
    d = other["metrics"]["decode_tokens_per_s"]
    beside = f"Beside it, at 2 clients (the baseline's offered load; the same two plans, {other['rounds']} rounds): confirmed:"
    md = confirm_text.final_lines(final)
    assert md[2].startswith("Final vs baseline (baseline and final plan measured again after the last step, interleaved (A B / B A), at 4 clients")
    assert beside in md and md.index(beside) > md.index(next(t for t in md if t.startswith("| decode_tokens_per_s")))
    row = f"| decode_tokens_per_s | {d['change']:+.1%} {interval_text(d['change'], *d['interval'])} |"
    assert any(t.startswith(row) for t in md[md.index(beside):])
    text = confirm_text.final_lines(final, markdown=False)
    assert beside in text and f"  decode_tokens_per_s: paired estimate {d['change']:+.1%}" in text[text.index(beside) + 1]


def test_the_offered_load_is_the_plans_own_only_under_a_closed_load():
    """offered_loads: the final plan's first, the baseline's when it differs; one None where the
    load does not depend on the plan (no load profile, poisson arrivals); LoadRounds takes an
    explicit offered load, and refuses one that is not a client count."""
    base, wide = Plan(source="fake"), Plan(source="fake").replace_section("scheduling", max_concurrency=16)
    closed = Workload(load={"mode": "closed", "concurrency": 8})
    assert confirm.offered_loads(closed, base, wide) == [16, 8]
    assert confirm.offered_loads(closed, base, base) == [8]
    assert confirm.offered_loads(Workload(), base, wide) == [None]
    assert confirm.offered_loads(Workload(load={"mode": "poisson", "rate": 2.0}), base, wide) == [None]
    engine = LoadEngine.factory()(wide)
    assert LoadRounds(engine, closed, closed.requests()).clients == 16 and LoadRounds(engine, closed, closed.requests(), clients=8).clients == 8
    with pytest.raises(ValueError, match=r"clients \(the offered load\) must be a whole number >= 1, or None for the plan's own; got 0"):
        LoadRounds(engine, closed, closed.requests(), clients=0)


@pytest.mark.integration  # a whole run with a concurrency search and a confirmation at two loads: 5.4 s on 2 cores
def test_a_run_whose_concurrency_pass_raised_the_load_confirms_at_both_loads(fake_model, tmp_path):
    """The pipeline end to end: static batching, then a concurrency limit of 4 under a closed load
    of 2 clients, both kept; the confirmation's headline is at 4 clients, the baseline's 2 beside it
    in report.md, and the drift check compares the final with its own step at 4 clients (they
    agree: nothing else changed)."""
    passes = {"scheduling": [{"batching": {"mode": "static", "batch_size": 2}}, {"concurrency": {"limit": 4}}]}
    # Judged on decode (the fake's exact per-token clock), not throughput: a wall-clock throughput
    # over 2 rounds of 4 requests on a busy 2-core machine had an interval of [-98%, +33264%].
    recipe = load_recipe(small_recipe_dict(fake_model, passes=passes, policy={"objective": "decode_tokens_per_s"}, max_new_tokens=6, repeats=2,
                                           limit=3, load={"mode": "closed", "concurrency": 2, "requests": 4}), check_model=False)
    build = LoadEngine.factory(per_token_ms=5.0, speed={"scheduling.batching": {"static": 1.5}, "scheduling.max_concurrency": {4: 2.0}})
    result = Pipeline(recipe, out_dir=tmp_path, progress=False, machine=cpu_machine(), build=build, refuse=FakeEngine.refuse, limits=LIMITS).run()
    assert [s.status for s in result.trace.steps] == ["kept", "kept"], [s.reason for s in result.trace.steps]
    step = result.trace.steps[-1]
    assert step.status == "kept" and step.metrics["load"]["clients"] == 4, step.reason
    conf = result.trace.final["confirmation"]
    assert conf["clients"] == 4 and [e["label"] for e in conf["at_loads"]] == ["at 4 clients", "at 2 clients"]
    assert conf["drift"]["agrees"] and conf["drift"]["in_step"] == step.metrics[conf["drift"]["metric"]]
    report = (tmp_path / "report.md").read_text()
    assert "at 4 clients (the final plan's offered load)" in report and "Beside it, at 2 clients (the baseline's offered load" in report


def test_a_discarded_load_round_leaves_no_counts_behind():
    """forget_round: the runner re-runs a round another process disturbed; the discarded try's
    request counts are dropped, so extra()["load"]["rounds"] lists the kept rounds only."""
    closed = Workload(load={"mode": "closed", "concurrency": 2, "requests": 2})
    source = LoadRounds(LoadEngine.factory()(Plan(source="fake")), closed, closed.requests())
    source.serve(0)
    source.serve(0)
    source.forget_round()
    assert len(source.extra()["load"]["rounds"]) == 1


# ---------------------------------------------------------------------------- one figure per metric

def test_trace_json_holds_one_figure_per_metric_for_the_final_plan(fake_model, tmp_path):
    """The kept plan decodes 1.3x slower in the confirmation than in its step: every place trace.json
    holds a figure of the final plan (final.metrics, the confirmation's medians, the drift, the
    targets' values) holds one per metric, the confirmation's; the peak memory both plans could not
    show while resident together is the step's own."""
    build = _slowed_in_the_confirmation(1.3)

    recipe = _bf16_recipe(fake_model, repeats=2)
    recipe["targets"] = {"decode_tokens_per_s": 10_000, "e2e_ms": 1}
    try:
        result = Pipeline(recipe, out_dir=tmp_path, progress=False, machine=cpu_machine(), build=build, refuse=FakeEngine.refuse, limits=LIMITS).run()
    finally:
        SlowedEngine.slowdown[0] = 1.0
    data = json.loads((tmp_path / "trace.json").read_text())
    assert data["final"]["status"] == "confirmed", data["final"].get("confirmation")
    several = {key: values for key, values in final_figures(data).items() if len(values) > 1}
    assert not several, several
    conf = data["final"]["confirmation"]["metrics"]
    step = result.trace.steps[-1].metrics
    assert conf["decode_tokens_per_s"]["final_median"] < step["decode_tokens_per_s"] / 1.2  # two measurements that differ ...
    assert data["final"]["metrics"]["decode_tokens_per_s"] == conf["decode_tokens_per_s"]["final_median"]  # ... and one final figure
    assert data["final"]["targets"]["decode_tokens_per_s"]["value"] == conf["decode_tokens_per_s"]["final_median"]
    assert "peak_memory_mb" not in conf and data["final"]["metrics"]["peak_memory_mb"] == step["peak_memory_mb"]


def test_settle_takes_every_final_figure_from_the_confirmation():
    """A final plan whose last step measured decode at 28.5 and whose confirmation measured 32.1 at
    the same load keeps one figure, 32.1, and its quality and census numbers from the step."""
    trace = demo_trace()
    trace.final["metrics"] = dict(trace.steps[-1].metrics)  # the provisional figures, the last step's own
    assert trace.final["metrics"]["decode_tokens_per_s"] == 28.5
    confirm.settle(trace)
    assert trace.final["metrics"]["decode_tokens_per_s"] == 32.1 and trace.final["metrics"]["quality"]["eval_passed"] == 35
    assert trace.final["metrics"]["weight_mb"] == 231.0
    assert not {key: v for key, v in final_figures(json.loads(trace.to_json())).items() if len(v) > 1}
