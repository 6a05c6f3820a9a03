"""The answers of ``fractal-opt serve``: a finished ticket as OpenAI's JSON, a running one as its
server-sent events, and the pieces both need (usage, finish reason, waiting on a ticket without
a thread).

Every streamed answer ends its ticket exactly once however the response ends: finished, the
client gone before the first chunk, or the task cancelled (:class:`TicketStream`, :class:`Watch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from .openai_requests import Parsed

__all__ = ["TicketStream", "Watch", "incomplete", "sse", "usage", "whole"]

_DISCONNECT_POLL_S = 0.1  # how often a waiting request checks whether its client is still there


def _ids() -> tuple[str, int]:
    return uuid.uuid4().hex[:24], int(time.time())


def usage(ticket: Any) -> dict[str, int]:
    """OpenAI's usage: prompt tokens as the model read them (chat template included), tokens generated."""
    return {"prompt_tokens": ticket.prompt_tokens, "completion_tokens": len(ticket.token_ids), "total_tokens": ticket.prompt_tokens + len(ticket.token_ids)}


def finish_reason(ticket: Any) -> str:
    """``"length"`` for an answer cut by its budget or its deadline, else ``"stop"``."""
    return "length" if ticket.hit_cap or ticket.status == "timeout" else "stop"


def incomplete(ticket: Any) -> dict[str, Any]:
    """``{"incomplete_details": ...}`` for an answer its deadline cut (the name OpenAI's Responses
    API gives an answer that ended early), else {}: the answer holds its tokens so far."""
    if ticket.status != "timeout":
        return {}
    after = f" {ticket.deadline - ticket.t_submit:g} s after it arrived" if ticket.deadline is not None else ""
    return {"incomplete_details": {"reason": "timeout", "message": f"the answer was cut at the request's deadline,{after} (queueing included): "
                                                                   "these are its tokens so far."}}


def whole(ticket: Any, endpoint: str, model_name: str) -> dict[str, Any]:
    """A finished ticket as a ``chat.completion`` or ``text_completion`` object."""
    rid, now = _ids()
    text = ticket.result().text
    if endpoint == "chat.completions":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason(ticket), "logprobs": None}
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": now, "model": model_name, "choices": [choice], "usage": usage(ticket),
                **incomplete(ticket)}
    choice = {"index": 0, "text": text, "finish_reason": finish_reason(ticket), "logprobs": None}
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": now, "model": model_name, "choices": [choice], "usage": usage(ticket),
            **incomplete(ticket)}


async def sse(ticket: Any, watch: Watch, parsed: Parsed, endpoint: str, model_name: str, *, failed: Callable[[Any], Any],
              record: Callable[[], None]) -> AsyncIterator[str]:
    """The ticket's text as server-sent events, as it arrives; ``failed(ticket)`` is the error
    response of a ticket that ended without an answer (sent as one event), ``record`` counts its end."""
    rid, now = _ids()
    chat = endpoint == "chat.completions"
    head = {"id": f"chatcmpl-{rid}" if chat else f"cmpl-{rid}", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": now, "model": model_name}

    def chunk(text: str | None, finish: str | None = None, *, role: bool = False, extra: dict[str, Any] | None = None) -> str:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps({**head, 'choices': [choice], **(extra or {})})}\n\n"

    try:
        if chat:
            yield chunk("", role=True)
        sent = ""
        while True:
            text, ended = ticket.visible_text()
            if len(text) > len(sent) and text.startswith(sent):
                yield chunk(text[len(sent) :])
                sent = text
            if ended:
                break
            await watch.wait()
        if ticket.status == "done" or (ticket.status == "timeout" and ticket.token_ids):
            yield chunk(None if chat else "", finish_reason(ticket), extra=incomplete(ticket))
        else:
            yield f"data: {failed(ticket).body.decode()}\n\n"
        if parsed.include_usage:
            yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage(ticket)})}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # also when the client disconnects (the task is cancelled): the slot is freed
        watch.close(record)


class TicketStream(StreamingResponse):
    """A streamed answer that ends its ticket however the response ends: finished, the client
    gone before the first chunk (the generator's own ``finally`` would never run), or cancelled."""

    def __init__(self, content: Any, *, on_close: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class Watch:
    """Wakes a coroutine whenever its ticket changes, without a thread per request."""

    def __init__(self, ticket: Any):
        self.ticket = ticket
        self.event = asyncio.Event()
        loop = asyncio.get_running_loop()

        def changed() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown): nobody waits
                loop.call_soon_threadsafe(self.event.set)

        ticket.on_change(changed)
        self.closed = False

    async def wait(self, timeout: float = _DISCONNECT_POLL_S) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.event.wait(), timeout)
        self.event.clear()

    async def until(self, condition: Callable[[], bool], request: Any) -> bool:
        """Wait until ``condition()``; False (and the ticket cancelled) when the client left first."""
        while not condition():
            if await request.is_disconnected():
                self.ticket.cancel()
                return False
            await self.wait()
        return True

    def close(self, record: Callable[[], None]) -> None:
        """The request's end: cancel the ticket if it still runs, then record it (once)."""
        if self.closed:
            return
        self.closed = True
        if not self.ticket.finished:
            self.ticket.cancel()
        record()
