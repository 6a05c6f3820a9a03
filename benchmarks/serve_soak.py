"""Soak `fractal-opt serve`: many concurrent clients for minutes, a third of them hanging up at random,
some of them hostile.

Starts ``fractal-opt serve RUN_DIR`` as a user would (a subprocess, the real CLI), then runs
``--clients`` clients for ``--duration-s``: each sends chat requests one after another, streamed or
not (half each), and a ``--hangup`` share of them close the connection at a random moment
(0-1 s after sending). A 429 (full queue) is retried after its Retry-After. A ``--hostile`` share of
the clients send requests of the hostile corpus instead (fractal_opt.serving.hostile_requests:
answer lengths and seeds out of range, prompts far over the context, malformed JSON, huge heads
and bodies, smuggling), one after another, each drawn at random. Afterwards it checks:

- no hostile request got a 5xx or a status its case does not allow, and each refused one was
  answered within 10 s (plus the body / header timeout it waits for, which serve gets as 5 s here;
  the few that are valid HTTP queue like any request, or get 429 from a full queue);
- every request ends exactly once: the server's own count (``fractal_opt_requests_total`` over
  every status but the refusals of bad requests: done, cancelled, timeout, error, overloaded)
  equals the normal requests the clients sent plus the hostile ones answered 200 (a few are valid
  HTTP after all), and the server holds none (/health: nothing queued or live);
- the server's memory (RSS of serve and its children) and open file descriptors level off: the
  last third of the run's samples peaks within 5% (+5 MB) and 10 descriptors of the middle third;
- end-to-end latency p50 / p99 of the answered requests, and time to first token of the streamed ones.

The clients speak HTTP/1.1 over asyncio streams (no client library: one process holds hundreds
of connections cheaply, and a hang-up is a plain close).

Usage:
    fractal-opt run recipe.yaml --out /tmp/soak-run         # a tuned plan (e.g. the llama.cpp runtime)
    flock /tmp/fractal-bench.lock .venv/bin/python benchmarks/serve_soak.py /tmp/soak-run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil

from fractal_opt.serving import hostile_requests as hostile

ROOT = Path(__file__).resolve().parents[1]
HOSTILE_WAIT_S = 5.0  # serve's --body-timeout-s and --header-timeout-s in a soak with hostile clients
PROMPTS = ["Name three colours of the rainbow.", "What is the capital of France?", "Write one sentence about the sea.",
           "Give me a synonym for happy.", "What is 12 times 12?", "Say hello in Spanish."]


@dataclass
class Record:
    stream: bool
    hangup: bool
    start: float
    end: float = 0.0
    first: float | None = None  # the first content chunk (streamed)
    status: int = 0  # HTTP status; 0 when the client hung up before the status line
    outcome: str = ""  # answered | hung_up | refused | error
    case: hostile.Hostile | None = None  # a hostile client's request
    problem: str | None = None  # what was wrong with a hostile request's answer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="a run folder (fractal-opt run --out) or a recipe, served with fractal-opt serve")
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--hangup", type=float, default=1 / 3, help="share of clients that hang up at random (default a third)")
    p.add_argument("--hostile", type=float, default=0.1, help="share of clients that send the hostile corpus instead (default a tenth)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    port = _free_port()
    load_before = os.getloadavg()
    waits = ["--body-timeout-s", str(HOSTILE_WAIT_S), "--header-timeout-s", str(HOSTILE_WAIT_S)] if args.hostile else []
    serve = subprocess.Popen([sys.executable, "-m", "fractal_opt", "serve", args.run, "--port", str(port), "--log-level", "warning",
                              "--max-connections", str(4 * args.clients), *waits], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        health = _wait_ready(base, serve)
        cases = hostile.corpus(context=health.get("context_tokens") or 4096)
        samples: list[tuple[float, float, int]] = []
        records = asyncio.run(_soak(port, args, rng, serve.pid, samples, cases))
        drained = _drain(base)
        counted = _server_count(base)
    finally:
        serve.terminate()
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
    _report(args, records, samples, drained, counted, load_before, os.getloadavg())
    return 0


async def _soak(port: int, args: argparse.Namespace, rng: random.Random, pid: int, samples: list, cases: list[hostile.Hostile]) -> list[Record]:
    records: list[Record] = []
    end = time.perf_counter() + args.duration_s
    hostiles = set(rng.sample(range(args.clients), round(args.clients * args.hostile)))
    hangers = set(rng.sample(sorted(set(range(args.clients)) - hostiles), round(args.clients * args.hangup)))
    clients = [asyncio.create_task(_hostile_client(port, end, random.Random(args.seed * 1000 + i), cases, records) if i in hostiles else
                                   _client(i, port, end, i in hangers, random.Random(args.seed * 1000 + i), args.max_tokens, records))
               for i in range(args.clients)]
    sampler = asyncio.create_task(_sample(pid, end, samples))
    await asyncio.gather(*clients)
    await sampler
    return records


async def _client(i: int, port: int, end: float, hangs: bool, rng: random.Random, max_tokens: int, records: list[Record]) -> None:
    await asyncio.sleep(rng.uniform(0, 2.0))  # the clients arrive over two seconds, not in one burst
    while time.perf_counter() < end:
        stream = rng.random() < 0.5
        hangup_s = rng.uniform(0.0, 1.0) if hangs and rng.random() < 0.5 else None
        body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": max_tokens, "stream": stream}
        record = Record(stream=stream, hangup=hangup_s is not None, start=time.perf_counter())
        records.append(record)
        retry = await _request(port, body, record, hangup_s)
        if retry:
            await asyncio.sleep(retry)


async def _hostile_client(port: int, end: float, rng: random.Random, cases: list[hostile.Hostile], records: list[Record]) -> None:
    """Send hostile requests one after another, each a case drawn at random, and judge each answer."""
    await asyncio.sleep(rng.uniform(0, 2.0))
    while time.perf_counter() < end:
        case = rng.choice(cases)
        record = Record(stream=False, hangup=False, start=time.perf_counter(), case=case)
        records.append(record)
        limit_s = 10.0 + (HOSTILE_WAIT_S if case.waits_for else 0.0)
        data, writer, sent = b"", None, time.perf_counter()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(case.raw)
            await writer.drain()
            sent = time.perf_counter()
            wait_s = None if 200 in case.allowed else limit_s + 5  # valid HTTP after all: it waits in the queue like any request
            while not hostile.answer_complete(data) and (chunk := await asyncio.wait_for(reader.read(65536), wait_s)):
                data += chunk
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass  # a server that answered (or closed) before reading it all may reset; the answer so far is judged
        finally:
            record.end = time.perf_counter()
            if writer is not None:
                writer.close()
        outcome = hostile.outcome_of(data, record.end - sent)
        record.status, record.outcome = outcome.status, "hostile"
        if 200 in case.allowed and outcome.status in (200, 429):
            continue  # valid HTTP after all: queued (or turned away by a full queue) like any request, its time the queue's
        record.problem = hostile.problem(case, outcome, limit_s=limit_s)


async def _request(port: int, body: dict, record: Record, hangup_s: float | None) -> float:
    """One request; returns the seconds to wait before the next (a 429's Retry-After, else 0)."""
    payload = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            "Connection: close\r\n\r\n").encode()
    writer = None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head + payload)
        await writer.drain()
        read = _read_all(reader, record)
        if hangup_s is None:
            await read
        else:
            try:
                await asyncio.wait_for(read, hangup_s)
            except TimeoutError:
                record.outcome = "hung_up"
    except (OSError, asyncio.IncompleteReadError) as e:
        record.outcome = record.outcome or f"error: {type(e).__name__}"
    finally:
        record.end = time.perf_counter()
        if writer is not None:
            writer.close()
    if not record.outcome:
        record.outcome = "answered" if record.status == 200 else "refused"
    return 1.0 if record.status == 429 else 0.0


async def _read_all(reader: asyncio.StreamReader, record: Record) -> None:
    status = await reader.readline()
    record.status = int(status.split()[1]) if status else 0
    data = b""
    while chunk := await reader.read(65536):
        if record.stream and record.first is None and b'"content": "' in chunk and b'"content": ""' not in chunk:
            record.first = time.perf_counter()
        data += chunk
    if record.status == 200 and record.stream and b"[DONE]" not in data:
        record.outcome = "error: stream without [DONE]"


async def _sample(pid: int, end: float, samples: list) -> None:
    """(seconds, RSS MB of serve and its children, open fds of serve) every 5 s."""
    start = time.perf_counter()
    proc = psutil.Process(pid)
    while time.perf_counter() < end:
        procs = [proc, *proc.children(recursive=True)]
        rss = sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20
        samples.append((time.perf_counter() - start, rss, proc.num_fds()))
        await asyncio.sleep(5.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait_ready(base: str, serve: subprocess.Popen) -> dict:
    """/health once it answers 200 (its body: the context it reports, among others)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            raise SystemExit(f"serve exited {serve.returncode}: {serve.stderr.read()[-2000:]}")
        try:
            status, body = _get(base + "/health")
            if status == 200:
                return json.loads(body)
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("serve did not come up within 300 s")


def _drain(base: str) -> dict:
    """/health once nothing is queued or live (or after 60 s)."""
    deadline = time.monotonic() + 60
    while True:
        health = json.loads(_get(base + "/health")[1])
        if (health["queued"] == 0 and health["live"] == 0) or time.monotonic() > deadline:
            return health
        time.sleep(0.5)


def _server_count(base: str) -> dict[str, float]:
    """``fractal_opt_requests_total`` by status (a refused request by its reason: bad_request, overloaded, ...)."""
    text = _get(base + "/metrics")[1].decode()
    out: dict[str, float] = {}
    for status, value in re.findall(r'^fractal_opt_requests_total\{endpoint="[^"]*",status="([^"]*)"\} (\S+)$', text, re.M):
        out[status] = out.get(status, 0.0) + float(value)
    return out


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else (values[0] if values else float("nan"))


def _report(args, records: list[Record], samples: list, drained: dict, counted: dict, before: tuple, after: tuple) -> None:
    normal = [r for r in records if r.case is None]
    hostiles = [r for r in records if r.case is not None]
    outcomes: dict[str, int] = {}
    for r in normal:
        key = r.outcome if r.outcome != "refused" else f"refused {r.status}"
        outcomes[key] = outcomes.get(key, 0) + 1
    answered = [r for r in normal if r.outcome == "answered"]
    e2e = [r.end - r.start for r in answered]
    ttft = [r.first - r.start for r in answered if r.stream and r.first is not None]
    third = max(1, len(samples) // 3)
    middle, last = samples[third : 2 * third] or samples, samples[2 * third :] or samples
    rss_mid, rss_last = max(s[1] for s in middle), max(s[1] for s in last)
    fd_mid, fd_last = max(s[2] for s in middle), max(s[2] for s in last)
    # Bad requests refused by the app are counted as bad_request, those refused by the HTTP layer (431, h11's 400) not at all:
    # the exactly-once check is over the rest, which normal requests and hostile ones answered 200 make.
    total = sum(v for k, v in counted.items() if k != "bad_request")
    expected = len(normal) + sum(1 for r in hostiles if r.status == 200)
    print(f"fractal-opt serve soak: {args.clients} clients ({round(args.clients * args.hostile)} hostile, "
          f"{round(args.clients * args.hangup)} hanging up at random), {args.duration_s:.0f} s, max_tokens {args.max_tokens}, half streamed; served {args.run}")
    print(f"load average before {before[0]:.2f} {before[1]:.2f} {before[2]:.2f}, after {after[0]:.2f} {after[1]:.2f} {after[2]:.2f}")
    print(f"normal requests sent: {len(normal)}; by outcome: {dict(sorted(outcomes.items()))}")
    print(f"server's count: {sum(counted.values()):.0f} ({dict(sorted(counted.items()))}); after the run: queued {drained['queued']}, live {drained['live']}")
    print(f"every request ended exactly once: {'yes' if total == expected and drained['queued'] == drained['live'] == 0 else 'NO'} "
          f"({total:.0f} counted but bad requests, {expected} expected)")
    print(f"answered: {len(answered)}; end-to-end p50 {_pct(e2e, 50):.3f} s, p99 {_pct(e2e, 99):.3f} s; "
          f"streamed TTFT p50 {_pct(ttft, 50):.3f} s, p99 {_pct(ttft, 99):.3f} s")
    if hostiles:
        statuses: dict[int, int] = {}
        for r in hostiles:
            statuses[r.status] = statuses.get(r.status, 0) + 1
        problems = [r.problem for r in hostiles if r.problem]
        refused = [r for r in hostiles if r.status != 200 and not r.case.waits_for] or hostiles
        slowest = max(refused, key=lambda r: r.end - r.start)
        print(f"hostile requests sent: {len(hostiles)} ({len({r.case.name for r in hostiles})} of the corpus's {len(hostile.corpus())} kinds); "
              f"by status (0: closed without one): {dict(sorted(statuses.items()))}; the slowest refused at once took "
              f"{slowest.end - slowest.start:.2f} s ({slowest.case.name})")
        print(f"no 5xx, every hostile request answered as its case allows and in time: {'yes' if not problems else 'NO'}")
        for text in sorted(set(problems))[:10]:
            print(f"  {text}")
    print(f"RSS MB (serve + children) every 5 s: {[round(s[1]) for s in samples]}")
    print(f"open fds every 5 s: {[s[2] for s in samples]}")
    level = rss_last <= rss_mid * 1.05 + 5 and fd_last <= fd_mid + 10
    print(f"level off (last third vs middle third): RSS {rss_mid:.0f} -> {rss_last:.0f} MB, fds {fd_mid} -> {fd_last}: {'yes' if level else 'NO'}")


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    sys.exit(main())
