"""The vllm runtime: its contract against a local fake OpenAI server (always runs) and end to end on
the real vLLM environment (integration; skips with its reason when ``.venv-vllm`` is absent). The
plan mapping table is in test_vllm_engine_args.py."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from fractal_opt.core.errors import EngineError, RequestRejected
from fractal_opt.runtimes.vllm import VllmEngine, clear_cache, evict_except
from fractal_opt.runtimes.vllm.logprobs import coarse_kl_lower_bound, top_flip
from fractal_opt.runtimes.vllm.process import ENV_PATH, ENV_URL, default_executable
from fractal_opt.tower.plan import Plan
from fractal_opt.workloads.workload import Request, Workload

_spec = importlib.util.spec_from_file_location("fake_openai_server", Path(__file__).with_name("fake_openai_server.py"))
fake_openai_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_openai_server)
FakeOpenAIServer = fake_openai_server.FakeOpenAIServer


def quiet(message: str) -> None:
    pass


def vllm_plan(**sections: dict[str, Any]) -> Plan:
    plan = Plan(source="smollm2-135m-instruct").replace_section("hardware", runtime="vllm")
    for section, changes in sections.items():
        plan = plan.replace_section(section, **changes)
    return plan


@pytest.fixture(autouse=True)
def _no_server_outlives_a_test():
    """Every test starts with an empty server cache and stops what it started."""
    clear_cache()
    yield
    clear_cache()


# ---------------------------------------------------------------------------- contract: fake server
@pytest.fixture
def fake():
    with FakeOpenAIServer(token_delay_s=0.01) as server:
        yield server


def connect(fake: FakeOpenAIServer, monkeypatch: pytest.MonkeyPatch, **sections: dict[str, Any]) -> VllmEngine:
    monkeypatch.setenv(ENV_URL, fake.url)
    return VllmEngine.build(vllm_plan(**sections), progress=quiet)


def test_stream_yields_text_pieces(fake, monkeypatch) -> None:
    """engine.stream yields the answer piece by piece, and generate returns it whole."""
    engine = connect(fake, monkeypatch)
    assert list(engine.stream("Hello there", max_new_tokens=3)) == [" w0", " w1", " w2"]
    assert engine.generate("Hello there", max_new_tokens=4) == " w0 w1 w2 w3"
    body = fake.requests[-1]
    assert body["stream"] is True and body["temperature"] == 0.0 and body["max_tokens"] == 4
    assert body["prompt"] == engine.prompt_ids(Request(id="p", messages=(("user", "Hello there"),)))  # the ids fractal_opt rendered


def test_serve_times_every_token(fake, monkeypatch) -> None:
    """serve returns one clock reading per token, in order, after prefill starts, with the server's token ids."""
    engine = connect(fake, monkeypatch)
    request = Request(id="r1", messages=(("user", "one two three"),))
    [g] = engine.serve([request], max_new_tokens=5)
    assert g.request_id == "r1" and g.token_ids == [100, 101, 102, 103, 104] and g.text == " w0 w1 w2 w3 w4"
    assert g.prompt_tokens == len(engine.prompt_ids(request)) and g.hit_cap
    assert g.t_submit <= g.t_prefill_start <= g.token_times[0]
    assert g.token_times == sorted(g.token_times)
    # The fake waits 10 ms before each token: readings at arrival span >= 40 ms, not one batch at the end
    # (single gaps may shrink when a loaded machine reads two chunks at once).
    assert g.token_times[-1] - g.token_times[0] >= 0.03, g.token_times
    assert g.t_done is not None and g.t_done >= g.token_times[-1]


def test_end_of_sequence_is_not_the_cap(monkeypatch) -> None:
    """An answer that ends by itself before the budget has hit_cap False; ignore_eos forces the full budget."""
    with FakeOpenAIServer(token_delay_s=0.0, eos_after=3) as fake:
        engine = connect(fake, monkeypatch)
        [g] = engine.serve([Request(id="r", messages=(("user", "hi"),))], max_new_tokens=8)
        assert len(g.token_ids) == 3 and not g.hit_cap
        with engine.server(ignore_eos=True) as server:
            t = server.submit("hi", max_new_tokens=8)
            assert len(t.result(timeout=10).token_ids) == 8 and fake.requests[-1]["ignore_eos"] is True


def test_server_runs_up_to_max_concurrency_streams(fake, monkeypatch) -> None:
    """A continuous plan runs max_concurrency requests at once over HTTP, never more."""
    engine = connect(fake, monkeypatch, scheduling={"batching": "continuous", "max_concurrency": 3})
    with engine.server() as server:
        tickets = [server.submit(Request(id=f"r{i}", messages=(("user", f"q {i}"),)), max_new_tokens=10) for i in range(7)]
        results = [t.result(timeout=30) for t in tickets]
    assert [t.status for t in tickets] == ["done"] * 7
    assert all(len(r.token_ids) == 10 for r in results)
    assert fake.max_in_flight == 3


def test_sequential_plan_sends_one_at_a_time(fake, monkeypatch) -> None:
    """The default (sequential) plan serves requests one after another."""
    engine = connect(fake, monkeypatch)
    engine.serve([Request(id=f"r{i}", messages=(("user", "x"),)) for i in range(3)], max_new_tokens=3)
    assert fake.max_in_flight == 1


def test_cancel_aborts_the_stream(monkeypatch) -> None:
    """ticket.cancel() ends the ticket at once and closes its stream, so the server aborts the request."""
    with FakeOpenAIServer(token_delay_s=0.05) as fake:
        engine = connect(fake, monkeypatch, scheduling={"batching": "continuous", "max_concurrency": 2})
        with engine.server() as server:
            ticket = server.submit("long answer", max_new_tokens=200)
            it = iter(ticket)
            next(it), next(it)
            assert ticket.cancel()
            assert ticket.status == "cancelled" and len(ticket.result().token_ids) < 200
            deadline = time.perf_counter() + 5
            while not fake.aborted and time.perf_counter() < deadline:
                time.sleep(0.02)
        assert fake.aborted == [0]


def test_timeout_ends_a_slow_request(monkeypatch) -> None:
    """A request past its deadline ends with status timeout and its stream is closed."""
    with FakeOpenAIServer(token_delay_s=0.05) as fake:
        engine = connect(fake, monkeypatch)
        with engine.server() as server:
            ticket = server.submit("slow", max_new_tokens=200, timeout_s=0.3)
            g = ticket.result(timeout=10)
        assert ticket.status == "timeout" and 0 < len(g.token_ids) < 200


def test_the_context_comes_from_the_server_and_bounds_every_request(monkeypatch) -> None:
    """context_limit is the server's max_model_len and count_prompt the length of the ids vLLM
    receives; a budget past the context is sent as what the prompt leaves, a prompt that fills it
    ends rejected, and vLLM's own 400 for a request over its context is a RequestRejected."""
    from fractal_opt.engine.protocol import as_request

    with FakeOpenAIServer(token_delay_s=0.0, eos_after=2) as fake:
        engine = connect(fake, monkeypatch)
        limit = engine.context_limit()
        assert limit.tokens == fake_openai_server.MAX_MODEL_LEN and "max_model_len" in str(limit)
        assert engine.count_prompt(as_request("hi there")) == len(engine.prompt_ids(as_request("hi there")))
        with engine.server() as server:
            server.submit("hi", max_new_tokens=10**12, over_cap=True).result(timeout=10)
            assert fake.requests[-1]["max_tokens"] == limit.tokens - len(fake.requests[-1]["prompt"])
            full = server.submit("word " * limit.tokens)
            with pytest.raises(RequestRejected, match="leaves no room for an answer"):
                full.result(timeout=10)
        with pytest.raises(RequestRejected, match="maximum context length"):
            engine.client.stream_completion([1] * 10, {"max_tokens": limit.tokens})


def test_sampling_plan_reaches_the_request(fake, monkeypatch) -> None:
    """A sampling plan sends its temperature, top_p, top_k and the server's seed; stop strings too."""
    engine = connect(fake, monkeypatch, application={"do_sample": True, "temperature": 0.6, "top_p": 0.8, "top_k": 20, "stop": ("END",)})
    with engine.server(seed=7) as server:
        server.submit("hi", max_new_tokens=2).result(timeout=10)
    body = fake.requests[-1]
    assert (body["temperature"], body["top_p"], body["top_k"], body["seed"], body["stop"]) == (0.6, 0.8, 20, 7, ["END"])


def test_build_refuses_with_the_field(fake, monkeypatch) -> None:
    """build raises EngineError naming a field vLLM cannot honour, before contacting anything."""
    monkeypatch.setenv(ENV_URL, fake.url)
    with pytest.raises(EngineError, match=r"scheduling\.batching='static'"):
        VllmEngine.build(vllm_plan(scheduling={"batching": "static", "batch_size": 4}), progress=quiet)
    assert VllmEngine.refuse(vllm_plan()) is None


def test_logprobs_say_what_is_missing(fake, monkeypatch) -> None:
    """next_token_logprobs refuses clearly: vLLM gives top-k only, not the full distribution."""
    engine = connect(fake, monkeypatch)
    with pytest.raises(NotImplementedError, match="top-k"):
        next(engine.next_token_logprobs([1, 2, 3]))


def test_top_logprobs_align_to_positions(fake, monkeypatch) -> None:
    """Position j's entry is the distribution of token j + 1 (vLLM's prompt_logprobs shifted), the last from the generated token."""
    engine = connect(fake, monkeypatch)
    tops = engine.top_logprobs([5, 6, 7], k=2)
    assert tops == [{6: -0.5, 1: -1.5}, {7: -0.5, 1: -1.5}, {100: -0.25, 1: -2.0}]
    body = fake.requests[-1]
    assert (body["prompt_logprobs"], body["return_tokens_as_token_ids"], body["max_tokens"]) == (2, True, 1)


def test_coarse_kl_is_a_lower_bound() -> None:
    """The top-k coarse-grained KL never exceeds the true KL, is exact with a full top-k, and flips are exact."""
    import math

    p = [math.log(x) for x in (0.5, 0.2, 0.2, 0.1)]
    q = [math.log(x) for x in (0.4, 0.3, 0.1, 0.2)]
    true_kl = sum(math.exp(a) * (a - b) for a, b in zip(p, q))
    for k in range(1, 5):
        top = {i: q[i] for i in sorted(range(4), key=lambda i: -q[i])[:k]}
        bound = coarse_kl_lower_bound(p, top)
        assert 0.0 <= bound <= true_kl + 1e-12
    assert math.isclose(coarse_kl_lower_bound(p, dict(enumerate(q))), true_kl)
    assert not top_flip(p, {0: q[0], 1: q[1]}) and top_flip(p, {1: math.log(0.6), 0: math.log(0.3)})


def test_closed_engine_refuses_requests(fake, monkeypatch) -> None:
    """After close, serving raises EngineError; a server given by URL keeps running."""
    engine = connect(fake, monkeypatch)
    engine.close()
    with pytest.raises(EngineError, match="closed"):
        engine.generate("hi")
    assert fake.requests == [] and engine.client.models()


# ---------------------------------------------------------------------------- the process
def _running(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, exited but not yet reaped, counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    """A model folder with a config, a safetensors header of 2 x 3 x 4 float32 values and a tokenizer."""
    from fractal_opt.testing import tiny_tokenizer

    folder = tmp_path / "model"
    tiny_tokenizer(folder)
    (folder / "config.json").write_text("{}")
    header = json.dumps({"a.q_proj.weight": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
                         "b.norm.weight": {"dtype": "F32", "shape": [12], "data_offsets": [48, 96]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(96))
    return folder


@pytest.fixture
def fake_vllm(tmp_path: Path) -> Path:
    """An executable that stands in for `vllm`: the fake server, plus a child like vLLM's engine
    core; each start appends a line to ``starts.txt`` beside it."""
    exe = tmp_path / "vllm"
    exe.write_text(f"#!/bin/sh\necho start >> {tmp_path / 'starts.txt'}\n"
                   f"exec {sys.executable} {Path(__file__).with_name('fake_openai_server.py')} \"$@\" --spawn-child\n")
    exe.chmod(0o755)
    return exe


def starts(fake_vllm: Path) -> int:
    """How many servers the fake executable has started."""
    log = fake_vllm.with_name("starts.txt")
    return len(log.read_text().splitlines()) if log.exists() else 0


@pytest.fixture
def launch(model_folder, fake_vllm, monkeypatch):
    """build(**sections) -> a VllmEngine started from the fake executable on the model folder."""
    monkeypatch.delenv(ENV_URL, raising=False)
    monkeypatch.setenv(ENV_PATH, str(fake_vllm))

    built: list[VllmEngine] = []

    def build(**sections: dict[str, Any]) -> VllmEngine:
        plan = vllm_plan(**sections)
        built.append(VllmEngine.build(dataclasses.replace(plan, source=str(model_folder)), progress=quiet))
        return built[-1]

    yield build
    for engine in built:  # then the autouse fixture's clear_cache stops every server
        engine.close()


def _child_pid(engine: VllmEngine) -> int:
    return int(next(line for line in engine.process.log_path.read_text().splitlines() if line.startswith("child pid")).split()[-1])


def test_server_pids_are_the_server_and_its_children(launch) -> None:
    """A measurement counts the memory and CPU time of vllm serve and of what it spawned (the engine
    core holds the weights): server_pids lists them."""
    engine = launch()
    assert engine.generate("hi", max_new_tokens=1) == " w0"
    assert engine.server_pids() == [engine.process.pid, _child_pid(engine)]


def test_eviction_leaves_no_process(launch) -> None:
    """build starts the executable on loopback and serves through it; close leaves the server to
    the cache, and evicting it ends the server and its children."""
    engine = launch()
    assert engine.generate("hi", max_new_tokens=3) == " w0 w1 w2"
    census = engine.census()
    assert census["params"] == 24 and census["weight_bytes"] == 96 and census["max_model_len"] == 2048
    pid, child = engine.process.pid, _child_pid(engine)
    assert _running(pid) and _running(child) and engine.load_s > 0
    engine.close()
    engine.close()  # idempotent
    assert _running(pid), "close stopped a server the cache still holds"
    clear_cache()
    assert not _running(pid) and not _running(child)
    assert not engine.process.log_path.exists()  # a server that served leaves no log behind


def test_per_request_changes_reuse_the_server(launch, fake_vllm) -> None:
    """A plan that changes only decoding, max_new_tokens or the queue reuses the running server (load_s 0)."""
    first = launch()
    first.close()
    second = launch(application={"do_sample": True, "temperature": 0.5, "max_new_tokens": 7}, scheduling={"max_queue": 4, "timeout_s": 30.0})
    assert starts(fake_vllm) == 1 and second.process is first.process and second.load_s == 0.0
    assert second.generate("hi") == " w0 w1 w2 w3 w4 w5 w6"  # the new plan's budget, on the old server


def test_a_flag_change_starts_another_server(launch, fake_vllm) -> None:
    """A plan whose server flags differ (prefix cache on) gets its own server; the first keeps running."""
    first = launch()
    second = launch(scheduling={"prefix_cache": True})
    assert starts(fake_vllm) == 2 and second.process.pid != first.process.pid
    assert "--enable-prefix-caching" in second.process.command and "--no-enable-prefix-caching" in first.process.command
    assert first.generate("hi", max_new_tokens=2) == " w0 w1"


def test_close_does_not_stop_a_server_in_use(launch) -> None:
    """Closing one engine leaves the server serving another; evicted while in use, it stops when that one closes."""
    a, b = launch(), launch(application={"temperature": 0.3})
    assert a.process is b.process
    pid = a.process.pid
    a.close()
    assert b.generate("hi", max_new_tokens=2) == " w0 w1"
    evict_except(set())
    assert _running(pid) and b.generate("hi", max_new_tokens=1) == " w0"  # still in use: not stopped
    b.close()
    assert not _running(pid)


def test_cache_holds_two_servers(launch) -> None:
    """A third server evicts the least recently used one, which stops when no engine uses it."""
    engines = [launch(scheduling={"batching": "continuous", "max_concurrency": n}) for n in (2, 3)]
    pids = [e.process.pid for e in engines]
    for e in engines:
        e.close()
    launch(scheduling={"batching": "continuous", "max_concurrency": 2})  # touches the first: the second is oldest
    third = launch(scheduling={"batching": "continuous", "max_concurrency": 4})
    assert _running(pids[0]) and not _running(pids[1]) and _running(third.process.pid)


def test_evict_except_keeps_the_plans_weights(launch) -> None:
    """evict_except stops the servers whose plan's weights key is not kept, and only those."""
    kept = launch()
    other = launch(hardware={"runtime": "vllm", "dtype": "bfloat16"})
    kept.close()
    other.close()
    evict_except({kept.plan.weights_key()})
    assert _running(kept.process.pid) and not _running(other.process.pid)


def test_a_dead_server_is_started_again(launch, fake_vllm) -> None:
    """A cached server that died (crash, out of memory) is not reused: the next build starts a new one."""
    first = launch()
    first.close()
    first.process.stop()
    second = launch()
    assert starts(fake_vllm) == 2 and second.process is not first.process and second.generate("hi", max_new_tokens=1) == " w0"


def test_gpu_plans_stop_idle_servers_first(launch) -> None:
    """Before a server starts for a possible GPU, idle cached servers stop (vLLM reserves most of a GPU's memory)."""
    idle = launch()
    idle.close()
    busy = launch(hardware={"runtime": "vllm", "device": "auto"})  # "auto" may resolve to a GPU
    assert not _running(idle.process.pid) and _running(busy.process.pid)
    other = launch(hardware={"runtime": "vllm", "device": "auto", "dtype": "bfloat16"})
    assert _running(busy.process.pid) and _running(other.process.pid)  # a server in use is never stopped for another


def test_exit_stops_a_forgotten_server(model_folder, fake_vllm, monkeypatch) -> None:
    """A server whose engine was never closed, evicted and garbage-collected, still stops when Python exits."""
    import subprocess

    script = (f"import gc; from fractal_opt.tower.plan import Plan; from fractal_opt.runtimes.vllm import VllmEngine, clear_cache\n"
              f"e = VllmEngine.build(Plan(source={str(model_folder)!r}).replace_section('hardware', runtime='vllm'), progress=lambda m: None)\n"
              f"print(e.process.pid, flush=True); del e; clear_cache(); gc.collect()\n")
    env = {**os.environ, ENV_PATH: str(fake_vllm)}
    env.pop(ENV_URL, None)
    done = subprocess.run([sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not _running(int(done.stdout.split()[0]))


def test_failed_start_shows_the_server_log(model_folder, tmp_path, monkeypatch) -> None:
    """A server that dies while starting fails build with its exit status and its last log lines."""
    exe = tmp_path / "vllm"
    exe.write_text("#!/bin/sh\necho 'ValueError: no such model'\nexit 3\n")
    exe.chmod(0o755)
    monkeypatch.delenv(ENV_URL, raising=False)
    monkeypatch.setenv(ENV_PATH, str(exe))
    with pytest.raises(EngineError, match=r"(?s)status 3.*no such model"):
        VllmEngine.build(Plan(source=str(model_folder), hardware=vllm_plan().hardware), progress=quiet)


def test_missing_executable_names_the_variable(monkeypatch, tmp_path) -> None:
    """A $FRACTAL_OPT_VLLM that is not an executable fails with the variable and the path."""
    monkeypatch.delenv(ENV_URL, raising=False)
    monkeypatch.setenv(ENV_PATH, str(tmp_path / "nope"))
    with pytest.raises(EngineError, match=ENV_PATH):
        VllmEngine.build(vllm_plan(), progress=quiet)


# ---------------------------------------------------------------------------- end to end
@pytest.mark.integration
def test_vllm_serves_the_embedded_model_end_to_end(monkeypatch) -> None:
    """The real vLLM (.venv-vllm) serves the embedded model on this CPU: stream, concurrent serve, a reused server, no process left (~2 min)."""
    exe = Path(os.environ.get(ENV_PATH) or default_executable())
    if not exe.is_file():
        pytest.skip(f"no vLLM environment at {exe}: create it with make setup-vllm (about 90 s with uv)")
    if ENV_PATH not in os.environ and not (exe.parent.parent / ".setup-vllm-ok").is_file():
        pytest.skip(f"the vLLM environment at {exe.parent.parent} is incomplete (scripts/setup-vllm.sh did not finish): rerun make setup-vllm")
    monkeypatch.delenv(ENV_URL, raising=False)
    monkeypatch.setenv(ENV_PATH, str(exe))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))  # GiB; vLLM's default 4 is more than tests need
    plan = vllm_plan(model={"context_cap": 2048}, scheduling={"batching": "continuous", "max_concurrency": 4})
    engine = VllmEngine.build(plan, progress=quiet)
    try:
        assert engine.load_s > 0
        text = engine.generate("What is the capital of France?", max_new_tokens=16)
        assert "Paris" in text, text
        requests = [Request(id=f"r{i}", messages=(("user", f"Count to {i + 3}."),)) for i in range(4)]
        out = engine.serve(requests, max_new_tokens=12)
        assert [g.request_id for g in out] == [r.id for r in requests]
        assert all(0 < len(g.token_ids) <= 12 and len(g.token_times) == len(g.token_ids) and g.prompt_tokens > 0 for g in out)
        assert engine.census()["weight_bytes"] > 100e6  # 135 M params in float32 = 0.54 GB
        prompt = [1, 9690, 198, 2683, 359, 253]  # "<|im_start|>system\nYou are a" in SmolLM2's vocabulary
        tops = engine.top_logprobs(prompt, k=5)
        assert len(tops) == len(prompt) and all(len(t) >= 5 and all(isinstance(i, int) for i in t) for t in tops)
        assert prompt[2] in tops[1]  # position j's entry includes the actual next token
        pid = engine.process.pid
        # A measured round counts vllm serve and its engine core (which holds the 0.54 GB of
        # float32 weights), beyond what this process holds.
        import psutil

        from fractal_opt.measure.runner import measure

        assert len(engine.server_pids()) >= 2 and engine.server_pids()[0] == pid
        own_mb = psutil.Process().memory_info().rss / 2**20
        m = measure(engine, Workload(suite="default", limit=1, max_new_tokens=4, repeats=1, warmup=0))
        assert m.repeats[0]["peak_memory_mb"] > own_mb + 500, (m.repeats[0]["peak_memory_mb"], own_mb)
        assert m.repeats[0]["cpu_utilization"] > 0.2  # the engine core's CPU time counts
        # A plan that changes only decoding and the budget reuses the running server: no restart.
        sampled = VllmEngine.build(plan.replace_section("application", do_sample=True, temperature=0.7, max_new_tokens=8), progress=quiet)
        assert sampled.process is engine.process and sampled.load_s == 0.0
        assert 0 < len(sampled.serve(requests[:1])[0].token_ids) <= 8
        sampled.close()
    finally:
        engine.close()
        clear_cache()
    assert not _running(pid)
