"""The llama_cpp runtime's second transport: a llama-server child process (hardware.runtime_path).

Contract tests run a stand-in executable (fake_llama_server.py) everywhere; the end-to-end test
runs the llama-server that ``make setup-llama-native`` builds, and skips with its reason when it
has not been built.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from fractal_opt.core.errors import ModelSourceError, RecipeError, RequestRejected
from fractal_opt.runtimes.llama_cpp import engine as llama_engine
from fractal_opt.runtimes.llama_cpp.process import NATIVE, command, cpu_tag, executable_problem, native_executable
from fractal_opt.runtimes.llama_cpp.settings import refusals, server_settings
from fractal_opt.tower.plan import HardwarePlan, ModelPlan, Plan, SchedulingPlan
from fractal_opt.workloads.workload import Workload

MODEL = "smollm2-135m-instruct"
FAKE = Path(__file__).with_name("fake_llama_server.py")


def _model_path() -> str:
    try:
        from fractal_opt.weights.models import resolve

        return str(resolve(MODEL).path)
    except ModelSourceError as e:
        pytest.skip(f"embedded model not installed: {e}")


@pytest.fixture(autouse=True)
def _no_resident_server():
    llama_engine.clear_cache()
    yield
    llama_engine.clear_cache()


@pytest.fixture
def fake_exe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An executable llama-server stand-in; it records its arguments in tmp_path/args.json."""
    exe = tmp_path / "llama-server"
    exe.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("FAKE_LLAMA_ARGS", str(tmp_path / "args.json"))
    return exe


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (ended, not yet reaped) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_command_carries_every_load_time_setting() -> None:
    """Slots, context, unified pool, KV type, flash attention, threads, batch sizes and the prompt
    cache become llama-server's own flags."""
    plan = Plan(source="m.gguf", hardware=HardwarePlan(runtime="llama_cpp", threads=2, flash_attention="on", n_batch=512, n_ubatch=256),
                model=ModelPlan(kv_cache="quantized", kv_bits=8, context_cap=1024), scheduling=SchedulingPlan(batching="continuous", max_concurrency=4))
    cmd = command("/x/llama-server", server_settings(plan, "m.gguf"), 8080)
    flags = {a: b for a, b in zip(cmd, cmd[1:]) if a.startswith("--") and not b.startswith("--")}
    assert cmd[0] == "/x/llama-server"
    assert {k: flags[k] for k in ("--model", "--port", "--parallel", "--ctx-size", "--cache-type-k", "--cache-type-v", "--flash-attn", "--threads",
                                   "--threads-batch", "--batch-size", "--ubatch-size")} == {
        "--model": "m.gguf", "--port": "8080", "--parallel": "4", "--ctx-size": "4096", "--cache-type-k": "q8_0", "--cache-type-v": "q8_0",
        "--flash-attn": "on", "--threads": "2", "--threads-batch": "2", "--batch-size": "512", "--ubatch-size": "256"}
    assert "--no-kv-unified" in cmd and "--no-cache-prompt" in cmd  # a context cap gives each slot its own; no prefix reuse unless asked
    shared = command("llama-server", server_settings(Plan(source="m.gguf", hardware=HardwarePlan(runtime="llama_cpp"),
                                                           scheduling=SchedulingPlan(prefix_cache=True)), "m.gguf"), 1)
    assert "--kv-unified" in shared and "--cache-prompt" in shared and "--threads" not in shared


def test_a_missing_executable_is_refused_with_the_build_command(tmp_path: Path) -> None:
    """runtime_path to nothing (or native before it is built) is refused before any load, naming the make target."""
    plan = Plan(source="m.gguf", hardware=HardwarePlan(runtime="llama_cpp", runtime_path=str(tmp_path / "nope")))
    reasons = refusals(plan)
    assert any("hardware.runtime_path" in r and "make setup-llama-native" in r for r in reasons)
    if not native_executable().is_file():
        assert "make setup-llama-native" in (executable_problem(NATIVE) or "")
    url = Plan(source="m.gguf", hardware=HardwarePlan(runtime="llama_cpp", runtime_url="http://127.0.0.1:1"))
    assert any(r.startswith("hardware.runtime_url=") for r in refusals(url))


def test_the_native_build_is_kept_per_cpu_instruction_set() -> None:
    """Two CPUs that differ in an instruction-set flag get different build paths; flags that do not
    change the code (vulnerabilities, hypervisor) and their order do not."""
    avx2 = ["fpu", "sse", "sse2", "avx", "avx2", "fma", "hypervisor", "spectre_v1"]
    avx512 = [*avx2, "avx512f", "avx512_bf16"]
    same = ["hypervisor", "fma", "avx2", "avx", "sse2", "sse", "fpu", "rdtscp"]
    assert cpu_tag(avx2) != cpu_tag(avx512)
    assert cpu_tag(avx2) == cpu_tag(same)
    assert native_executable().parent.name == cpu_tag()


def test_the_runtime_pass_takes_a_path_for_llama_cpp_and_not_for_transformers() -> None:
    from fractal_opt.layers.hardware import Runtime

    plan = Runtime(backend="llama_cpp", path=NATIVE).apply(Plan(source="m.gguf"))
    assert (plan.hardware.runtime, plan.hardware.runtime_path) == ("llama_cpp", NATIVE)
    with pytest.raises(RecipeError, match="'path' applies to backends"):
        Runtime(backend="transformers", path="/x")
    with pytest.raises(RecipeError, match=r"applies to backends \['vllm'\] only"):
        Runtime(backend="llama_cpp", url="http://127.0.0.1:1")


def test_a_16_bit_dtype_is_a_widened_copy_and_a_gguf_quantization_replaces_it() -> None:
    """dtype bfloat16 is accepted on llama_cpp (the GGUF widened to BF16); the quantize pass's gguf
    backend on top names the file's one weight type (the ladder's next rung after BF16)."""
    from fractal_opt.runtimes.llama_cpp.model_file import weight_type
    from fractal_opt.weights.models import ModelSource

    bf16 = Plan(source="m.gguf", hardware=HardwarePlan(runtime="llama_cpp", dtype="bfloat16"))
    assert not [r for r in refusals(bf16) if "hardware.dtype" in r]
    both = bf16.replace_section("model", weight_bits=8, quant_backend="gguf", quant_method="q8_0")
    assert not [r for r in refusals(both) if "hardware.dtype" in r]
    gguf = ModelSource("m.gguf", "gguf", Path("m.gguf"))
    assert (weight_type(bf16, gguf), weight_type(both, gguf)) == ("BF16", "Q8_0")


def test_the_engine_serves_through_a_child_process(fake_exe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Built with runtime_path, the engine starts the executable with the plan's flags, sends the
    prompt as the token ids it rendered, streams every token with its id and a clock reading, reports
    the child's pid, answers top-k log-probabilities, turns llama-server's context refusal into
    RequestRejected, and stops the child when evicted."""
    _model_path()
    monkeypatch.setenv("FAKE_LLAMA_PROMPTS", str(tmp_path / "prompts.jsonl"))
    monkeypatch.setenv("FAKE_LLAMA_CONTEXT", "300")
    plan = Plan(source=MODEL, hardware=HardwarePlan(runtime="llama_cpp", threads=1, runtime_path=str(fake_exe)))
    engine = llama_engine.LlamaCppEngine.build(plan, progress=lambda _: None, max_new_tokens=5)
    args = json.loads((tmp_path / "args.json").read_text())
    assert args[args.index("--threads") + 1] == "1" and args[args.index("--parallel") + 1] == "1"
    [pid] = engine.server_pids()
    assert _alive(pid)
    [request] = Workload(suite="default", max_new_tokens=5).requests()[:1]
    [gen] = engine.serve([request], max_new_tokens=5)
    sent = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert sent[-1] == engine.prompt_ids(request) and gen.prompt_tokens == len(sent[-1])
    assert gen.text == " w0 w1 w2 w3 w4" and gen.token_ids == [100, 101, 102, 103, 104]
    assert gen.token_times == sorted(gen.token_times) and gen.hit_cap
    assert engine.top_logprobs([1, 2], k=3) == [{100: -0.5, 101: -1.0, 102: -1.5}] * 2
    from fractal_opt.workloads.workload import Request

    with pytest.raises(RequestRejected, match="context"):
        engine.serve([Request(id="long", messages=(("user", "word " * 400),))], max_new_tokens=5)
    llama_engine.evict_except(set())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid), "the evicted llama-server child still runs"


def test_a_child_that_exits_at_start_raises_with_its_log(tmp_path: Path) -> None:
    """An executable that dies while loading gives an EngineError quoting its last output."""
    from fractal_opt.core.errors import EngineError

    _model_path()
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\necho 'error: unknown argument: --bogus' >&2\nexit 3\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    plan = Plan(source=MODEL, hardware=HardwarePlan(runtime="llama_cpp", threads=1, runtime_path=str(exe)))
    with pytest.raises(EngineError, match="(?s)status 3.*unknown argument"):
        llama_engine.LlamaCppEngine.build(plan, progress=lambda _: None)


@pytest.mark.parametrize("marker", ["midway", "torn"])
def test_a_child_that_dies_mid_stream_raises_with_its_log(fake_exe: Path, marker: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A llama-server that crashes while streaming (the connection closed early, or cut inside a
    chunk) gives an EngineError with its exit status and last log lines, not a socket error or a
    silently short answer."""
    from fractal_opt.core.errors import EngineError
    from fractal_opt.workloads.workload import Request

    _model_path()
    monkeypatch.setenv("FAKE_LLAMA_DIE", marker)
    plan = Plan(source=MODEL, hardware=HardwarePlan(runtime="llama_cpp", threads=1, runtime_path=str(fake_exe)))
    engine = llama_engine.LlamaCppEngine.build(plan, progress=lambda _: None, max_new_tokens=5)
    with pytest.raises(EngineError, match="(?s)status 7.*simulated crash"):
        engine.serve([Request(id="crash", messages=(("user", "Hello"),))], max_new_tokens=5)


def test_the_native_build_serves_the_embedded_model_and_is_measured_with_its_memory() -> None:
    """The llama-server built for this CPU answers greedy requests, and a measured round counts the
    child's memory (it holds the model) and CPU time."""
    if (problem := executable_problem(NATIVE)) is not None:
        pytest.skip(problem)
    _model_path()
    from fractal_opt.measure.runner import measure

    plan = Plan(source=MODEL, hardware=HardwarePlan(runtime="llama_cpp", threads=1, runtime_path=NATIVE))
    engine = llama_engine.LlamaCppEngine.build(plan, progress=lambda _: None, max_new_tokens=8)
    assert engine.generate("What is the capital of France?").strip()
    m = measure(engine, Workload(suite="default", limit=1, max_new_tokens=8, repeats=1, warmup=0))
    assert m.repeats[0]["peak_memory_mb"] > 60  # this process plus the child that holds the ~100 MB model
    assert m.repeats[0]["cpu_utilization"] > 0.2  # the child's CPU time counts
    assert 0 < m.samples[0].new_tokens <= 8
