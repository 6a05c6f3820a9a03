"""One completion on a llama.cpp server, read chunk by chunk, with a clock reading per token.

The prompt arrives as token ids, rendered once by fractal_opt (:mod:`fractal_opt.weights.prompts`),
so llama.cpp never applies a chat template of its own. ``server.handle_completions(body, callback)``
(xllamacpp's in-process server, or the llama-server child's transport, :mod:`.process`: both
llama.cpp's ``/v1/completions``) blocks the calling thread and calls ``callback`` with one
OpenAI-style chunk per streamed token. :func:`complete` turns those chunks into an
:class:`Answer`: the text, the token ids and when each reached Python (that is when a caller
could see it), llama.cpp's own timings, and its errors as fractal_opt's. :func:`stream_text` runs
such a completion on a thread of its own and yields its text as it arrives.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ...core.errors import EngineError, RequestRejected
from ...serving.sampling import Decoding
from .settings import llama_seed

__all__ = ["Answer", "OnTokens", "complete", "sampling_fields", "stream_text"]

# A token-callback returns True to stop the request (llama.cpp then frees the slot).
OnTokens = Callable[[list[int], list[float], str], bool]


@dataclass
class Answer:
    """What one llama.cpp request produced, with a clock reading per token."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    finish_reason: str | None = None  # "length" (budget), "stop" (end of sequence / stop string)
    timings: dict[str, Any] = field(default_factory=dict)  # llama.cpp's own (prompt_ms, cache_n, ...)
    t_start: float = 0.0  # when the request went to llama.cpp (prefill starts, a slot being free)
    t_done: float = 0.0


class _Reader:
    """The callback llama.cpp calls with each chunk: it fills one :class:`Answer`.

    ``eos_id``: the end-of-sequence token to count when llama.cpp reports it decoded one token
    beyond those it streamed (it decodes the end-of-sequence token but does not stream it; the
    transformers runtime counts it as generated work, so it is counted here too, at the moment
    llama.cpp reported the end). None where that count cannot tell it from a held-back stop
    string's tokens (a plan or request with stop strings) or the GGUF names no such token.
    """

    def __init__(self, *, eos_id: int | None, on_tokens: OnTokens | None):
        self.answer = Answer(t_start=time.perf_counter())
        self.eos_id, self.on_tokens = eos_id, on_tokens
        self.pieces: list[str] = []
        self.errors: list[dict[str, Any]] = []
        self.t_finish = 0.0  # when the chunk carrying finish_reason arrived

    def __call__(self, chunk: dict[str, Any]) -> bool:
        now = time.perf_counter()
        if "error" in chunk:
            self.errors.append(chunk["error"])
            return True
        if "usage" in chunk:
            self.answer.prompt_tokens = int(chunk["usage"].get("prompt_tokens", 0))
        if "timings" in chunk:
            self.answer.timings = chunk["timings"]
            self._count_eos()
        if not chunk.get("choices"):
            return False
        choice = chunk["choices"][0]
        if choice.get("finish_reason"):
            self.answer.finish_reason, self.t_finish = choice["finish_reason"], now
        text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""  # completions' "text" (a chat chunk's delta.content)
        ids = [int(t["id"]) for t in ((choice.get("logprobs") or {}).get("content") or [])]
        if not ids and not text:
            return False
        self.pieces.append(text)
        self.answer.token_ids.extend(ids)
        self.answer.token_times.extend([now] * len(ids))
        return bool(self.on_tokens(ids, [now] * len(ids), text)) if self.on_tokens is not None else False

    def _count_eos(self) -> None:
        a = self.answer
        extra = int(a.timings.get("predicted_n", 0)) - len(a.token_ids)
        if self.eos_id is None or a.finish_reason != "stop" or extra != 1:
            return
        a.token_ids.append(self.eos_id)
        a.token_times.append(self.t_finish)
        if self.on_tokens is not None:
            self.on_tokens([self.eos_id], [self.t_finish], "")


def complete(server: Any, body: dict[str, Any], *, request_id: str, eos_id: int | None, on_tokens: OnTokens | None,
             context_per_request: int) -> Answer:
    """Run one completion request ``body`` (its ``prompt``: token ids) on ``server`` to its end, on the calling thread.

    ``on_tokens(ids, times, text)`` is called as tokens arrive; returning True stops the
    request. A chunk normally holds one token; llama.cpp holds back a token that ends inside a
    UTF-8 character or a possible stop string and sends it with the next one, so such tokens
    share a clock reading.

    Raises:
        RequestRejected: llama.cpp refused the request (prompt + budget over the context per request).
        EngineError: llama.cpp reported another error.
    """
    reader = _Reader(eos_id=eos_id, on_tokens=on_tokens)
    result = server.handle_completions(body, reader)
    reader.answer.t_done = time.perf_counter()
    if isinstance(result, dict) and "error" in result:
        reader.errors.append(result["error"])
    if reader.errors:
        e = reader.errors[0]
        msg = f"llama.cpp refused request {request_id!r}: {e.get('message', e)}"
        if e.get("type") == "exceed_context_size_error":
            raise RequestRejected(f"{msg} (context per request: {context_per_request} tokens; raise the context_cap pass's tokens or lower max_new_tokens)")
        raise EngineError(msg)
    reader.answer.text = "".join(reader.pieces)
    return reader.answer


def stream_text(run: Callable[[OnTokens], Any]) -> Iterator[str]:
    """Yield a completion's text piece by piece: ``run(on_tokens)`` performs it on a thread of its
    own; the caller stopping early stops the request too. An error in ``run`` is raised here."""
    pieces: queue.SimpleQueue[str | None] = queue.SimpleQueue()
    errors: list[BaseException] = []
    stop = threading.Event()  # the caller stopped iterating: stop the request too

    def on_tokens(ids: list[int], times: list[float], text: str) -> bool:
        if text:
            pieces.put(text)
        return stop.is_set()

    def work() -> None:
        try:
            run(on_tokens)
        except BaseException as e:  # noqa: BLE001 (surfaced to the caller below)
            errors.append(e)
        finally:
            pieces.put(None)

    thread = threading.Thread(target=work, name="fractal-opt-llama-stream", daemon=True)
    thread.start()
    try:
        while (piece := pieces.get()) is not None:
            yield piece
    finally:
        stop.set()
        thread.join()
    if errors:
        raise errors[0]


def sampling_fields(decoding: Decoding, seed: int) -> dict[str, Any]:
    """llama.cpp's sampling fields for one request's decoding, every one sent (llama.cpp's own
    defaults differ from transformers', as :func:`.settings.request_body` notes)."""
    if not decoding.do_sample:
        return {"temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}  # greedy: the argmax token
    return {"temperature": decoding.temperature, "top_p": decoding.top_p, "top_k": decoding.top_k or 0, "min_p": decoding.min_p or 0.0,
            "seed": llama_seed(seed if decoding.seed is None else decoding.seed)}
