"""Continuous batching through transformers' own engine (``model.init_continuous_batching``).

transformers runs the batch in a background thread on a paged KV cache: each step decodes one
token for every running request and prefills new ones in the room left (``max_batch_tokens``),
so a request joins the batch when it arrives and leaves it when it ends. This module only feeds
that manager: it admits queued tickets while fewer than ``in_flight_limit(plan)`` run, routes
streamed outputs to tickets, and cancels ended tickets with ``cancel_request`` (which frees their
cache blocks at the next step). No attention or cache code of our own.
"""

from __future__ import annotations

import contextlib
import math
import queue
from typing import Any

from ...core.errors import EngineError, RequestRejected
from ...serving.sampling import Sampling, differs
from ...serving.server import _POLL_S, Server, Ticket

__all__ = ["ContinuousServer", "cb_cache_tokens", "cb_config", "cb_unsupported"]

# Default KV-cache sizing when the plan leaves cb_num_blocks unset: room for every in-flight
# request to hold a prompt of this many tokens plus its full token budget. A request that outgrows
# it is paused and resumed by transformers' scheduler, never dropped.
_PROMPT_TOKENS_SIZED = 512
# Tokens per forward pass when the plan leaves cb_max_batch_tokens unset. transformers' default
# (8192) sizes a [tokens, cache] attention mask that took 5-8 s to the first token on the 4-layer
# test model on this 2-core CPU; 256 took 0.08 s (measured while sizing this default).
_MAX_BATCH_TOKENS = 256


# generate() arguments transformers' continuous batching honours; any other one the plan asks for
# (beams, prompt-lookup or draft speculation, stop strings, n-gram bans, a static / quantized /
# compiled cache) it would silently ignore, so such plans are refused instead.
_CB_ARGS = frozenset({"max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "min_p", "pad_token_id", "repetition_penalty"})


class _NoTokenizer:
    pad_token_id = None


def cb_unsupported(plan: Any) -> list[str]:
    """The generate() arguments of ``plan`` that continuous batching cannot honour (pure: no model)."""
    from .generate_kwargs import generate_kwargs

    kwargs = generate_kwargs(plan, _NoTokenizer(), budget=1)
    bad = sorted(k for k in kwargs if k not in _CB_ARGS)
    if kwargs.get("repetition_penalty", 1.0) != 1.0:
        bad.append("repetition_penalty")
    return bad


def cb_cache_tokens(scheduling: Any, *, in_flight: int, budget: int) -> int | None:
    """Tokens the paged KV cache holds, all requests together (None: sized by a share of free
    memory, known only once built). A request longer than this could never be scheduled."""
    if scheduling.cb_num_blocks is not None:
        return scheduling.cb_num_blocks * scheduling.cb_page_size
    if scheduling.cb_max_memory_percent is not None:
        return None
    # Size the cache for the work, not for 60% of free RAM (transformers' CPU default).
    return math.ceil(in_flight * (_PROMPT_TOKENS_SIZED + budget) / scheduling.cb_page_size) * scheduling.cb_page_size


def cb_config(scheduling: Any, *, in_flight: int, budget: int, seed: int) -> Any:
    """The ``ContinuousBatchingConfig`` for a plan's scheduling section."""
    from transformers import ContinuousBatchingConfig

    tokens = cb_cache_tokens(scheduling, in_flight=in_flight, budget=budget)
    num_blocks = None if tokens is None else tokens // scheduling.cb_page_size
    return ContinuousBatchingConfig(
        page_size=scheduling.cb_page_size,
        num_blocks=num_blocks,
        max_batch_tokens=scheduling.cb_max_batch_tokens or _MAX_BATCH_TOKENS,
        max_memory_percent=scheduling.cb_max_memory_percent,
        max_requests_per_batch=in_flight,
        scheduler_type=scheduling.cb_scheduler,
        # transformers shares the KV pages of a prompt prefix it has seen (on by default); only when
        # the plan asks, so a repeated suite prompt does not turn TTFT into a cache hit unasked.
        allow_block_sharing=scheduling.prefix_cache,
        auto_switch_to_flash=False,  # the hardware layer chooses the attention kernel, not the server
        drop_unsupported_processors=False,  # a decoding option CB cannot honour must fail, not vanish
        seed=seed,
    )


class ContinuousServer(Server):
    """Continuous batching: requests join and leave the running batch at every decode step."""

    def __init__(self, engine: Any, **kwargs: Any):
        super().__init__(engine, **kwargs)
        self._running: dict[str, Ticket] = {}  # manager request id (ticket key) -> ticket; worker thread only
        self._to_cancel: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._eos: frozenset[int] = frozenset()  # the ids that end a request (none with ignore_eos)

    def sampling_refused(self, sampling: Sampling) -> tuple[str, str] | None:
        """A request's own sampling that would change the plan's decoding: refused, because
        transformers' manager fixes greedy-or-sampling and the seed for the whole batch
        (``GenerationConfig`` and ``ContinuousBatchingConfig.seed`` at start-up)."""
        name = differs(self.plan.application, sampling, seed=self.seed)
        if name is None:
            return None
        value = getattr(sampling, name)
        return name, (f"'{name}'={value}: this deployment batches continuously with transformers, whose batch decodes every request with the "
                      f"plan's sampling and the server's seed (application.do_sample / temperature / top_p, fractal-opt serve --seed); "
                      "omit the field, or serve the plan with static or sequential batching (or the llama.cpp / vLLM runtime) for per-request sampling.")

    def _cancelled(self, ticket: Ticket) -> None:
        self._forget(ticket)
        self._to_cancel.put(ticket.key)  # the worker tells the manager (it owns the manager)

    def _run(self) -> None:
        engine = self.engine
        eos = sorted(engine.eos_ids())
        self._eos = frozenset() if self.ignore_eos else frozenset(eos)
        with contextlib.ExitStack() as stack:
            stack.enter_context(engine.exclusive())  # the model is the manager's until close()
            manager = engine.model.init_continuous_batching(
                generation_config=self._generation_config(eos),
                continuous_batching_config=cb_config(self.plan.scheduling, in_flight=self.in_flight, budget=engine.budget(None), seed=self.seed),
            )
            manager.start()
            stack.callback(manager.destroy)
            stack.callback(manager.stop, block=True, timeout=30)
            self._loop(manager, -1 if self.ignore_eos or not eos else eos)

    def _loop(self, manager: Any, eos: Any) -> None:
        while True:
            self._expire()
            while True:  # cancellations first: they free slots and cache blocks
                try:
                    key = self._to_cancel.get_nowait()
                except queue.Empty:
                    break
                if self._running.pop(key, None) is not None:
                    manager.cancel_request(key)
            if self._closed.is_set() and not self._running:
                return
            while len(self._running) < self.in_flight and not self._closed.is_set():
                try:
                    ticket = self._queue.get_nowait()
                except queue.Empty:
                    break
                self._admit(manager, ticket, eos)
            out = manager.get_result(timeout=_POLL_S)
            while out is not None:
                self._route(out)
                out = manager.get_result(timeout=0)
            if not manager.is_running():
                error = manager.background_thread_status.fatal_error
                raise EngineError(f"the continuous batching loop stopped: {error}")

    def _admit(self, manager: Any, ticket: Ticket, eos: Any) -> None:
        if ticket.finished:
            return
        encoded = self.engine.encode_prompts([ticket.request])
        ids = encoded.inputs["input_ids"][0].tolist()
        ticket.prompt_tokens_saved = encoded.saved[0]
        try:
            self.engine.check_context(len(ids), ticket.max_new_tokens)  # the plan's cap, or the model's context
        except RequestRejected as e:
            self._end(ticket, "rejected", e)
            return
        if not ticket._start(len(ids)):
            return
        self._running[ticket.key] = ticket
        manager.add_request(ids, request_id=ticket.key, max_new_tokens=ticket.max_new_tokens, streaming=True, record_timestamps=True, eos_token_id=eos)

    def _route(self, out: Any) -> None:
        ticket = self._running.get(out.request_id)
        if ticket is None:  # cancelled or timed out while the step ran: its output is dropped
            return
        done = len(ticket.token_ids)
        new = out.generated_tokens[done:]
        times = (out.timestamps or [])[done:]
        ticket._add(new, times if len(times) == len(new) else [out.lifespan[1]] * len(new))
        if out.error is not None:
            del self._running[out.request_id]
            self._end(ticket, "error", EngineError(f"continuous batching failed request {ticket.request.id!r}: {out.error}"))
        elif out.is_finished():
            del self._running[out.request_id]
            ticket.ended_on_eos = bool(ticket.token_ids) and ticket.token_ids[-1] in self._eos
            self._end(ticket, "done")

    def _generation_config(self, eos: list[int]) -> Any:
        from transformers import GenerationConfig

        from .generate_kwargs import generate_kwargs

        bad = cb_unsupported(self.plan)
        if bad:
            raise EngineError(f"continuous batching cannot honour the plan's {bad}; serve this plan with static or sequential batching")
        kwargs = generate_kwargs(self.plan, self.engine.tokenizer, budget=self.engine.budget(None))  # no draft model: CB refuses speculation
        return GenerationConfig(**kwargs, eos_token_id=eos or None)
