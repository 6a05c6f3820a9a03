"""`fractal-opt serve` on a llama.cpp plan, as a process: what it listens on, what it leaves
behind when killed with SIGKILL, and what it does when its llama-server child dies.

The child tests run a stand-in llama-server (tests/runtimes/fake_llama_server.py) on the embedded
model's file (nothing loads it); the listener test runs xllamacpp in the process on the real model.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

psutil = pytest.importorskip("psutil")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MODEL = "smollm2-135m-instruct"
FAKE = Path(__file__).parents[1] / "runtimes" / "fake_llama_server.py"
KEY = "k-serve-test"


def _embedded_model() -> None:
    from fractal_opt.core.errors import ModelSourceError
    from fractal_opt.weights.models import resolve

    try:
        resolve(MODEL)
    except ModelSourceError as e:
        pytest.skip(f"embedded model not installed: {e}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fake_exe(tmp_path: Path) -> Path:
    """A llama-server stand-in that refuses to start while tmp_path/broken exists (a restart that fails)."""
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\n[ -e {tmp_path / 'broken'} ] && {{ echo 'fatal: broken on purpose' >&2; exit 3; }}\nexec {sys.executable} {FAKE} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def _serve(tmp_path: Path, runtime: dict) -> tuple[subprocess.Popen, str, int]:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": MODEL, "workload": {"max_new_tokens": 4}, "passes": {"hardware": [{"runtime": runtime}]}}), encoding="utf-8")
    port = _free_port()
    cmd = [sys.executable, "-m", "fractal_opt", "serve", str(recipe), "--port", str(port), "--api-key", KEY, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited {proc.returncode}: {proc.stderr.read()[-3000:]}")
        if _health(base)[0] == 200:
            return proc, base, port
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("serve did not answer /health within 120 s")


def _health(base: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return 0, {}


def _chat(base: str) -> tuple[int, dict]:
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _listeners(pid: int) -> list[int]:
    """The TCP ports process ``pid`` listens on (what `ss -ltnp` shows for it)."""
    return sorted(c.laddr.port for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN)


def _child(pid: int) -> psutil.Process:
    [child] = [c for c in psutil.Process(pid).children() if "fake_llama_server" in " ".join(c.cmdline()) or "llama-server" in " ".join(c.cmdline())]
    return child


def _gone(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.integration
def test_serve_with_a_key_on_an_in_process_llama_cpp_plan_has_one_listener(tmp_path):
    """serve --api-key on a llama.cpp plan (xllamacpp in the process): the one TCP listener is --port;
    llama.cpp's own HTTP front end opens none (it used to answer on a random loopback port, keyless)."""
    _embedded_model()
    proc, base, port = _serve(tmp_path, {"backend": "llama_cpp"})
    try:
        assert _chat(base)[0] == 200
        assert _listeners(proc.pid) == [port]
    finally:
        _stop(proc)


@pytest.mark.integration  # starts serve (~5 s); the watchdog itself: tests/runtimes/test_child_process.py
def test_a_sigkilled_serve_leaves_no_llama_server_child(tmp_path):
    """kill -9 of serve with a llama-server child: no child 3 s later. serve itself listens on --port
    only; the child's loopback port demands a key serve never tells anyone."""
    _embedded_model()
    proc, base, port = _serve(tmp_path, {"backend": "llama_cpp", "path": str(_fake_exe(tmp_path))})
    try:
        child = _child(proc.pid)
        assert _listeners(proc.pid) == [port]
        assert child.environ().get("LLAMA_API_KEY") and child.environ()["LLAMA_API_KEY"] != KEY
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        t = time.monotonic()
        while not _gone(child) and time.monotonic() - t < 3:
            time.sleep(0.02)
        assert _gone(child), "the llama-server child outlived serve's SIGKILL by 3 s"
    finally:
        proc.kill()


@pytest.mark.integration  # starts serve and waits out three restarts (~15 s)
def test_a_dead_child_is_restarted_and_serve_exits_when_it_cannot_be(tmp_path):
    """The child killed: /health is 503 saying so, requests get a short error; it is restarted and
    serves again. Killed while it cannot start: after bounded tries serve exits with status 1."""
    _embedded_model()
    proc, base, _ = _serve(tmp_path, {"backend": "llama_cpp", "path": str(_fake_exe(tmp_path))})
    try:
        child = _child(proc.pid)
        child.kill()
        status, body = _health(base)
        t = time.monotonic()
        while status == 200 and time.monotonic() - t < 3:
            status, body = _health(base)
        assert status == 503 and "llama-server" in body["reason"], body
        code, answer = _chat(base)
        assert code in (500, 503) and "log ends" not in answer["error"]["message"], answer
        while _health(base)[0] != 200 and time.monotonic() - t < 15:
            time.sleep(0.1)
        assert _chat(base)[0] == 200, "no answer after the restart"
        (tmp_path / "broken").touch()
        _child(proc.pid).kill()
        proc.wait(30)  # three tries, 1 + 2 + 4 s apart
        assert proc.returncode == 1
        err = proc.stderr.read()
        assert "cannot serve any more" in err and "did not start again after 3 tries" in err and "broken on purpose" in err
    finally:
        proc.kill()
