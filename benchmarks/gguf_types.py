"""Which ggml weight type does this llama.cpp build run fastest? The embedded GGUF (Q4_1) against its
copies re-quantized by the quantize pass's gguf backend (Q4_0, Q8_0, or widened to BF16 / F16), driven by hand
through xllamacpp in this process, or through a llama-server child process (``--transports native``: the
build ``make setup-llama-native`` makes for this CPU).

Two measurements per file, each after one untimed warm-up pass, with one llama.cpp server loaded at
a time (two in one process throttle each other, docs/runtimes.md), flash attention on, no prompt
cache (every TTFT is a full prefill), greedy:

1. **One request at a time**: the default suite's first four prompts (3 short, 1 long; the
   quickstart's), output budgets 16 / 32 / 48 in turn: prefill tokens/s and decode tokens/s as
   llama.cpp's own timings report them (``prompt_n / prompt_ms``, ``predicted_n / predicted_ms``,
   summed over requests), and the median TTFT seen by the caller.
2. **Chatbot load**: the chat suite, 8 client threads in a closed loop over 16 requests (each chat
   4 times, budgets 16 / 32 / 48), 8 llama.cpp slots: output tokens/s of the whole round.

Files are measured in turn, ``--rounds`` times, rotating the order each round; the medians over rounds
are printed with the load average at start and end.

    python benchmarks/gguf_types.py                 # 2 rounds: about 4 minutes on 2 CPU cores
    python benchmarks/gguf_types.py --rounds 3 --threads 2
    python benchmarks/gguf_types.py --transports wheel,native --types q4_1,q8_0,q4_0,bf16   # the wheel against a native build
"""

from __future__ import annotations

import argparse
import gc
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BUDGETS = (16, 32, 48)


def suite_messages(name: str) -> list[list[dict[str, str]]]:
    from fractal_opt.workloads.workload import Workload

    return [r.as_messages() for r in Workload(suite=name).requests()]


def server(path: Path, *, slots: int, threads: int, transport: str = "wheel") -> Any:
    """A llama.cpp server for ``path``: xllamacpp's in this process (``wheel``), or a llama-server
    child process (``native``: the one ``make setup-llama-native`` built; or an executable's path),
    through the runtime's own LlamaServerProcess, which takes the same request bodies."""
    if transport != "wheel":
        from fractal_opt.runtimes.llama_cpp.process import LlamaServerProcess, resolve_executable
        from fractal_opt.runtimes.llama_cpp.settings import ServerSettings

        settings = ServerSettings(model_path=str(path), threads=threads, slots=slots, kv_tokens=8192, unified=True, cache_type="f16",
                                  flash_attention="on", executable=str(resolve_executable(transport)))
        return LlamaServerProcess(settings)
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = str(path)
    p.n_parallel = slots
    p.kv_unified = True
    p.n_ctx = 8192
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.flash_attn_type = xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_ENABLED
    p.cache_prompt = False
    p.cache_ram_mib = 0
    p.warmup = True
    p.verbosity = -1
    s = xlc.Server(p)
    # One served request before use: dropping a server whose loop never ran hangs (docs/runtimes.md).
    s.handle_completions({"prompt": "a", "max_tokens": 1, "temperature": 0.0, "cache_prompt": False, "stream": False})
    return s


def request(srv: Any, messages: list[dict[str, str]], budget: int) -> dict[str, float]:
    """One greedy streamed chat request: caller's TTFT, tokens streamed, llama.cpp's timings."""
    body = {"messages": messages, "max_tokens": budget, "stream": True, "cache_prompt": False,
            "temperature": 0.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0}
    t0 = time.perf_counter()
    first: list[float] = []
    tokens = [0]
    timings: dict[str, float] = {}

    def on_chunk(chunk: dict[str, Any]) -> bool:
        timings.update(chunk.get("timings") or {})
        choices = chunk.get("choices")
        if choices and (choices[0].get("delta") or {}).get("content"):
            tokens[0] += 1
            if not first:
                first.append(time.perf_counter())
        return False

    srv.handle_chat_completions(body, on_chunk)
    return {"ttft_ms": ((first[0] if first else t0) - t0) * 1000, "tokens": tokens[0], **{k: float(timings.get(k) or 0) for k in
                                                                                           ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms")}}


def one_at_a_time(srv: Any, prompts: list[list[dict[str, str]]]) -> dict[str, float]:
    stats = [request(srv, m, BUDGETS[i % len(BUDGETS)]) for i, m in enumerate(prompts)]
    total = lambda key: sum(s[key] for s in stats)  # noqa: E731
    return {"prefill_tok_s": total("prompt_n") / total("prompt_ms") * 1000, "decode_tok_s": total("predicted_n") / total("predicted_ms") * 1000,
            "ttft_ms": statistics.median(s["ttft_ms"] for s in stats)}


def under_load(srv: Any, chats: list[list[dict[str, str]]], *, clients: int, requests: int) -> float:
    work: queue.SimpleQueue[int] = queue.SimpleQueue()
    for i in range(requests):
        work.put(i)
    streamed: list[int] = []

    def client() -> None:
        while True:
            try:
                i = work.get_nowait()
            except queue.Empty:
                return
            streamed.append(int(request(srv, chats[i % len(chats)], BUDGETS[i % len(BUDGETS)])["tokens"]))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(streamed) / (time.perf_counter() - t0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--types", default="q4_1,q4_0,q8_0", help="q4_1 (the embedded file) and gguf-backend types (q4_0, q8_0, bf16, f16), comma-separated")
    parser.add_argument("--transports", default="wheel", help="wheel (xllamacpp in this process), native (the llama-server make setup-llama-native "
                        "built, as a child process) or a llama-server path; comma-separated")
    args = parser.parse_args()
    from importlib.metadata import version

    from fractal_opt.weights.gguf_rewrite import requantize
    from fractal_opt.weights.models import resolve

    start = os.getloadavg()
    source = resolve("smollm2-135m-instruct").path
    files = {t: source if t == "q4_1" else requantize(source, t, progress=lambda m: print(m, file=sys.stderr)) for t in args.types.split(",")}
    quickstart, chats = suite_messages("default")[:4], suite_messages("chat")
    names = [(transport, t) for transport in args.transports.split(",") for t in files]
    results: dict[tuple[str, str], list[dict[str, float]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            transport, weights = name
            srv = server(files[weights], slots=1, threads=args.threads, transport=transport)
            one_at_a_time(srv, quickstart[:1])  # warm-up
            single = one_at_a_time(srv, quickstart)
            del srv
            gc.collect()
            srv = server(files[weights], slots=8, threads=args.threads, transport=transport)
            under_load(srv, chats, clients=8, requests=8)  # warm-up
            single["load_tok_s"] = under_load(srv, chats, clients=8, requests=16)
            del srv
            gc.collect()
            results[name].append(single)
            print(f"round {r + 1} {transport} {weights}: " + ", ".join(f"{k} {v:.1f}" for k, v in single.items()), file=sys.stderr, flush=True)
    print(f"# xllamacpp {version('xllamacpp')}, {args.threads} threads, {args.rounds} rounds; load average at start {start[0]:.2f}, "
          f"at end {os.getloadavg()[0]:.2f}")
    print("| build | weights | one at a time: prefill tok/s | decode tok/s | TTFT ms (median) | chatbot load, 8 clients: output tok/s |")
    print("|---|---|---|---|---|---|")
    for (transport, weights), rows in results.items():
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        print(f"| {transport} | {weights.upper()}{' (embedded)' if weights == 'q4_1' else ''} | {med['prefill_tok_s']:.0f} | {med['decode_tok_s']:.1f} | "
              f"{med['ttft_ms']:.0f} | {med['load_tok_s']:.1f} |")
    return 0


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    sys.exit(main())
