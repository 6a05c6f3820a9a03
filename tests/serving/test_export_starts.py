"""Every export target's command starts on the versions installed here and answers a request.

Each test exports the embedded SmolLM2's plan, starts the printed command as printed (only the
executable is located: the venv's ``transformers``, a built ``llama-server``, ``.venv-vllm``'s
``vllm``), waits for its health endpoint and sends one chat request. A server that is not
installed skips with the reason. These start real servers on the real model: integration.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fractal_opt.export import export
from fractal_opt.runtimes.child_process import free_port
from fractal_opt.tower.plan import Plan
from fractal_opt.weights.models import resolve

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
_START_S = 300  # transformers serve loads the float32 folder in ~12 s, vllm's CPU build in ~80 s; a busy 2-core machine takes longer


def _gguf() -> str:
    try:
        return str(resolve(MODEL).path)
    except Exception as e:  # noqa: BLE001 (the embedded wheel missing: say so)
        pytest.skip(f"the embedded model is not installed: {e}")


def _started(cmd: list[str], env: dict[str, str], port: int, health: str = "/health"):
    """Start ``cmd`` in its own process group; return it once ``health`` answers 200."""
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"fractal-opt-export-{port}.log", "w+b")  # noqa: SIM115 (closed by _stop)
    proc = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.log = log  # type: ignore[attr-defined]
    deadline = time.monotonic() + _START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"{cmd[0]} exited {proc.returncode} before serving: {log.read()[-3000:].decode(errors='replace')}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{health}", timeout=2) as r:
                if r.status == 200:
                    return proc
        except (OSError, urllib.error.URLError):
            time.sleep(0.5)
    _stop(proc)
    pytest.fail(f"{cmd[0]} did not answer {health} within {_START_S} s")


def _stop(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.log.close()


def _chat(port: int, request: dict, **extra) -> dict:
    body = {**request, "messages": QUESTION, "stream": False, **extra}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _answer(cmd: list[str], env: dict[str, str], request: dict, port: int, **extra) -> dict:
    proc = _started(cmd, env, port)
    try:
        return _chat(port, request, **extra)
    finally:
        _stop(proc)


def _venv_tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip(f"{name} is not installed in this environment ({Path(sys.executable).parent})")
    return path


def test_the_transformers_serve_export_starts_on_the_converted_folder_and_answers():
    """`transformers serve` as exported (the GGUF's safetensors folder, not the .gguf) starts on transformers 5.x and answers Paris."""
    port = free_port()
    out = export(Plan(source=MODEL), "transformers-serve", model_path=_gguf(), port=port, threads=2)
    assert out.command[2] != _gguf() and Path(out.command[2], "tokenizer.json").is_file()
    reply = _answer([_venv_tool("transformers"), *out.command[1:]], out.env, out.request, port, max_tokens=12)
    assert "paris" in reply["choices"][0]["message"]["content"].lower(), reply


def test_the_transformers_serve_export_carries_the_plans_token_cap_in_the_request():
    """A plan's cap of 3 reaches transformers serve as the exported request's max_tokens (its generation_config cap under 1024 is raised to 1024)."""
    port = free_port()
    plan = Plan(source=MODEL).replace_section("application", max_new_tokens=3)
    out = export(plan, "transformers-serve", model_path=_gguf(), port=port)
    assert out.request["max_tokens"] == 3
    reply = _answer([_venv_tool("transformers"), *out.command[1:]], out.env, out.request, port)
    assert reply["usage"]["completion_tokens"] == 3 and reply["choices"][0]["finish_reason"] == "length", reply


def _llama_server() -> str:
    from fractal_opt.runtimes.llama_cpp.process import native_executable

    found = shutil.which("llama-server") or (str(native_executable()) if native_executable().is_file() else None)
    if found is None:
        pytest.skip(f"no llama-server built here (not on PATH, not at {native_executable()}): make setup-llama-native builds one")
    return found


def test_the_llama_server_export_starts_with_its_thread_count_and_answers():
    """llama-server as exported (the GGUF, --threads / --threads-batch of the measured plan) starts and answers Paris."""
    exe = _llama_server()
    port = free_port()
    out = export(Plan(source=MODEL).replace_section("hardware", runtime="llama_cpp"), "llama-server", model_path=_gguf(), port=port, threads=2)
    flags = dict(zip(out.command, out.command[1:]))
    assert flags["--model"] == _gguf() and flags["--threads"] == "2" and flags["--threads-batch"] == "2"
    reply = _answer([exe, *out.command[1:]], out.env, out.request, port, max_tokens=12)
    assert "paris" in reply["choices"][0]["message"]["content"].lower(), reply


def test_the_vllm_export_starts_in_the_vllm_environment_and_answers():
    """`vllm serve` as exported (the converted folder and its --tokenizer) starts from .venv-vllm and answers."""
    exe = Path(os.environ.get("FRACTAL_OPT_VLLM") or ROOT / ".venv-vllm" / "bin" / "vllm")
    if not exe.is_file():
        pytest.skip(f"no vLLM environment ({exe} is missing): make setup-vllm makes .venv-vllm")
    port = free_port()
    out = export(Plan(source=MODEL).replace_section("hardware", runtime="vllm", threads="auto"), "vllm", model_path=_gguf(), port=port, threads=2)
    assert "--tokenizer" in out.command
    reply = _answer([str(exe), *out.command[1:]], out.env, out.request, port, max_tokens=12)
    # Started and answered: the text itself is not checked here, because vLLM's CPU build computes
    # in its own dtype (bf16 by default on CPU), so its greedy words may differ from float32's.
    assert reply["choices"][0]["message"]["content"].strip(), reply
