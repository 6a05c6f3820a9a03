"""The ``conversations`` load: users who replay a conversation turn by turn against a Server.

Every user starts at once (one client thread each). User ``u`` replays conversation
``u mod len(suite)``: turn ``k``'s prompt is the system prompt, every earlier user message with the
answer it got, and message ``k``; the user waits for the whole answer, thinks (exponential gaps
with mean ``think_s``, seeded per user), and sends the next turn. The answer in the history is the
runtime's own text (``history: model``) or the suite's recorded answer (``history: reference``).
A turn that does not finish (timeout, rejection, error) ends its user's conversation: later turns
are never sent, and the records say so by their absence, not by a fabricated result.

Each round's users are new users: with ``session`` set, a user's first message starts with
``[session S, user U]`` so no round finds another round's conversations in a prefix cache; the
shared system prompt is what may stay cached, as it would in production. With the profile's
``warm_start``, the replay is preceded by an untimed first turn per user (session ``warm S``, one
token each) on the same server, so the timed turns start on a cache that holds the system prompt,
as a running deployment's does, whatever the server held before (a measurement may have started
it afresh).

:func:`by_turn` turns the records into the per-turn table: TTFT, prompt tokens, the tokens the
runtime reported served from its cache and the tokens it had to prefill, by turn index (turn 4's
TTFT against turn 1's shows a prefix cache at work).

Example:
    >>> convs = Workload(suite="conversations").conversations()                    # doctest: +SKIP
    >>> result = run_conversations(server, convs, LoadProfile(mode="conversations", users=8, turns=4), max_new_tokens=32)  # doctest: +SKIP
    >>> by_turn(result.records)[3]["ttft_ms_p50"]                                   # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..core.errors import EngineError, RequestRejected
from ..workloads.workload import Request
from .load import LoadItem, LoadRecord, LoadResult
from .metrics import percentile

if TYPE_CHECKING:
    from ..serving.server import Server
    from ..workloads.conversations import Conversation
    from ..workloads.workload import LoadProfile

__all__ = ["by_turn", "run_conversations", "turn_id"]


def turn_id(conversation: str, user: int, turn: int) -> str:
    """A turn's request id, the same for every plan (so rounds pair request by request)."""
    return f"{conversation}/u{user + 1}/t{turn}"


def run_conversations(server: Server, conversations: Sequence[Conversation], profile: LoadProfile, *, max_new_tokens: int,
                      users: int | None = None, session: int | str | None = None) -> LoadResult:
    """Replay ``users`` (default: the profile's) conversations through ``server``; one record per turn sent."""
    if not conversations:
        raise EngineError("a conversations load needs at least one conversation in the workload suite")
    n_users = users or profile.users
    if profile.warm_start:
        _prime(server, conversations, profile, users=n_users, session=session)
    records: list[list[LoadRecord]] = [[] for _ in range(n_users)]
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_user, args=(server, conversations[u % len(conversations)], u, profile, max_new_tokens, session, records[u]),
                                name=f"fractal-opt-user-{u + 1}", daemon=True) for u in range(n_users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [r for user_records in records for r in user_records]
    end = max((r.t_end for r in flat), default=t0)
    return LoadResult(records=flat, wall_s=end - t0, slos=profile.slos())


def _prime(server: Server, conversations: Sequence[Conversation], profile: LoadProfile, *, users: int, session: int | str | None) -> None:
    """Untimed: every user's first turn, one token each, as other users (session ``warm S``), so the
    timed turns find the shared system prompt in the server's prompt cache (``warm_start``)."""
    primer = dataclasses.replace(profile, turns=1, think_s=0.0, warm_start=False)
    result = run_conversations(server, conversations, primer, max_new_tokens=1, users=users, session=f"warm {session}")
    failed = [rec for rec in result.records if rec.status != "done"]
    if failed:
        raise EngineError(f"{len(failed)} of {len(result.records)} untimed first turns that warm the prompt cache (warm_start) did not finish: "
                          f"{failed[0].status} {failed[0].error or ''}".rstrip())


def _user(server: Server, conv: Conversation, user: int, profile: LoadProfile, max_new_tokens: int, session: int | str | None, out: list[LoadRecord]) -> None:
    """One user's conversation, turn after turn, each record appended to ``out``."""
    rng = random.Random(profile.seed * 10_007 + user)  # think times differ per user, repeat per seed
    if session is not None:  # the tagged first message stays in the history: later turns extend what was sent
        first, answer = conv.turns[0]
        conv = dataclasses.replace(conv, turns=((f"[session {session}, user {user + 1}] {first}", answer), *conv.turns[1:]))
    turns = conv.turns[: profile.turns] if profile.turns else conv.turns
    answers: list[str] = []
    for k in range(len(turns)):
        rid = turn_id(conv.id, user, k + 1)
        request = Request(id=rid, messages=conv.messages(k, answers))
        try:
            ticket = server.submit(request, max_new_tokens=max_new_tokens, timeout_s=profile.timeout_s)
        except RequestRejected as e:
            ticket = e.ticket  # type: ignore[attr-defined]
        try:
            ticket.result()
        except EngineError:  # rejected / failed: the record's status says so
            pass
        record = LoadRecord.from_ticket(LoadItem(id=rid, request=request, max_new_tokens=max_new_tokens), ticket)
        record.turn, record.user = k + 1, user
        out.append(record)
        if record.status != "done":
            return  # a user whose turn failed does not go on as if it had an answer
        answers.append(turns[k][1] if profile.history == "reference" and turns[k][1] is not None else record.text)
        if profile.think_s > 0 and k + 1 < len(turns):
            time.sleep(rng.expovariate(1.0 / profile.think_s))


def by_turn(records: Sequence[LoadRecord]) -> list[dict[str, Any]]:
    """Per turn index: requests sent and finished, TTFT p50 / p90, e2e p50, and the medians of the
    prompt tokens, the tokens the runtime reported served from its cache (None where it reports
    none) and the tokens it prefilled (prompt minus cached)."""
    turns = sorted({r.turn for r in records if r.turn is not None})
    table = []
    for t in turns:
        sent = [r for r in records if r.turn == t]
        done = [r for r in sent if r.status == "done"]
        ttft = [r.ttft_ms for r in done if r.ttft_ms is not None]
        cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
        row: dict[str, Any] = {
            "turn": t, "sent": len(sent), "done": len(done),
            "ttft_ms_p50": _r(percentile(ttft, 50)), "ttft_ms_p90": _r(percentile(ttft, 90)),
            "e2e_ms_p50": _r(percentile([r.e2e_ms for r in done], 50)),
            "prompt_tokens_p50": _median([r.prompt_tokens for r in done]),
            "cached_tokens_p50": _median(cached) if cached else None,
            "prefill_tokens_p50": _median([r.prompt_tokens - r.cached_tokens for r in done if r.cached_tokens is not None]) if cached else None,
        }
        table.append(row)
    return table


def _median(values: Sequence[float]) -> float | None:
    return round(float(statistics.median(values)), 1) if values else None


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
