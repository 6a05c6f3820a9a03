"""Sequential and static (left-padded) batch serving: one ``generate`` call per batch.

A batch is up to ``in_flight_limit(plan)`` queued requests (1 when sequential); the worker waits
at most ``max_wait_ms`` for a static batch to fill. Each row is answered as soon as it ends (its
end-of-sequence token, its own token budget, a cancel or a timeout); the batch stops as soon as
every row has ended, so a cancelled or timed-out lone request frees its KV cache at the next step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ...errors import RequestRejected
from ...serving.server import Server, Ticket

__all__ = ["BatchServer"]

_IDLE_WAIT_S = 3600.0  # an idle worker sleeps in slices of _POLL_S until a request or close arrives


class BatchServer(Server):
    """Sequential (batch of one) or static padded batches, per the plan."""

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
            self._run_batch(batch)

    def _run_batch(self, batch: list[Ticket]) -> None:
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        from .engine import eos_ids
        from .generate_kwargs import uses_streamer
        from .torch_knobs import no_grad, runtime

        engine = self.engine
        batch = [t for t in batch if self._fits(t)]
        if not batch:
            return
        try:
            inputs = self._encoded(batch)
            mask = inputs["attention_mask"]
            for row, t in enumerate(batch):
                t._start(int(mask[row].sum()))
            budget = max(t.max_new_tokens for t in batch)
            kwargs = engine._generate_kwargs(budget)
            if self.ignore_eos:
                # End-of-sequence is generated like any other token but ends nothing, as in
                # continuous batching (eos -1 there), so every mode gives the same tokens.
                # (min_new_tokens would instead ban it and pick the runner-up: other tokens.)
                kwargs["eos_token_id"] = None
            eos = set() if self.ignore_eos else eos_ids(engine.model, engine.tokenizer)
            sync = torch.cuda.synchronize if str(engine.model.device).startswith("cuda") else None
            streamer = _RowStreamer(self, batch, eos, sync)

            class _AllEnded(StoppingCriteria):
                # Rows whose ticket has ended stop; generate returns when every row has.
                def __call__(self, input_ids: Any, scores: Any, **kw: Any) -> Any:
                    return torch.tensor([t.finished for t in batch], device=input_ids.device)

            if not uses_streamer(self.plan):
                streamer = None  # transformers refuses a streamer with beam search: tokens arrive at the end
            with engine._lock, runtime(self.plan, engine.machine), no_grad():
                torch.manual_seed(self.seed)
                output = engine.model.generate(**inputs, streamer=streamer, stopping_criteria=StoppingCriteriaList([_AllEnded()]), **kwargs)
            if streamer is None:
                now = time.perf_counter()
                prompt_len = inputs["input_ids"].shape[1]
                for row, t in enumerate(batch):
                    ids = output[row, prompt_len:].tolist()
                    cut = next((j + 1 for j, tok in enumerate(ids) if tok in eos), len(ids))
                    t._add(ids[:cut], [now] * cut)
        except Exception as e:  # noqa: BLE001 (one failed batch fails its requests; the server goes on)
            for t in batch:
                self._end(t, "error", e)
            return
        for t in batch:
            self._end(t, "done")


    def _fits(self, ticket: Ticket) -> bool:
        """Reject (only) this ticket when its prompt plus budget exceeds the plan's context cap."""
        if self.plan.model.context_cap is None:
            return True
        n = int(self.engine._encode([ticket.request])["attention_mask"].sum())
        try:
            self.engine.check_context(n, ticket.max_new_tokens)
        except RequestRejected as e:
            self._end(ticket, "rejected", e)
            return False
        return True


class _RowStreamer:
    """A generate() streamer that hands each row's new token to its ticket, with a clock reading.

    transformers calls ``put`` with the prompt ids first, then once per step with one new token
    per row (shape ``[batch]``), and ``end`` when done.
    """

    def __init__(self, server: BatchServer, tickets: Sequence[Ticket], eos: set[int], sync: Any):
        self.server = server
        self.tickets = tickets
        self.eos = eos
        self.sync = sync
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        tokens = value.reshape(-1).tolist()
        for t, tok in zip(self.tickets, tokens):
            if t.finished:
                continue
            t._add([tok], [now])
            if tok in self.eos or len(t.token_ids) >= t.max_new_tokens:
                self.server._end(t, "done")
        self.server._expire()

    def end(self) -> None:
        pass
