"""Cross-check fractal_opt's own load measurement against a client nobody here wrote (the openai package).

Serves one plan with ``fractal-opt serve`` (a subprocess) and drives it with the real ``openai``
client: 8 closed-loop clients, streaming, the same requests and token budgets as the measurement
(``build_items`` of the same workload and load profile). Between HTTP rounds, the same plan is
measured in this process by fractal_opt's one measurement runner (``measure.runner.Runner`` with a
LoadProfile at concurrency 8), interleaved round by round so load from other processes falls on
both alike. Prints, side by side, the aggregate output tokens/s and TTFT p50 / p90 each side saw,
their ratio, and whether they agree within 15% (the cross-check's bar). Both sides have the model loaded
(one process each); only one of them runs at a time.

The HTTP side pays what a real client pays and the in-process side does not: JSON, SSE framing,
a socket, the event loop; TTFT there is from the client's send to its first content chunk.

    python benchmarks/serve_crosscheck.py                 # embedded SmolLM2 on the chatbot workload (~3-5 min on 2 cores)
    python benchmarks/serve_crosscheck.py --tiny          # the random tiny model: a smoke run, ~1 min
    python benchmarks/serve_crosscheck.py --rounds 3 --requests 24

guidellm / `vllm bench serve` are not used: neither installs here quickly (they pin their own
torch / transformers); the openai client is the independent one.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
AGREE = 0.15


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5, check=False).stdout.strip()
    except OSError:
        return "uptime unavailable"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recipe(args: argparse.Namespace, folder: Path) -> Path:
    """The plan under test: continuous batching with 8 in flight (what recipes/chatbot.yaml keeps)."""
    load = {"mode": "closed", "concurrency": args.clients, "requests": args.requests, "output_tokens": [16, 32, 48]}
    if args.tiny:
        sys.path.insert(0, str(ROOT))
        from fractal_opt.testing import tiny_model

        model = str(tiny_model(folder / "tiny", hidden_size=256, layers=4))
        workload = {"suite": "chat", "max_new_tokens": 48, "load": load, "warmup": 1, "repeats": args.rounds}
    else:
        chatbot = yaml.safe_load((ROOT / "recipes" / "chatbot.yaml").read_text(encoding="utf-8"))
        model = chatbot["model"]
        workload = {**chatbot["workload"], "load": load, "warmup": 1, "repeats": args.rounds}
    passes: dict = {"scheduling": [{"batching": {"mode": "continuous"}}, {"concurrency": {"limit": args.clients}}]}
    if args.threads:
        passes["hardware"] = [{"threads": {"count": args.threads}}]
    recipe = {"name": "crosscheck", "model": model, "workload": workload, "passes": passes}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def _http_round(client, items, clients: int) -> dict[str, float]:
    """One closed-loop pass over ``items`` with the openai client; TTFT from send to first content."""
    lock = threading.Lock()
    order = iter(range(len(items)))
    records: list[tuple[float, float | None, float, int]] = []  # (sent, first content, end, completion tokens)
    errors: list[BaseException] = []

    def worker() -> None:
        while True:
            with lock:
                i = next(order, None)
            if i is None:
                return
            item = items[i]
            try:
                sent = time.perf_counter()
                first = None
                tokens = 0
                stream = client.chat.completions.create(model="crosscheck", messages=item.request.as_messages(), max_tokens=item.max_new_tokens,
                                                        stream=True, stream_options={"include_usage": True})
                for chunk in stream:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                    if first is None and chunk.choices and chunk.choices[0].delta.content:
                        first = time.perf_counter()
                records.append((sent, first, time.perf_counter(), tokens))
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(min(clients, len(items)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} HTTP requests failed: {errors[0]!r}")
    wall = max(r[2] for r in records) - min(r[0] for r in records)
    ttfts = sorted((r[1] - r[0]) * 1000 for r in records if r[1] is not None)
    return {"throughput_tokens_per_s": sum(r[3] for r in records) / wall, "ttft_ms_p50": _pct(ttfts, 50), "ttft_ms_p90": _pct(ttfts, 90),
            "output_tokens": sum(r[3] for r in records)}


def _pct(values: list[float], q: float) -> float:
    from fractal_opt.measure.metrics import percentile

    return percentile(values, q)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the random tiny model instead of the embedded SmolLM2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16, help="requests per round")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the plan (both sides); default: torch's own")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import openai

    from fractal_opt.measure.load import build_items
    from fractal_opt.measure.runner import Runner
    from fractal_opt.recipe import load_recipe
    from fractal_opt.runtimes import Engine

    print(f"start: {_uptime()}")
    with tempfile.TemporaryDirectory() as tmp:
        recipe_path = _recipe(args, Path(tmp))
        recipe = load_recipe(recipe_path)
        port = _free_port()
        proc = subprocess.Popen([sys.executable, "-m", "fractal_opt", "serve", str(recipe_path), "--port", str(port), "--log-level", "warning"],
                                cwd=ROOT, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            engine = Engine.from_recipe(recipe, progress=lambda m: None)
            _wait_healthy(port, proc)
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
            requests = recipe.workload.requests()
            items = build_items(requests, recipe.workload.load_profile(), default_tokens=recipe.workload.max_new_tokens)
            runner = Runner(engine, recipe.workload, requests)
            runner.warm_up()
            _http_round(client, items[: args.clients], args.clients)  # warm-up, untimed
            http_rounds = []
            for r in range(args.rounds):
                first_http = r % 2 == 1  # alternate the order: A B, B A
                if first_http:
                    http_rounds.append(_http_round(client, items, args.clients))
                runner.round()
                if not first_http:
                    http_rounds.append(_http_round(client, items, args.clients))
                own = runner.repeats[-1]
                print(f"round {r + 1}: fractal_opt {own['throughput_tokens_per_s']:.1f} tok/s, TTFT p50 {own['ttft_ms_p50']:.0f} ms | "
                      f"openai client {http_rounds[-1]['throughput_tokens_per_s']:.1f} tok/s, TTFT p50 {http_rounds[-1]['ttft_ms_p50']:.0f} ms "
                      f"({http_rounds[-1]['output_tokens']} tokens)")
            own_rows = runner.repeats
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print()
    print(f"{recipe.model}, continuous batching, threads {args.threads or 'default'}, {args.clients} closed-loop streaming clients, {args.requests} requests per round, {args.rounds} rounds (medians)")
    print(f"{'metric':<26}{'openai client':>15}{'fractal_opt':>14}{'ratio':>8}  agree within {AGREE:.0%}?")
    worst = 0.0
    for metric in ("throughput_tokens_per_s", "ttft_ms_p50", "ttft_ms_p90"):
        http = statistics.median(r[metric] for r in http_rounds)
        own = statistics.median(r[metric] for r in own_rows)
        ratio = http / own if own else float("nan")
        worst = max(worst, abs(ratio - 1))
        print(f"{metric:<26}{http:>15.1f}{own:>14.1f}{ratio:>8.2f}  {'yes' if abs(ratio - 1) <= AGREE else 'NO'}")
    print(f"end: {_uptime()}")
    return 0 if worst <= AGREE else 1


def _wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fractal-opt serve exited {proc.returncode}: {proc.stderr.read()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError("fractal-opt serve did not come up")


if __name__ == "__main__":
    sys.exit(main())
