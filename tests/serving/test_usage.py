"""Usage over HTTP is what the tokenizer says, also when a request's ``stop`` ends the answer:
chat, streamed chat and completions, on the embedded model through llama.cpp (whose usage
arrives only when llama.cpp itself ends the request)."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request

import pytest

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _post(base: str, path: str, body: dict) -> bytes:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.read()


@pytest.mark.integration
def test_prompt_tokens_match_the_tokenizer_when_a_stop_ends_the_answer():
    """usage.prompt_tokens equals the chat template's token count under the GGUF's tokenizer, with and
    without a stop that cuts the answer, for chat, streamed chat (include_usage) and completions."""
    from fractal_opt.core.errors import ModelSourceError
    from fractal_opt.runtimes.llama_cpp.engine import LlamaCppEngine
    from fractal_opt.serving.http import create_app
    from fractal_opt.tower.plan import HardwarePlan, Plan

    try:
        engine = LlamaCppEngine.build(Plan(source="smollm2-135m-instruct", hardware=HardwarePlan(runtime="llama_cpp", threads=1)),
                                      progress=lambda _: None, max_new_tokens=16)
    except ModelSourceError as e:
        pytest.skip(str(e))
    ids = engine.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    expected = len(ids if isinstance(ids, list) else ids["input_ids"])  # a list, or a BatchEncoding on newer transformers
    app = create_app(engine, model_name="m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    while not web.started:
        time.sleep(0.01)
    base = f"http://127.0.0.1:{port}"
    try:
        whole = json.loads(_post(base, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 16}))
        text = whole["choices"][0]["message"]["content"]
        stop = text.split()[2]  # a word inside the answer
        assert whole["usage"]["prompt_tokens"] == expected
        cut = json.loads(_post(base, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 16, "stop": [stop]}))
        assert cut["choices"][0]["message"]["content"] == text[: text.index(stop)] and cut["choices"][0]["finish_reason"] == "stop"
        assert cut["usage"]["prompt_tokens"] == expected and cut["usage"]["completion_tokens"] < whole["usage"]["completion_tokens"]
        events = _post(base, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 16, "stop": stop, "stream": True,
                                                      "stream_options": {"include_usage": True}}).decode()
        chunks = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
        assert [c["usage"]["prompt_tokens"] for c in chunks if c.get("usage")] == [expected]
        completion = json.loads(_post(base, "/v1/completions", {"prompt": QUESTION[0]["content"], "max_tokens": 16, "stop": [stop]}))
        assert completion["usage"]["prompt_tokens"] == expected and completion["choices"][0]["text"] == text[: text.index(stop)]
    finally:
        web.should_exit = True
        thread.join(10)
