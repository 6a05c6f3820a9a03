"""One llama.cpp completion read from its chunks: text, token ids and times, the unstreamed
end-of-sequence token, llama.cpp's errors as fractal_opt's, and streaming that stops the request."""

from __future__ import annotations

import time

import pytest

from fractal_opt.core.errors import EngineError, RequestRejected
from fractal_opt.runtimes.llama_cpp.completion import complete, stream_text

EOS = 2


def _chunk(text: str, token_id: int, finish: str | None = None) -> dict:
    return {"choices": [{"text": text, "logprobs": {"content": [{"id": token_id}]}, "finish_reason": finish}]}


class FakeServer:
    """Calls the callback with the given chunks, as xllamacpp's streamed handle_completions does, and
    remembers whether the callback asked it to stop."""

    def __init__(self, chunks: list[dict], result: object = None, gap_s: float = 0.0):
        self.chunks, self.result, self.gap_s, self.stopped_after = chunks, result, gap_s, None

    def handle_completions(self, body: dict, callback) -> object:
        for i, chunk in enumerate(self.chunks):
            time.sleep(self.gap_s if i else 0.0)  # a token's decode time
            if callback(chunk):
                self.stopped_after = i + 1
                break
        return self.result


def _answer_of(chunks: list[dict], *, eos_id: int | None = EOS, on_tokens=None, result: object = None):
    return complete(FakeServer(chunks, result), {}, request_id="r1", eos_id=eos_id, on_tokens=on_tokens, context_per_request=512)


def test_chunks_become_the_answer_with_a_clock_reading_per_token():
    """Text is the streamed pieces joined, one id and one non-decreasing time per token, usage and finish kept."""
    a = _answer_of([{"usage": {"prompt_tokens": 7}}, _chunk("Par", 11), _chunk("is", 12, finish="length")])
    assert (a.text, a.token_ids, a.prompt_tokens, a.finish_reason) == ("Paris", [11, 12], 7, "length")
    assert len(a.token_times) == 2 and a.t_start <= a.token_times[0] <= a.token_times[1] <= a.t_done


def test_the_unstreamed_end_of_sequence_token_is_counted():
    """When llama.cpp reports one decoded token more than it streamed and stopped, that token is EOS and counts."""
    a = _answer_of([_chunk("Hi", 11, finish="stop"), {"timings": {"predicted_n": 2}}])
    assert a.token_ids == [11, EOS] and len(a.token_times) == 2


def test_without_an_eos_to_count_the_extra_token_is_left_out():
    """With stop strings in force (eos_id None) a held-back token cannot be told from EOS, so nothing is added."""
    a = _answer_of([_chunk("Hi", 11, finish="stop"), {"timings": {"predicted_n": 2}}], eos_id=None)
    assert a.token_ids == [11]


def test_a_context_overflow_is_a_rejected_request_naming_the_limit():
    """llama.cpp's exceed_context_size_error is RequestRejected, saying the context per request and how to raise it."""
    with pytest.raises(RequestRejected, match=r"'r1'.*context per request: 512 tokens"):
        _answer_of([{"error": {"type": "exceed_context_size_error", "message": "too long"}}])


def test_another_llama_cpp_error_is_an_engine_error():
    """An error in the returned result (not a chunk) is raised as EngineError with llama.cpp's message."""
    with pytest.raises(EngineError, match="llama.cpp refused request 'r1': boom"):
        _answer_of([], result={"error": {"message": "boom"}})


def test_streaming_yields_text_and_stops_the_request_when_the_caller_stops():
    """The caller gets each piece as it comes; breaking out after the first stops llama.cpp's request."""
    server = FakeServer([_chunk(f"t{i} ", i) for i in range(50)], gap_s=0.02)  # 1 s of tokens
    pieces = stream_text(lambda on_tokens: complete(server, {}, request_id="r", eos_id=None, on_tokens=on_tokens, context_per_request=64))
    assert next(pieces) == "t0 "
    pieces.close()  # the caller stops iterating: the stream stops the request and waits for its thread
    assert server.stopped_after is not None and server.stopped_after < 50


def test_streaming_raises_the_completions_error():
    """An error inside the completion's thread reaches the caller iterating the stream."""
    server = FakeServer([{"error": {"message": "gone"}}])
    with pytest.raises(EngineError, match="gone"):
        list(stream_text(lambda on_tokens: complete(server, {}, request_id="r", eos_id=None, on_tokens=on_tokens, context_per_request=64)))
