"""A stand-in for llama.cpp's ``llama-server`` executable, for the llama_cpp runtime's process tests.

Run as ``fake_llama_server.py --model M --host 127.0.0.1 --port N [llama-server flags]``: it writes
its argument list as JSON to ``$FAKE_LLAMA_ARGS`` (when set), then serves the subset of
llama-server's API the runtime uses, in llama-server's own shapes:

- ``GET /health``: 200 once listening.
- ``POST /v1/completions`` with ``stream: true`` and a token-id ``prompt``: one SSE ``data:`` chunk
  per token (token i is ``" w{i}"`` with id ``100 + i``, its id in ``logprobs.content``), a chunk
  with ``finish_reason`` ``"length"`` and llama.cpp's ``timings``, a usage chunk whose
  ``prompt_tokens`` is the prompt's length, ``[DONE]``. Each prompt is appended as a JSON line to
  ``$FAKE_LLAMA_PROMPTS`` (when set): the ids the runtime sent. A prompt longer than
  ``$FAKE_LLAMA_CONTEXT`` tokens (default 256) is refused with HTTP 400 and an
  ``exceed_context_size_error``, as llama-server refuses a prompt over the slot's context. With
  ``$FAKE_LLAMA_DIE`` set to ``midway`` (or ``torn``) a streamed answer gets two tokens (then half
  a chunk), then the process writes a fatal line to stderr and exits with status 7, as a crashing
  llama-server cuts its streams.
- ``POST /v1/completions`` without ``stream``: one token with ``n_probs`` top log-probabilities.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _json(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/health":
            self._json(200, {"status": "ok"})
        else:
            self._json(404, {"error": {"code": 404, "message": "not found", "type": "not_found_error"}})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path != "/v1/completions":
            self._json(404, {"error": {"code": 404, "message": "not found", "type": "not_found_error"}})
            return
        if not body.get("stream"):
            k = int(body.get("n_probs") or 1)
            top = [{"id": 100 + j, "token": f" w{j}", "logprob": -0.5 * (j + 1)} for j in range(k)]
            self._json(200, {"choices": [{"text": " w0", "index": 0, "finish_reason": "length",
                                          "logprobs": {"content": [{"id": 100, "token": " w0", "logprob": -0.5, "top_logprobs": top}]}}]})
            return
        prompt = body.get("prompt") or []
        if os.environ.get("FAKE_LLAMA_PROMPTS"):
            with open(os.environ["FAKE_LLAMA_PROMPTS"], "a") as f:
                f.write(json.dumps(prompt) + "\n")
        if len(prompt) > int(os.environ.get("FAKE_LLAMA_CONTEXT", "256")):
            self._json(400, {"error": {"code": 400, "message": "the request exceeds the available context size", "type": "exceed_context_size_error"}})
            return
        self._stream(body, len(prompt), os.environ.get("FAKE_LLAMA_DIE", ""))

    def _stream(self, body: dict[str, Any], prompt_tokens: int, die: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        n = int(body.get("max_tokens") or 4)
        try:
            for i in range(n):
                if i == 2 and die in ("midway", "torn"):
                    if die == "torn":
                        self.wfile.write(b'data: {"choices": [{"ind')
                        self.wfile.flush()
                    sys.stderr.write("fatal: simulated crash while decoding\n")
                    sys.stderr.flush()
                    os._exit(7)
                time.sleep(0.002)
                self._event({"choices": [{"index": 0, "finish_reason": None, "text": f" w{i}",
                                          "logprobs": {"content": [{"id": 100 + i, "token": f" w{i}", "logprob": -0.1}]}}]})
            self._event({"choices": [{"index": 0, "finish_reason": "length", "text": ""}],
                         "timings": {"prompt_n": prompt_tokens, "prompt_ms": 1.0, "predicted_n": n, "predicted_ms": 2.0 * n}})
            self._event({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n}})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client cut the stream (a cancelled request)
        self.close_connection = True

    def _event(self, chunk: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    if os.environ.get("FAKE_LLAMA_ARGS"):
        with open(os.environ["FAKE_LLAMA_ARGS"], "w") as f:
            json.dump(sys.argv[1:], f)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
