"""The request server: path equivalence, streaming, the bounded queue, cancellation and timeouts."""

from __future__ import annotations

import asyncio
import time

import pytest

from fractal_opt.core.errors import RecipeError, RequestRejected
from fractal_opt.runtimes import Engine
from fractal_opt.serving.server import TERMINAL, Ticket
from fractal_opt.tower.plan import Plan, SchedulingPlan
from fractal_opt.workloads.workload import Request, Workload

MODES = [("sequential", 1), ("static", 4), ("continuous", 1)]


def _engine(model_dir, **scheduling) -> Engine:
    return Engine.build(Plan(source=str(model_dir), scheduling=SchedulingPlan(**scheduling)), progress=lambda m: None)


@pytest.fixture(scope="module")
def requests():
    return Workload(suite="default").requests()


def test_greedy_outputs_are_token_identical_across_paths(lively_dir, requests):
    """Sequential, static and continuous serving give the same greedy tokens for every request."""
    outputs = {}
    for mode, size in MODES:
        engine = _engine(lively_dir, batching=mode, batch_size=size)
        with engine.server() as server:
            tickets = [server.submit(r, max_new_tokens=10) for r in requests[1:5]]  # 2 short and 2 long prompts
            outputs[mode] = [t.result(timeout=120).token_ids for t in tickets]
        assert all(len(ids) == 10 for ids in outputs[mode]), mode
    assert outputs["static"] == outputs["sequential"]
    assert outputs["continuous"] == outputs["sequential"]
    assert len({tuple(ids) for ids in outputs["sequential"]}) > 1  # the model says different things: the test can fail


def test_ignore_eos_generates_end_of_sequence_without_stopping_in_every_mode(lively_dir, requests):
    """With ignore_eos every mode emits an end-of-sequence token like any other and goes on to
    the full budget, so fixed-length benchmarks compare the same tokens across modes (banning it,
    as min_new_tokens does, would swap in the runner-up in some modes only)."""
    free = _engine(lively_dir).serve([requests[1]], max_new_tokens=10)[0].token_ids
    assert len(free) == 10
    model = _engine(lively_dir).model
    before = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = free[3]  # the model's 4th greedy token now ends a sequence
    try:
        for mode, size in MODES:
            engine = _engine(lively_dir, batching=mode, batch_size=size)
            with engine.server(ignore_eos=True) as server:
                got = server.submit(requests[1], max_new_tokens=10).result(timeout=120).token_ids
            assert got == free, mode
            with engine.server() as server:  # without ignore_eos it does stop there
                assert server.submit(requests[1], max_new_tokens=10).result(timeout=120).token_ids == free[:4], mode
    finally:
        model.generation_config.eos_token_id = before


@pytest.mark.parametrize("mode,size", MODES)
def test_a_server_answers_a_repeated_request_from_the_plans_response_cache(tiny_dir, requests, mode, size):
    """With a response cache in the plan, a request seen before ends at submit with the same tokens
    (never queued, cache_hit set); another budget or ignore_eos is another answer."""
    plan = Plan(source=str(tiny_dir), scheduling=SchedulingPlan(batching=mode, batch_size=size)).replace_section("application", response_cache="exact")
    engine = Engine.build(plan, progress=lambda m: None)
    with engine.server() as server:
        first = server.submit(requests[0], max_new_tokens=6)
        first.result(timeout=120)
        again = server.submit(requests[0], max_new_tokens=6)
        assert again.status == "done" and again.cache_hit == "exact" and first.cache_hit is None
        assert again.token_ids == first.token_ids and again.result().text == first.result().text
        assert again.result().cache_hit == "exact"  # reaches the Generation, so reports count it
        assert server.submit(requests[0], max_new_tokens=7).result(timeout=120).cache_hit is None
    with engine.server(ignore_eos=True) as server:
        assert server.submit(requests[0], max_new_tokens=6).result(timeout=120).cache_hit is None
    assert engine.cache_stats()["exact_hits"] == 1 and engine.cache_stats()["misses"] == 3


@pytest.mark.parametrize("mode,size", MODES)
def test_a_server_trims_prompts_to_the_plans_budget_and_reports_the_tokens_saved(tiny_dir, requests, mode, size):
    """The prompt budget applies under every scheduler, and the ticket says how many tokens it removed."""
    plan = Plan(source=str(tiny_dir), scheduling=SchedulingPlan(batching=mode, batch_size=size)).replace_section("application", prompt_budget=64, prompt_strategy="head_tail")
    long = max(requests, key=lambda r: sum(len(c) for _, c in r.messages))
    with Engine.build(plan, progress=lambda m: None).server() as server:
        ticket = server.submit(long, max_new_tokens=2)
        gen = ticket.result(timeout=120)
    assert gen.prompt_tokens <= 64 and ticket.prompt_tokens_saved > 0 and gen.prompt_tokens_saved == ticket.prompt_tokens_saved


def test_engine_serve_on_a_continuous_plan_matches_sequential(lively_dir, requests):
    """Engine.serve (the synchronous path measure() uses) works for continuous plans, with a clock per token."""
    seq = _engine(lively_dir).serve(requests[:3], max_new_tokens=6)
    cont = _engine(lively_dir, batching="continuous").serve(requests[:3], max_new_tokens=6)
    assert [g.token_ids for g in cont] == [g.token_ids for g in seq]
    assert all(len(g.token_times) == 6 and g.token_times == sorted(g.token_times) for g in cont)
    assert [g.request_id for g in cont] == [r.id for r in requests[:3]]


@pytest.mark.parametrize("mode,size", MODES)
def test_streaming_yields_tokens_before_the_request_ends(tiny_dir, requests, mode, size):
    """With streaming on, the caller reads the first token while the request is still running."""
    engine = _engine(tiny_dir, batching=mode, batch_size=size)
    with engine.server(ignore_eos=True) as server:
        ticket = server.submit(requests[0], max_new_tokens=24)
        stream = iter(ticket)
        first = next(stream)
        rest = list(stream)
        assert [first, *rest] == ticket.result().token_ids and len(rest) == 23
        assert ticket.delivered_times[0] < ticket.t_end  # seen before the end: that is what streaming buys


def test_streaming_off_delivers_everything_at_the_end(tiny_dir, requests):
    """With streaming off, every token reaches the caller when the request ends: TTFT seen = e2e."""
    engine = _engine(tiny_dir, batching="continuous", streaming=False)
    with engine.server(ignore_eos=True) as server:
        ticket = server.submit(requests[0], max_new_tokens=10)
        got = list(ticket)
    assert len(got) == 10 and set(ticket.delivered_times) == {ticket.t_end}
    assert ticket.token_times[0] < ticket.t_end  # the model did produce it earlier


def test_async_iteration_streams_tokens(tiny_dir, requests):
    """``async for`` over a ticket yields the same tokens as its result."""
    engine = _engine(tiny_dir, batching="continuous")

    async def collect(ticket):
        return [tok async for tok in ticket]

    with engine.server(ignore_eos=True) as server:
        ticket = server.submit(requests[1], max_new_tokens=8)
        got = asyncio.run(collect(ticket))
    assert got == ticket.result().token_ids and len(got) == 8


@pytest.mark.parametrize("mode,size", MODES)
def test_a_full_queue_rejects_with_a_clear_error(tiny_dir, requests, mode, size):
    """Beyond max_queue waiting requests, submit raises RequestRejected naming the limit; nothing grows."""
    engine = _engine(tiny_dir, batching=mode, batch_size=size, max_queue=2, max_concurrency=1)
    with engine.server(ignore_eos=True) as server:
        tickets, rejected = [], []
        for _ in range(12):
            try:
                tickets.append(server.submit(requests[0], max_new_tokens=32))
            except RequestRejected as e:
                rejected.append(e)
        assert rejected, "12 instant submissions into a queue of 2 must reject some"
        assert "queue is full (2 requests waiting" in str(rejected[0]) and rejected[0].ticket.status == "rejected"
        for t in tickets:
            t.result(timeout=120)
        assert all(t.status == "done" for t in tickets)
        assert server.live() == 0


@pytest.mark.parametrize("mode,size", MODES)
def test_cancel_stops_a_running_request_and_frees_its_slot(tiny_dir, requests, mode, size):
    """A cancelled request ends as cancelled with a partial answer, and the next request still runs."""
    engine = _engine(tiny_dir, batching=mode, batch_size=size)
    with engine.server(ignore_eos=True) as server:
        long = server.submit(requests[0], max_new_tokens=2000)
        next(iter(long))  # running: it produced a token
        assert long.cancel() is True and long.cancel() is False  # ends exactly once
        partial = long.result(timeout=30)
        assert long.status == "cancelled" and 0 < len(partial.token_ids) < 2000
        after = server.submit(requests[1], max_new_tokens=4)
        assert len(after.result(timeout=60).token_ids) == 4 and after.status == "done"
        assert server.live() == 0


@pytest.mark.parametrize("mode,size", MODES)
def test_timeout_ends_a_request_after_its_deadline(tiny_dir, requests, mode, size):
    """A request past timeout_s ends as timeout (queued or running), and the server keeps serving."""
    engine = _engine(tiny_dir, batching=mode, batch_size=size, max_concurrency=1)
    long = engine.context_limit().tokens - 100  # as long as the context lets a request run (the continuous batch's cache is smaller)
    with engine.server(ignore_eos=True) as server:
        slow = server.submit(requests[0], max_new_tokens=long, timeout_s=0.3)
        queued = server.submit(requests[1], max_new_tokens=long, timeout_s=0.3)
        t0 = time.perf_counter()
        slow.result(timeout=30)
        queued.result(timeout=30)
        assert slow.status == "timeout" and queued.status == "timeout"
        assert time.perf_counter() - t0 < 10  # stopped near its deadline, not after all its tokens
        ok = server.submit(requests[2], max_new_tokens=3)
        assert ok.result(timeout=60).token_ids and ok.status == "done"


def test_close_ends_every_ticket_and_rejects_new_ones(tiny_dir, requests):
    """close() cancels queued and running requests; a later submit is rejected."""
    engine = _engine(tiny_dir, batching="continuous", max_concurrency=1)
    server = engine.server(ignore_eos=True)
    tickets = [server.submit(r, max_new_tokens=engine.context_limit().tokens - 100) for r in requests[:3]]  # long: running when closed
    next(iter(tickets[0]))
    server.close()
    assert all(t.status in TERMINAL for t in tickets) and {t.status for t in tickets} == {"cancelled"}
    with pytest.raises(RequestRejected, match="closed"):
        server.submit(requests[0])
    assert engine.generate("hi", max_new_tokens=2) is not None  # the model is free again


def test_submit_accepts_chat_messages_like_generate(tiny_dir, requests):
    """A list of {role, content} messages is a request, answered like the same Request; malformed ones name submit()."""
    engine = _engine(tiny_dir)
    with engine.server() as server:
        from_messages = server.submit(requests[1].as_messages(), max_new_tokens=6).result(timeout=120)
        from_request = server.submit(requests[1], max_new_tokens=6).result(timeout=120)
        assert from_messages.token_ids == from_request.token_ids and from_messages.prompt_tokens == from_request.prompt_tokens
        with pytest.raises(RecipeError, match=r"submit\(\)"):
            server.submit([{"role": "user"}])


@pytest.mark.parametrize("mode,size", MODES)
def test_text_deltas_join_to_the_answer(lively_dir, requests, mode, size):
    """A ticket's text deltas arrive in several pieces, sync or async, and join to the answer's text."""
    engine = _engine(lively_dir, batching=mode, batch_size=size)

    async def collect(ticket):
        return [piece async for piece in ticket.atext_deltas()]

    with engine.server() as server:
        ticket = server.submit(requests[1], max_new_tokens=16)
        pieces = list(ticket.text_deltas())
        again = server.submit(requests[2], max_new_tokens=16)
        async_pieces = asyncio.run(collect(again))
    assert len(pieces) > 1 and "".join(pieces) == ticket.result().text
    assert "".join(async_pieces) == again.result().text


def test_text_deltas_hold_back_a_possible_stop_sequence_and_partial_characters():
    """Text that may still become a stop sequence, or ends inside a multi-byte character, is not sent early."""
    import queue
    import threading

    texts = {1: "Hi", 2: " \ufffd", 3: "é", 4: " EN", 5: "D", 6: "!"}
    ticket = Ticket(Request(id="r", messages=(("user", "x"),)), max_new_tokens=10, timeout_s=None, streaming=True)
    ticket.stops = ("ENDX",)
    ticket._decode = lambda ids: "".join(texts[i] for i in ids).replace("\ufffdé", "é")  # tokens 2 + 3 are one character
    got: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [got.put(piece) for piece in ticket.text_deltas()], daemon=True)
    reader.start()
    for tok, expected in ((1, "Hi"), (2, " "), (3, "é"), (4, " "), (5, None), (6, "END!")):
        ticket._add([tok], [time.perf_counter()])
        if expected is None:  # held back: nothing arrives
            time.sleep(0.2)
            assert got.empty(), f"sent {got.get()!r} after token {tok}"
        else:
            assert got.get(timeout=10) == expected
    ticket._finish("done")
    reader.join(timeout=10)
    assert got.empty() and not reader.is_alive()


def test_the_server_knows_no_runtime():
    """The request server and its tickets import nothing from fractal_opt.runtimes (they ask only the Engine protocol)."""
    import ast
    from pathlib import Path

    import fractal_opt.serving.server as server_module

    for path in Path(server_module.__file__).parent.glob("*.py"):
        if path.name in ("server.py", "ticket.py"):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
            modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
            assert not [m for m in modules if "runtimes" in m], path.name


def test_cancelled_requests_give_their_queue_places_back():
    """A queue of 2 whose tickets were cancelled while waiting admits new requests; it refuses only when 2 really wait."""
    import threading

    from fractal_opt.core.errors import RequestRejected
    from fractal_opt.serving.server import Server
    from fractal_opt.testing import FakeEngine
    from fractal_opt.tower.plan import Plan

    release = threading.Event()

    class Stuck(Server):  # a worker busy with something else: nothing leaves the queue
        def _run(self) -> None:
            release.wait(10)

    server = Stuck(FakeEngine.factory()(Plan(source="fake").replace_section("scheduling", max_queue=2)))
    try:
        for t in [server.submit("a"), server.submit("b")]:
            t.cancel()
        waiting = [server.submit("c"), server.submit("d")]
        assert [t.status for t in waiting] == ["queued", "queued"]
        with pytest.raises(RequestRejected, match="queue is full"):
            server.submit("e")
    finally:
        release.set()
        server.close()
