"""A tiny OpenAI-compatible streaming server on 127.0.0.1, for the vllm runtime's contract tests.

It speaks the subset of vLLM's API the runtime uses: ``GET /v1/models`` (with ``max_model_len``),
``POST /v1/completions`` with ``stream: true`` and a token-id ``prompt`` (SSE ``data:`` lines,
``prompt_token_ids`` in the first chunk's choice and ``token_ids`` per chunk as vLLM sends with
``return_token_ids``, a usage chunk, ``[DONE]``; a prompt and ``max_tokens`` over ``MAX_MODEL_LEN``
get vLLM's 400), the same for ``/v1/chat/completions`` (a
stand-in tokenizer's ids of the messages), and ``/v1/completions`` without ``stream`` (prompt
log-probabilities). The answer is deterministic: token i is ``" w{i}"`` with id ``100 + i``; it stops
with ``finish_reason: "stop"`` after ``eos_after`` tokens unless ``ignore_eos`` is set.

It records what a test needs to check the client: every request body, the most requests in flight
at once, and the requests whose client went away before the end (aborted, as vLLM would).

Run as a program it stands in for a ``vllm`` executable: ``fake_openai_server.py serve MODEL --host
127.0.0.1 --port N [vLLM flags, ignored] [--spawn-child]``; ``--spawn-child`` starts a child
process like vLLM's engine core, so a test can check that stopping the server ends it too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["FakeOpenAIServer"]

MAX_MODEL_LEN = 2048  # the context /v1/models reports


class FakeOpenAIServer:
    """``with FakeOpenAIServer(token_delay_s=0.01) as fake: fake.url`` -> ``http://127.0.0.1:PORT``.

    Args:
        token_delay_s: wait before each token (s), so timing and concurrency are observable.
        eos_after: tokens before the answer ends by itself (like end-of-sequence).
        model: the model id ``/v1/models`` lists.
        port: 0 = a free port the OS picks.
    """

    def __init__(self, *, token_delay_s: float = 0.01, eos_after: int = 1000, model: str = "fake-model", port: int = 0):
        self.token_delay_s = token_delay_s
        self.eos_after = eos_after
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self.aborted: list[int] = []  # request numbers whose client disconnected mid-stream
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="fake-openai", daemon=True)

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FakeOpenAIServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> FakeOpenAIServer:  # noqa: PYI034 (Python 3.10 has no typing.Self)
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _enter(self, body: dict[str, Any]) -> int:
        with self._lock:
            self.requests.append(body)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            return len(self.requests) - 1

    def _leave(self, number: int, *, aborted: bool) -> None:
        with self._lock:
            self.in_flight -= 1
            if aborted:
                self.aborted.append(number)


def _prompt_ids(messages: list[dict[str, str]]) -> list[int]:
    """One id per whitespace-separated word of every message (a stand-in tokenizer)."""
    return [1 + (hash(w) % 90) for m in messages for w in str(m.get("content", "")).split()] or [1]


def _handler(fake: FakeOpenAIServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet: tests read their own output
            pass

        def _json(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # http.server's naming
            if self.path.rstrip("/") == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": fake.model, "object": "model", "max_model_len": MAX_MODEL_LEN}]})
            else:
                self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/v1/completions" and not body.get("stream"):
                self._completion(body)
                return
            if self.path not in ("/v1/chat/completions", "/v1/completions"):
                self._json(404, {"error": {"message": f"no route {self.path}"}})
                return
            if body.get("model") != fake.model:
                self._json(404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}})
                return
            if not body.get("stream"):
                self._json(400, {"error": {"message": "this fake server only streams"}})
                return
            asked = len(body.get("prompt") or _prompt_ids(body.get("messages") or [])) + int(body.get("max_tokens") or 16)
            if asked > MAX_MODEL_LEN:  # vLLM's refusal of a request over max_model_len
                self._json(400, {"error": {"message": f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested {asked} tokens.",
                                           "type": "BadRequestError", "code": 400}})
                return
            number = fake._enter(body)
            aborted = False
            try:
                self._stream(body)
            except (BrokenPipeError, ConnectionResetError):
                aborted = True
            finally:
                fake._leave(number, aborted=aborted)

        def _completion(self, body: dict[str, Any]) -> None:
            """Non-streaming /v1/completions with prompt_logprobs, in vLLM's shape: token i's
            entry names token i (plus a rival id 1); the generated token's alternatives are keyed
            ``token_id:N``."""
            fake.requests.append(body)
            prompt = [int(t) for t in body["prompt"]]
            entries: list[Any] = [None] + [{str(t): {"logprob": -0.5, "rank": 1, "decoded_token": f"t{t}"}, "1": {"logprob": -1.5, "rank": 2, "decoded_token": "t1"}} for t in prompt[1:]]
            tops = [{"token_id:100": -0.25, "token_id:1": -2.0}]
            choice = {"index": 0, "text": " w0", "token_ids": [100], "finish_reason": "length", "prompt_token_ids": prompt,
                      "prompt_logprobs": entries, "logprobs": {"tokens": ["token_id:100"], "token_logprobs": [-0.25], "top_logprobs": tops, "text_offset": [0]}}
            self._json(200, {"id": "cmpl-fake", "object": "text_completion", "model": fake.model, "choices": [choice]})

        def _event(self, payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else json.dumps(payload)
            line = f"data: {data}\n\n".encode()
            self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")  # one HTTP chunk per event
            self.wfile.flush()

        def _stream(self, body: dict[str, Any]) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chat = "messages" in body
            prompt = _prompt_ids(body.get("messages") or []) if chat else [int(t) for t in body.get("prompt") or []]
            budget = int(body.get("max_tokens") or 16)
            n = budget if body.get("ignore_eos") else min(budget, fake.eos_after)
            base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk" if chat else "text_completion", "model": fake.model}
            if chat:
                self._event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}], "prompt_token_ids": prompt})
            else:
                self._event({**base, "choices": [{"index": 0, "text": "", "finish_reason": None, "prompt_token_ids": prompt}]})
            for i in range(n):
                time.sleep(fake.token_delay_s)
                last = i == n - 1
                finish = ("length" if n == budget else "stop") if last else None
                piece = {"delta": {"content": f" w{i}"}} if chat else {"text": f" w{i}"}
                self._event({**base, "choices": [{"index": 0, **piece, "token_ids": [100 + i], "finish_reason": finish}]})
            self._event({**base, "choices": [], "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}})
            self._event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler


def main(argv: list[str] | None = None) -> None:
    """Stand in for ``vllm serve MODEL --host H --port P ...``: serve until SIGTERM."""
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--spawn-child", action="store_true")
    parser.add_argument("--token-delay-s", type=float, default=0.005)
    args, _vllm_flags = parser.parse_known_args(argv)
    if args.host not in ("127.0.0.1", "localhost"):
        raise SystemExit(f"fake_openai_server listens on loopback only, not {args.host!r}")
    child = None
    if args.spawn_child:  # like vLLM's engine core: a process of our own the test must see ended
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"child pid {child.pid}", flush=True)
    fake = FakeOpenAIServer(token_delay_s=args.token_delay_s, model=args.model, port=args.port)
    print(f"serving {args.model} on {fake.url}", flush=True)
    try:
        fake._httpd.serve_forever()
    finally:
        if child is not None:
            child.terminate()


if __name__ == "__main__":
    main()
