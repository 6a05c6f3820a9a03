"""Sequential and static (left-padded) batch serving: one ``generate`` call per batch.

The runtime's one padded-generate path: the server's worker runs it on queued tickets, and
``TransformersEngine.serve`` runs it in the caller's thread (:meth:`BatchServer.answer`), so a
measured suite and a served request get the same tokens, the same end-of-sequence cut and the
same clock readings.

A batch is up to ``in_flight_limit(plan)`` queued requests (1 when sequential); the worker waits
at most ``max_wait_ms`` for a static batch to fill. Requests with their own sampling
(``Server.submit(temperature=, top_p=, seed=)``) are decoded with it; a batch whose tickets
differ in sampling runs as one generate call per sampling setting. The seed is set before each
call, so a seeded request served alone (sequential) gives the same text every time.

Each row is answered as soon as it ends (its end-of-sequence token, its own token budget, a
cancel or a timeout); the batch stops as soon as every row has ended, so a cancelled or timed-out
lone request frees its KV cache at the next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ...core.errors import RequestRejected
from ...measure.clock import TokenClock
from ...serving.server import Server, Ticket
from .generate_kwargs import uses_streamer

if TYPE_CHECKING:
    from ...engine.protocol import Generation
    from ...workloads.workload import Request

__all__ = ["BatchServer"]

_IDLE_WAIT_S = 3600.0  # an idle worker sleeps in slices of _POLL_S until a request or close arrives


class BatchServer(Server):
    """Sequential (batch of one) or static padded batches, per the plan.

    Args:
        sync: waits for the device before each clock reading (default: the engine's ``clock_sync``).
    """

    def __init__(self, engine: Any, *, seed: int = 0, ignore_eos: bool = False, sync: Callable[[], None] | None = None):
        super().__init__(engine, seed=seed, ignore_eos=ignore_eos)
        self.sync = sync

    def answer(self, requests: Sequence[Request], *, max_new_tokens: int | None = None) -> list[Generation]:
        """Answer ``requests`` in the caller's thread, in order, one batch of ``in_flight`` at a time.

        Each batch is timed from its own start, as a client that sends the next batch once the
        previous one is answered sees it (the synchronous suite measurement plans are compared
        by). The plan's response cache answers what it can; no deadline applies.

        Raises:
            RequestRejected: a request exceeds the plan's context cap.
            EngineError: generation failed; the cause is chained.
        """
        out: list[Generation] = []
        for i in range(0, len(requests), self.in_flight):
            tickets = [self._ticket(r, max_new_tokens=max_new_tokens, timeout_s=None) for r in requests[i : i + self.in_flight]]
            misses = [t for t in tickets if not self._answer_from_cache(t)]  # looked up after every clock started
            if misses:
                self._run_batch(misses)
            out.extend(t.result() for t in tickets)
        return out

    def _run(self) -> None:
        static = self.plan.scheduling.batching == "static"
        wait_s = self.plan.scheduling.max_wait_ms / 1000 if static else 0.0
        while not self._closed.is_set():
            first = self._next(_IDLE_WAIT_S)
            if first is None:
                continue
            batch = [first]
            fill_until = time.perf_counter() + wait_s
            while len(batch) < self.in_flight:
                more = self._next(max(0.0, fill_until - time.perf_counter()))
                if more is None:
                    break
                batch.append(more)
            # One generate call decodes every row alike: tickets with different sampling (their
            # own temperature / top_p / seed) run as separate batches, in arrival order.
            groups: dict[Any, list[Ticket]] = {}
            for ticket in batch:
                groups.setdefault(self.decoding(ticket), []).append(ticket)
            for group in groups.values():
                self._run_batch(group)

    def _run_batch(self, batch: list[Ticket]) -> None:
        """One left-padded generate over ``batch`` (tickets of one decoding); every ticket ends (done, or error with the cause)."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        engine = self.engine
        try:
            encoded = engine.encode_prompts([t.request for t in batch])
            fitting = [t for t, n in zip(batch, encoded.prompt_tokens) if self._fits(t, n)]
            if len(fitting) < len(batch):  # a refused request leaves the batch: the others are encoded again
                batch = fitting
                if not batch:
                    return
                encoded = engine.encode_prompts([t.request for t in batch])
            budget = max(t.max_new_tokens for t in batch)
            decoding = self.decoding(batch[0])
            kwargs = engine.generation_kwargs(budget, decoding)
            if self.ignore_eos:
                # End-of-sequence is generated like any other token but ends nothing, as in
                # continuous batching (eos -1 there), so every mode gives the same tokens.
                # (min_new_tokens would instead ban it and pick the runner-up: other tokens.)
                kwargs["eos_token_id"] = None
            eos = frozenset() if self.ignore_eos else engine.eos_ids()
            # A row that ended on a stop string is padded to the batch's longest row; pads at its
            # end are not generated work (a row alone is never padded).
            pad = engine.tokenizer.pad_token_id if self.plan.application.stop and len(batch) > 1 else None
            rows = [_Row(self, t, n, eos, pad) for t, n in zip(batch, encoded.prompt_tokens)]
            for t, saved in zip(batch, encoded.saved):
                t.prompt_tokens_saved = saved
            sync = self.sync or engine.clock_sync
            streamer = _RowStreamer(rows, sync, self._expire) if uses_streamer(self.plan) else None

            class _AllEnded(StoppingCriteria):
                # Rows whose ticket has ended stop; generate returns when every row has. Beam
                # search scores [batch * beams] rows, batch-major: each ticket's flag repeats.
                def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
                    ended = torch.tensor([t.finished for t in batch], device=input_ids.device)
                    return ended.repeat_interleave(input_ids.shape[0] // len(batch))

            if streamer is None:  # transformers refuses a streamer with beam search: tokens arrive at the end
                for row in rows:
                    row.ticket.streamed = False
                    row.ticket._start(row.prompt_tokens)
            with engine.exclusive():
                torch.manual_seed(self.seed if decoding.seed is None else decoding.seed)  # a request's own seed, or the server's
                output = engine.model.generate(**encoded.inputs, streamer=streamer, stopping_criteria=StoppingCriteriaList([_AllEnded()]), **kwargs)
            if streamer is None:
                if sync is not None:
                    sync()
                now = time.perf_counter()
                prompt_len = encoded.inputs["input_ids"].shape[1]
                for i, row in enumerate(rows):
                    for tok in output[i, prompt_len:].tolist():
                        row.take(tok, now)
        except Exception as e:  # noqa: BLE001 (one failed batch fails its requests; the server goes on)
            for t in batch:
                self._end(t, "error", e)
            return
        for row in rows:
            row.finish()

    def _fits(self, ticket: Ticket, prompt_tokens: int) -> bool:
        """Reject (only) this ticket when its prompt plus budget exceeds the context (the plan's cap, or the model's)."""
        try:
            self.engine.check_context(prompt_tokens, ticket.max_new_tokens)
        except RequestRejected as e:
            self._end(ticket, "rejected", e)
            return False
        return True


class _Row:
    """One ticket's row of a padded generate: where its answer ends.

    A row ends at its first end-of-sequence token (counted: generating it was work), at its own
    budget, or when the ticket ends otherwise (cancel, timeout). ``pad`` (only for a batch with
    stop strings) is held back until a real token follows it: trailing pads are the padding of a
    row that stopped on a stop string.
    """

    def __init__(self, server: BatchServer, ticket: Ticket, prompt_tokens: int, eos: frozenset[int], pad: int | None):
        self.server = server
        self.ticket = ticket
        self.prompt_tokens = prompt_tokens
        self.eos = eos
        self.pad = pad
        self.held: list[float] = []  # clock readings of held-back pad tokens

    def take(self, tok: int, now: float) -> None:
        t = self.ticket
        if t.finished:
            return
        if self.pad is not None and tok == self.pad:
            if tok in self.eos:  # the pad is end-of-sequence: padding from here on
                self.server._end(t, "done")
            else:
                self.held.append(now)
            return
        if self.held:
            t._add([self.pad] * len(self.held), self.held)
            self.held = []
        t._add([tok], [now])
        if tok in self.eos:
            t.ended_on_eos = True
            self.server._end(t, "done")
        elif len(t.token_ids) >= t.max_new_tokens:
            self.server._end(t, "done")

    def finish(self) -> None:
        """generate returned: a row still open ended with the batch (its budget, a stop string)."""
        self.server._end(self.ticket, "done")


class _RowStreamer:
    """A generate() streamer that hands each row's new tokens to its row, with a clock reading.

    transformers calls ``put`` with the prompt ids first, then once per step with one new token
    per row (shape ``[batch]``) or, under speculative decoding, every token of the one row that
    the step accepted (``[1, k]``); ``end`` when done. The clock is measurement's
    :class:`~fractal_opt.measure.clock.TokenClock`, so its rules (device sync before each
    reading) hold here too.
    """

    def __init__(self, rows: Sequence[_Row], sync: Callable[[], None] | None, expire: Callable[[], None]):
        self.rows = rows
        self.clock = TokenClock(sync=sync)
        self.expire = expire

    def put(self, value: Any) -> None:
        first = self.clock.prompt_time is None
        self.clock.put(value)
        if first:  # prefill starts now
            for row in self.rows:
                row.ticket._start(row.prompt_tokens, at=self.clock.prompt_time)
            return
        now = self.clock.token_times[-1]
        per_row = [value[0].tolist()] if value.ndim == 2 else [[tok] for tok in value.tolist()]
        for row, tokens in zip(self.rows, per_row):
            for tok in tokens:
                row.take(tok, now)
        self.expire()

    def end(self) -> None:
        pass
