"""The conversations load: each next prompt is the history with the model's own answer, users run
at once, a failed turn ends its user's conversation, and the per-turn table counts every turn."""

from __future__ import annotations

import pytest

from fractal_opt.core.errors import EngineError, RecipeError
from fractal_opt.measure.conversation_load import by_turn, run_conversations
from fractal_opt.measure.load import LoadRecord
from fractal_opt.runtimes import Engine
from fractal_opt.tower.plan import Plan, SchedulingPlan
from fractal_opt.workloads.conversations import Conversation
from fractal_opt.workloads.workload import LoadProfile

CONV = Conversation(id="c", system="You are terse.", turns=(("first question", "recorded one"), ("second question", "recorded two"), ("third", None)))


def _engine(model_dir) -> Engine:
    return Engine.build(Plan(source=str(model_dir), scheduling=SchedulingPlan(batching="continuous", max_concurrency=4)), progress=lambda m: None)


class _Refusing:
    """A server whose every ticket ends rejected."""

    def submit(self, request, **kwargs):
        from fractal_opt.serving.ticket import Ticket

        t = Ticket(request, max_new_tokens=kwargs.get("max_new_tokens") or 1, timeout_s=None, streaming=True)
        t.status, t.t_end = "rejected", t.t_submit
        return t


def _recording(server):
    """The server with every submitted request kept in order (to read what each turn sent)."""
    sent = []
    submit = server.submit

    def keep(request, **kwargs):
        sent.append(request)
        return submit(request, **kwargs)

    server.submit = keep
    return sent


def test_each_turn_sends_the_history_with_the_models_own_answer(tiny_dir):
    """Turn k's prompt is the system prompt, earlier turns with the answers the model gave, and message k."""
    engine = _engine(tiny_dir)
    profile = LoadProfile(mode="conversations", users=2, ignore_eos=True)
    with engine.server(ignore_eos=True) as server:
        sent = _recording(server)
        result = run_conversations(server, [CONV], profile, max_new_tokens=3)
    assert len(result.records) == 6 and result.counts()["done"] == 6  # 2 users x 3 turns
    by_id = {r.id: r for r in result.records}
    third = next(req for req in sent if req.id == "c/u1/t3").messages
    answers = [by_id["c/u1/t1"].text, by_id["c/u1/t2"].text]
    assert third == (("system", "You are terse."), ("user", "first question"), ("assistant", answers[0]),
                     ("user", "second question"), ("assistant", answers[1]), ("user", "third"))
    prompts = [by_id[f"c/u1/t{k}"].prompt_tokens for k in (1, 2, 3)]
    assert prompts[0] < prompts[1] < prompts[2]  # the conversation grows


def test_reference_history_replays_the_recorded_answers_and_sessions_tag_first_messages(tiny_dir):
    """history: reference puts the suite's answers in the history; a session tags each user's first message."""
    engine = _engine(tiny_dir)
    profile = LoadProfile(mode="conversations", users=1, turns=2, history="reference")
    with engine.server() as server:
        sent = _recording(server)
        run_conversations(server, [CONV], profile, max_new_tokens=2, session=3)
    assert [req.messages[-1][1] for req in sent] == ["[session 3, user 1] first question", "second question"]
    assert sent[1].messages[1:3] == (("user", "[session 3, user 1] first question"), ("assistant", "recorded one"))  # the history is what was sent


def test_a_failed_turn_ends_its_users_conversation():
    """A turn that did not finish is recorded, and the user sends no further turn on a missing answer."""
    result = run_conversations(_Refusing(), [CONV], LoadProfile(mode="conversations", users=3), max_new_tokens=2)
    assert [(r.user, r.turn, r.status) for r in sorted(result.records, key=lambda r: r.user)] == [(0, 1, "rejected"), (1, 1, "rejected"), (2, 1, "rejected")]


def test_by_turn_reports_cache_hits_and_prefill_only_where_the_runtime_counts_them():
    """The per-turn table gives cached and prefilled tokens from the runtime's counters, None without them."""

    def rec(turn, ttft, prompt, cached):
        return LoadRecord(id=f"x{turn}{ttft}", status="done", max_new_tokens=4, prompt_tokens=prompt, t_submit=0.0, t_end=1.0,
                          delivered_times=[ttft / 1000], turn=turn, cached_tokens=cached)

    table = by_turn([rec(1, 300, 300, None), rec(1, 500, 300, None), rec(2, 100, 400, 350), rec(2, 120, 420, 350)])
    assert table[0]["ttft_ms_p50"] == pytest.approx(400) and table[0]["cached_tokens_p50"] is None and table[0]["prefill_tokens_p50"] is None
    assert table[1]["cached_tokens_p50"] == 350 and table[1]["prefill_tokens_p50"] == 60 and table[1]["sent"] == 2


def test_profile_refuses_bad_conversation_keys():
    """users 0, a negative think time and capacity without an SLO are refused naming the key."""
    with pytest.raises(RecipeError, match=r"'users': got 0.*'think_s': got -1"):
        LoadProfile(mode="conversations", users=0, think_s=-1)
    with pytest.raises(RecipeError, match=r"'capacity': true needs at least one SLO"):
        LoadProfile(mode="conversations", capacity=True)


def test_warm_start_primes_every_user_before_the_timed_turns(tiny_dir):
    """warm_start: one untimed first turn per user (other users, one token) goes first; only the timed turns are recorded."""
    engine = _engine(tiny_dir)
    profile = LoadProfile(mode="conversations", users=2, turns=2, warm_start=True)
    with engine.server() as server:
        sent = _recording(server)
        result = run_conversations(server, [CONV], profile, max_new_tokens=2, session=1)
    firsts = [req.messages[-1][1] for req in sent[:2]]
    assert sorted(firsts) == ["[session warm 1, user 1] first question", "[session warm 1, user 2] first question"]
    assert len(sent) == 2 + 4 and len(result.records) == 4  # 2 primers, then 2 users x 2 timed turns
    assert {r.id for r in result.records} == {"c/u1/t1", "c/u1/t2", "c/u2/t1", "c/u2/t2"}
    assert all(r.messages[0] == ("system", "You are terse.") for r in sent)  # the primers share the system prompt


def test_a_failed_primer_is_an_error_not_a_cold_round():
    """A warm_start whose untimed turns do not finish raises, instead of timing a round that started cold."""
    with pytest.raises(EngineError, match="warm_start"):
        run_conversations(_Refusing(), [CONV], LoadProfile(mode="conversations", users=2, warm_start=True), max_new_tokens=2)
