"""Cross-check fractal_opt's own numbers against a client nobody here wrote: guidellm.

Serves one plan with ``fractal-opt serve --ignore-eos`` (a subprocess) and drives it with
guidellm (``pip install 'fractal-opt[crosscheck]'``) at concurrency 1 and 8, with the run's own
prompts (the workload's chat messages, sent as they are) and lengths (every answer its
``max_new_tokens`` cap, guidellm's ``max_completion_tokens`` + ``ignore_eos``). Between the
guidellm rounds the same plan is measured in this process by fractal_opt's one measurement runner
(``measure.runner.Runner``, a closed load of the same concurrency, the same requests, ignore_eos),
interleaved round by round so load from other processes falls on both alike; only one side runs
at a time. Prints TTFT p50, ITL p50 and output tokens/s of each side, their ratio, whether they
agree within 15%, and the load average before and after.

What differs by construction: guidellm pays JSON, SSE framing, a socket and its own event loop, and
takes TTFT from its send to the first content chunk; fractal_opt's runner takes it from submit to
the first token inside the process. Its ITL is over every gap of every request (the mean of a
request's gaps weighs long answers more); both sides here report the median gap.

    python benchmarks/serve_crosscheck.py                       # quickstart's kept llama.cpp plan (~4 min on 2 quiet cores)
    python benchmarks/serve_crosscheck.py fractal-out           # a run folder's tuned recipe
    python benchmarks/serve_crosscheck.py --rounds 3 --requests 8

guidellm does not stream usage in every chunk from this server (``continuous_usage_stats`` is not
offered: the script sends it false); it counts tokens from the final usage chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
AGREE = 0.15
METRICS = (("ttft_ms_p50", "TTFT p50 ms"), ("itl_ms_p50", "ITL p50 ms"), ("throughput_tokens_per_s", "output tok/s"))
# The quickstart's kept plan in a quiet `make demo` run (Intel Xeon, 2 cores, 2026-12-03): llama.cpp on
# the embedded GGUF widened to BF16 (the Q4_1 kernels lost eval questions), continuous batching; its
# workload's prompts, every answer its 32-token cap.
QUICKSTART_PLAN = {"hardware": [{"runtime": {"backend": "llama_cpp", "dtype": "bfloat16"}}], "scheduling": [{"batching": {"mode": "continuous"}}]}


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5, check=False).stdout.strip()
    except OSError:
        return "uptime unavailable"


def _recipe(source: str | None, folder: Path, clients: int, requests: int) -> Path:
    """The plan under test, with the run's workload under a closed load of ``clients``, fixed lengths."""
    if source:
        sys.path.insert(0, str(ROOT))
        from fractal_opt.runtimes import recipe_source

        data = yaml.safe_load(Path(recipe_source(source)).read_text(encoding="utf-8"))
    else:
        data = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text(encoding="utf-8"))
        data["passes"] = QUICKSTART_PLAN
    workload = {k: v for k, v in data["workload"].items() if k not in ("load", "max_repeats")}
    workload.update(load={"mode": "closed", "concurrency": clients, "requests": requests, "ignore_eos": True}, warmup=1, repeats=1)
    recipe = {"name": "crosscheck", "model": data["model"], "workload": workload, "passes": data.get("passes") or {}}
    path = folder / f"recipe-c{clients}.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def _guidellm(port: int, rows: list[dict], tokenizer: str, clients: int, requests: int, folder: Path) -> dict[str, float]:
    """One guidellm benchmark (concurrent, ``clients`` streams, ``requests`` requests); its medians and aggregate output tokens/s."""
    out = folder / f"guidellm-c{clients}-{time.monotonic_ns()}.json"
    spec = {"backend": {"kind": "openai_http", "target": f"http://127.0.0.1:{port}", "model": "crosscheck", "request_format": "/v1/chat/completions",
                        "extras": {"body": {"stream_options": {"continuous_usage_stats": False}}}},
            "profile": {"kind": "concurrent", "streams": [clients]}, "constraints": [{"kind": "max_requests", "count": requests}],
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer}, "data": [{"kind": "in_memory_dict_list", "data": rows}],
            "outputs": [{"kind": "json", "path": str(out)}]}
    scenario = folder / "scenario.json"
    scenario.write_text(json.dumps({"metadata": {"name": "crosscheck", "description": "fractal-opt serve"}, "spec": spec}), encoding="utf-8")
    exe = Path(sys.executable).parent / "guidellm"
    done = subprocess.run([str(exe), "run", "-c", str(scenario), "--disable-console"], capture_output=True, text=True, timeout=1800, check=False,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"guidellm exited {done.returncode}: {(done.stderr or done.stdout)[-2000:]}")
    bench = json.loads(out.read_text())["benchmarks"][0]
    m = bench["metrics"]
    errored = len(bench["requests"].get("errored") or [])
    if errored:
        raise RuntimeError(f"guidellm: {errored} requests failed: {bench['requests']['errored'][0].get('error')}")
    tokens = m["output_token_count"]["successful"]["total_sum"]
    return {"ttft_ms_p50": m["time_to_first_token_ms"]["successful"]["median"], "itl_ms_p50": m["inter_token_latency_ms"]["successful"]["median"],
            "throughput_tokens_per_s": tokens / bench["duration"], "output_tokens": tokens}


def _serve(recipe: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "fractal_opt", "serve", str(recipe), "--port", str(port), "--ignore-eos", "--log-level", "warning"],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fractal-opt serve exited {proc.returncode}: {proc.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("fractal-opt serve did not come up")


def _level(args: argparse.Namespace, clients: int, folder: Path) -> tuple[list[dict], list[dict]]:
    """Interleaved rounds at one concurrency: (guidellm's rows, fractal_opt's rows)."""
    from fractal_opt.export.common import served_folder
    from fractal_opt.language.recipe import load_recipe
    from fractal_opt.measure.runner import Runner
    from fractal_opt.runtimes import Engine
    from fractal_opt.runtimes.child_process import free_port
    from fractal_opt.weights.models import resolve

    path = _recipe(args.source, folder, clients, args.requests)
    recipe = load_recipe(path)
    requests = recipe.workload.requests()
    rows = [{"messages": r.as_messages(), "output_tokens_count": recipe.plan().application.max_new_tokens or recipe.workload.max_new_tokens}
            for r in requests]
    rows = (rows * (args.requests // len(rows) + 1))[: args.requests]
    tokenizer, _ = served_folder(str(resolve(recipe.model).path))
    port = free_port()
    proc = _serve(path, port)
    theirs, ours = [], []
    try:
        engine = Engine.from_recipe(recipe, progress=lambda m: None)
        try:
            runner = Runner(engine, recipe.workload, requests)
            runner.warm_up()
            _guidellm(port, rows, tokenizer, clients, clients, folder)  # warm-up, untimed
            for r in range(args.rounds):
                if r % 2:  # alternate the order: A B, B A
                    theirs.append(_guidellm(port, rows, tokenizer, clients, args.requests, folder))
                runner.round()
                if not r % 2:
                    theirs.append(_guidellm(port, rows, tokenizer, clients, args.requests, folder))
                ours.append(runner.repeats[-1])
                print(f"c={clients} round {r + 1}: " + ", ".join(f"{name} guidellm {theirs[-1][k]:.1f} / fractal_opt {ours[-1][k]:.1f}" for k, name in METRICS),
                      flush=True)
        finally:
            engine.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return theirs, ours


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", default=None, help="a run folder or recipe (default: the quickstart's kept llama.cpp plan)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8, help="requests per round and side")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    print(f"start: {_uptime()}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for c in args.concurrency:
            results[c] = _level(args, c, Path(tmp))
    print(f"\n{args.source or 'quickstart kept plan (llama.cpp on BF16, continuous batching)'}; every answer its cap (ignore_eos); {args.requests} requests a round, "
          f"{args.rounds} rounds interleaved (medians of rounds)")
    print(f"{'concurrency':<12}{'metric':<16}{'guidellm':>10}{'fractal_opt':>13}{'ratio':>8}  within {AGREE:.0%}?")
    worst = 0.0
    for c, (theirs, ours) in results.items():
        for key, name in METRICS:
            a, b = statistics.median(r[key] for r in theirs), statistics.median(r[key] for r in ours)
            ratio = a / b if b else float("nan")
            worst = max(worst, abs(ratio - 1))
            print(f"{c:<12}{name:<16}{a:>10.1f}{b:>13.1f}{ratio:>8.2f}  {'yes' if abs(ratio - 1) <= AGREE else 'NO'}")
    print(f"end: {_uptime()}")
    return 0 if worst <= AGREE else 1


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    sys.exit(main())
