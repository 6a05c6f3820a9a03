"""A placed llama.cpp plan: refused with the reason when it cannot run, and, on the native build, a
model split over two rpc-servers and two replicas behind HAProxy, every part a child that a kill -9
of `fractal-opt serve` does not leave behind, and health naming the part that is down."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from fractal_opt.layers.hardware import Runtime
from fractal_opt.layers.placement import Replicas, Split
from fractal_opt.runtimes.llama_cpp.placed import ReplicaSet, RpcSplitServer, starter
from fractal_opt.runtimes.llama_cpp.process import NATIVE, LlamaServerProcess, executable_problem
from fractal_opt.runtimes.llama_cpp.settings import refusals, server_settings
from fractal_opt.tower.plan import Plan

psutil = pytest.importorskip("psutil")
MODEL = "smollm2-135m-instruct"
KEY = "k-placed-test"
NATIVE_PLAN = Runtime(backend="llama_cpp", path=NATIVE, dtype="bfloat16").apply(Plan(source=MODEL))  # BF16: the Q4_1 kernels fail the gate on some CPUs
IN_PROCESS = Runtime(backend="llama_cpp").apply(Plan(source=MODEL))


def _reasons(plan: Plan) -> str:
    return "; ".join(refusals(plan))


def test_placements_need_a_llama_server_executable():
    """xllamacpp in this process has no RPC backend and is one server: a split or replicas there is refused, saying what to use."""
    assert "runtime: {backend: llama_cpp, path: native}" in _reasons(Split().apply(IN_PROCESS))
    assert "scheduling.replicas=2" in _reasons(Replicas(count=2).apply(IN_PROCESS))


def test_three_cpu_rpc_servers_are_refused_with_the_known_deadlock():
    assert "llama.cpp bug report #28487" in _reasons(Split(rpc_workers=3).apply(NATIVE_PLAN))


def test_an_unreachable_rpc_endpoint_is_refused_before_any_round():
    """An endpoint that refuses the connection is named with the error, at the runtime's refusal (before the build and any round)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: nothing listens there
    reasons = _reasons(Split(rpc_endpoints=(f"127.0.0.1:{port}",)).apply(NATIVE_PLAN))
    assert f"127.0.0.1:{port}" in reasons and "do not answer" in reasons


def test_replicas_without_haproxy_are_refused_with_how_to_install_it(monkeypatch):
    monkeypatch.setenv("PATH", "")
    assert "apt-get install haproxy" in _reasons(Replicas(count=2).apply(NATIVE_PLAN))


def test_a_split_and_replicas_together_are_refused():
    assert "one at a time" in _reasons(Replicas(count=2).apply(Split().apply(NATIVE_PLAN)))


def test_the_settings_choose_the_server_and_pin_each_replica():
    """Replicas get the cores shared out and as many threads; the starter picks the placed server."""
    settings = server_settings(Replicas(count=2).apply(NATIVE_PLAN), "m.gguf", physical_cores=2)
    assert (settings.replicas, settings.replica_cores, settings.threads) == (2, 1, 1)
    assert starter(settings) is ReplicaSet
    assert starter(server_settings(Split().apply(NATIVE_PLAN), "m.gguf", physical_cores=2)) is RpcSplitServer
    assert starter(server_settings(NATIVE_PLAN, "m.gguf", physical_cores=2)) is LlamaServerProcess


# ---------------------------------------------------------------------------- the native build, end to end

def _native() -> None:
    if (problem := executable_problem(NATIVE)) is not None:
        pytest.skip(problem)
    from fractal_opt.runtimes.llama_cpp.placement_rules import rpc_server_problem

    if (problem := rpc_server_problem()) is not None:
        pytest.skip(problem)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


@pytest.mark.integration
def test_a_split_plan_answers_and_health_names_a_dead_rpc_server():
    """Two rpc-servers hold the layers: the plan answers the README's question; one rpc-server killed, health names it."""
    _native()
    from fractal_opt.runtimes import build
    from fractal_opt.runtimes.llama_cpp import clear_cache

    engine = build(Split().apply(NATIVE_PLAN), progress=lambda _: None, max_new_tokens=16)
    try:
        assert "Paris" in engine.generate("What is the capital of France?")
        pids = engine.server_pids()
        assert len(pids) == 3  # llama-server and its two rpc-servers
        worker = [p for p in pids if "rpc-server" in " ".join(psutil.Process(p).cmdline())][0]
        assert "--host" in psutil.Process(worker).cmdline() and "127.0.0.1" in psutil.Process(worker).cmdline()
        os.kill(worker, signal.SIGKILL)
        _wait_gone([worker])
        assert "rpc-server" in (engine.health() or "") and "exited" in engine.health()
    finally:
        clear_cache()
    assert not _wait_gone(pids), "a part outlived the engine's server"


@pytest.mark.integration
def test_replicas_share_the_load_and_health_names_a_dead_replica():
    """Two pinned replicas behind HAProxy answer; one killed, health names it while it restarts."""
    _native()
    if shutil.which("haproxy") is None:
        pytest.skip("HAProxy is not installed (apt-get install haproxy; make setup-router)")
    from fractal_opt.runtimes import build
    from fractal_opt.runtimes.llama_cpp import clear_cache

    plan = Replicas(count=2, cores=1).apply(NATIVE_PLAN).replace_section("scheduling", batching="continuous", max_concurrency=2)
    engine = build(plan, progress=lambda _: None, max_new_tokens=8)
    try:
        assert "Paris" in engine.generate("What is the capital of France?")
        pids = engine.server_pids()
        servers = [p for p in pids if "llama-server" in " ".join(psutil.Process(p).cmdline())]
        assert len(servers) == 2 and sorted(len(psutil.Process(p).cpu_affinity()) for p in servers) == [1, 1]
        os.kill(servers[1], signal.SIGKILL)
        _wait_gone([servers[1]])
        assert "replica 2 of 2" in (engine.health() or "")
    finally:
        clear_cache()
    assert not _wait_gone(pids), "a part outlived the engine's server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp_path: Path, passes: dict) -> tuple[subprocess.Popen, str]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": MODEL, "workload": {"max_new_tokens": 4}, "passes": passes}), encoding="utf-8")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "fractal_opt", "serve", str(recipe), "--port", str(port), "--api-key", KEY, "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("serve did not answer /health within 180 s")


def _status(base: str, key: str | None) -> int:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(base + "/v1/chat/completions", data=body, headers=headers), timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.integration
@pytest.mark.parametrize("placement", ["split", "replicas"])
def test_a_sigkilled_serve_on_a_placed_plan_leaves_no_child(tmp_path, placement):
    """serve --api-key on a split or replicated plan: keyless requests get 401; kill -9 of serve leaves none of its parts 5 s later."""
    _native()
    if placement == "replicas" and shutil.which("haproxy") is None:
        pytest.skip("HAProxy is not installed (apt-get install haproxy; make setup-router)")
    hardware = [{"runtime": {"backend": "llama_cpp", "path": NATIVE, "dtype": "bfloat16"}}]
    passes = {"hardware": [*hardware, {"split": {"rpc_workers": 2}}]} if placement == "split" else \
        {"hardware": hardware, "scheduling": [{"batching": {"mode": "continuous"}}, {"replicas": {"count": 2, "cores": 1}}]}
    proc, base = _serve(tmp_path, passes)
    try:
        assert _status(base, None) == 401 and _status(base, KEY) == 200
        parts = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)
                 if any(name in " ".join(p.cmdline()) for name in ("llama-server", "rpc-server", "haproxy"))]
        assert len(parts) == 3, parts  # llama-server + 2 rpc-servers, or 2 replicas + HAProxy
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        assert not _wait_gone(parts), "a part of the plan outlived serve's SIGKILL by 5 s"
    finally:
        proc.kill()
