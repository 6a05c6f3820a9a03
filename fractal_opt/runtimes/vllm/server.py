"""VllmServer: the shared request server (queue bound, timeouts, cancel, streaming) over HTTP
streams to a vLLM server, which does the continuous batching itself.

The worker admits queued tickets while fewer than ``in_flight`` run (the plan's limit, never more
than vLLM's ``--max-num-seqs``, so no request waits inside vLLM where this server can neither time
it out nor see it queued). Each admitted ticket runs on a thread of its own holding one streaming
``/v1/completions`` of the token ids fractal_opt rendered (weights/prompts.py); each chunk's token ids reach the ticket through ``_add`` with the clock
reading taken when the chunk arrived. A cancelled or timed-out ticket closes its connection, which
makes vLLM abort the request and free its KV-cache blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ...core.errors import RequestRejected
from ...serving.slot_server import SlotServer
from ...serving.ticket import Ticket
from .engine_args import sampling, sampling_fields
from .openai_client import Stream

__all__ = ["VllmServer"]


class VllmServer(SlotServer):
    """Up to ``in_flight`` concurrent HTTP streams; vLLM batches them continuously."""

    slot_name = "fractal-opt-vllm-stream"

    def __init__(self, engine: Any, **kwargs: Any):
        super().__init__(engine, **kwargs)
        self.in_flight = min(self.in_flight, engine.max_num_seqs)
        self._streams: dict[str, Stream] = {}  # ticket key -> its open HTTP stream
        self._streams_lock = threading.Lock()

    def _work(self, ticket: Ticket) -> None:
        """Run one ticket on its stream thread, from admission to its terminal state."""
        pieces = self.streamed_text(ticket)  # the text as vLLM streamed it (stop strings already cut)
        if not ticket._start(0):  # cancelled or timed out while queued
            return
        try:
            prompt = self.engine.prompt_ids(ticket.request)
            params = sampling(self.plan, self._budget(ticket, len(prompt)), ignore_eos=self.ignore_eos, seed=self.seed)
            if not ticket.sampling.empty:  # the request's own temperature / top_p / seed, over the plan's
                params.update(sampling_fields(self.decoding(ticket), self.seed))
            stream = self.engine.client.stream_completion(prompt, params)
            with self._streams_lock:
                self._streams[ticket.key] = stream
            if ticket.finished:  # cancelled while the request was being sent
                stream.cancel()
            for chunk in stream:
                if chunk.prompt_token_ids is not None:
                    ticket.prompt_tokens = len(chunk.prompt_token_ids)
                elif chunk.usage and not ticket.prompt_tokens:
                    ticket.prompt_tokens = int(chunk.usage.get("prompt_tokens", 0))
                ids = chunk.token_ids or ([-1] if chunk.text else [])  # a server without token ids: one token per chunk
                pieces.append(chunk.text)
                if ids:
                    ticket._add(ids, [chunk.t] * len(ids))
            if not ticket.finished:
                self._end(ticket, "done")
        except RequestRejected as e:  # over the model's context (vLLM's own 400, or no room left by the prompt)
            self._end(ticket, "rejected", e)
        except Exception as e:  # noqa: BLE001 (one request failed; the server goes on)
            if not ticket.finished:
                self._end(ticket, "error", e)
        finally:
            with self._streams_lock:
                self._streams.pop(ticket.key, None)

    def _budget(self, ticket: Ticket, prompt_tokens: int) -> int:
        """The ticket's budget, ended at the context: vLLM would refuse one past it.

        Raises:
            RequestRejected: the prompt leaves no room for an answer.
        """
        limit = self.engine.context_limit()
        if limit is None:
            return ticket.max_new_tokens
        if prompt_tokens >= limit.tokens:
            raise RequestRejected(f"the prompt is {prompt_tokens:,} tokens, which leaves no room for an answer in {limit}")
        return min(ticket.max_new_tokens, limit.tokens - prompt_tokens)

    def _cancelled(self, ticket: Ticket) -> None:
        """Cancel or timeout: close the ticket's stream, so vLLM aborts the request."""
        with self._streams_lock:
            stream = self._streams.get(ticket.key)
        if stream is not None:
            stream.cancel()
        self._forget(ticket)

    def _decode(self, ids: Sequence[int]) -> str:
        """Text of a ticket that never reached a stream (no tokens: nothing to decode)."""
        return ""
