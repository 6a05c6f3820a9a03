"""Does the llama_cpp runtime keep llama.cpp's speed? Hand-driven xllamacpp vs LlamaCppEngine.serve().

Both paths run in this process on the same GGUF (the embedded SmolLM2-135M-Instruct) with the same
llama.cpp settings (one slot, a 4096-token KV cache, the given threads, f16 KV cache, no prompt
cache so every TTFT includes a full prefill), on the default suite's prompts, greedy, 32 new
tokens, 1 warm-up + 3 timed rounds, one llama.cpp server loaded at a time (each path's is loaded again
before its round, untimed). Rounds are interleaved (hand, engine / engine, hand), so load
from other processes falls on both alike.

The hand-driven path is the plainest use of the binding: ``Server.handle_chat_completions`` with a
streaming callback that reads ``perf_counter()`` when a chunk with content arrives. The engine
path additionally asks for ``n_probs: 1`` (token ids) and builds Generations.

    python benchmarks/llama_cpp_by_hand.py                 # 2 threads, 32 tokens, 3 rounds
    python benchmarks/llama_cpp_by_hand.py --threads 1 --rounds 5
    python benchmarks/llama_cpp_by_hand.py --dtype bfloat16   # the GGUF widened to BF16, the quickstart's kept plan

Prints decode tok/s and TTFT (medians over requests x rounds; TTFT for short and long prompts
apart, since a median over both mixes two populations), the engine / hand ratios (of the medians,
and the median of same-prompt same-round ratios) and the load average; exits 1 when the engine's decode tok/s is under 0.9x.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def hand_server(gguf: str, threads: int) -> Any:
    """llama.cpp's server with the settings the engine maps a sequential plan to, set by hand."""
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = gguf
    p.n_ctx = 4096
    p.n_parallel = 1
    p.kv_unified = True  # what the engine sets without a context cap (one slot: no difference)
    p.cpuparams.n_threads = threads
    p.cpuparams_batch.n_threads = threads
    p.cache_prompt = False
    p.cache_ram_mib = 0
    p.warmup = True
    p.verbosity = -1
    return xlc.Server(p)


def hand_request(server: Any, messages: list[dict[str, str]], tokens: int) -> tuple[float, list[float]]:
    """(t_submit, a perf_counter reading per streamed content chunk) for one greedy request."""
    times: list[float] = []

    def on_chunk(chunk: dict[str, Any]) -> bool:
        choices = chunk.get("choices")
        if choices and (choices[0].get("delta") or {}).get("content"):
            times.append(time.perf_counter())
        return False

    body = {"messages": messages, "max_tokens": tokens, "stream": True, "temperature": 0.0, "top_k": 1, "cache_prompt": False, "ignore_eos": True}
    t0 = time.perf_counter()
    server.handle_chat_completions(body, on_chunk)
    return t0, times


def rates(t0: float, times: list[float]) -> tuple[float, float]:
    """(TTFT in ms, decode tokens/s) the way fractal_opt.measure computes them."""
    ttft = (times[0] - t0) * 1e3
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else float("nan")
    return ttft, decode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default=None,
                    help="the GGUF widened to this type (the copy the engine loads, e.g. the quickstart's kept BF16 plan); default: the embedded Q4_1")
    args = ap.parse_args()

    import xllamacpp

    from fractal_opt.runtimes.llama_cpp import LlamaCppEngine, clear_cache
    from fractal_opt.runtimes.llama_cpp.settings import describe
    from fractal_opt.tower.plan import HardwarePlan, Plan
    from fractal_opt.workloads.workload import Workload

    print(f"xllamacpp {xllamacpp.__version__}, load average before: {os.getloadavg()}")
    requests = Workload(suite="default", max_new_tokens=args.tokens).requests()
    plan = Plan(source="smollm2-135m-instruct", hardware=HardwarePlan(runtime="llama_cpp", threads=args.threads, **({"dtype": args.dtype} if args.dtype else {})))
    engine = LlamaCppEngine.build(plan, progress=lambda _: None, max_new_tokens=args.tokens)
    gguf = engine.settings.model_path  # the file the engine serves: the embedded GGUF, or its widened copy
    samples: dict[str, list[tuple[str, float, float]]] = {"hand": [], "engine": []}  # (request id, ttft ms, tok/s)

    def run_hand(record: bool) -> None:
        # One llama.cpp server in the process at a time, as a deployment runs it: two resident
        # servers share libgomp, which then throttles both (docs/runtimes.md). The engine's server
        # leaves, the hand-made one is loaded for this round and dropped after it (untimed).
        clear_cache()
        hand = hand_server(gguf, args.threads)
        for r in requests:
            t0, times = hand_request(hand, r.as_messages(), args.tokens)
            if record:
                samples["hand"].append((r.id, *rates(t0, times)))
        del hand
        gc.collect()

    def run_engine(record: bool) -> None:
        engine.activate()  # its server is loaded again (untimed), as the measurement does before a round
        # ignore_eos as in the hand path: every request decodes its full budget.
        for r in requests:
            t0 = time.perf_counter()
            answer = engine.complete(r, budget=args.tokens, ignore_eos=True)
            if record:
                samples["engine"].append((r.id, *rates(t0, answer.token_times)))

    run_hand(False)
    run_engine(False)  # warm-up round: untimed
    for i in range(args.rounds):
        order = (run_hand, run_engine) if i % 2 == 0 else (run_engine, run_hand)
        for run in order:
            run(True)
    load_after = os.getloadavg()

    def median(path: str, col: int, kind: str | None = None) -> float:
        return statistics.median(s[col] for s in samples[path] if kind is None or s[0].startswith(kind))

    def paired(col: int, kind: str | None) -> float:
        # Both paths append (request, round) in the same order, so zip pairs the same prompt in the
        # same round: the median of those ratios is robust to load that changes between rounds.
        pairs = [e[col] / h[col] for h, e in zip(samples["hand"], samples["engine"]) if kind is None or h[0].startswith(kind)]
        return statistics.median(pairs)

    print(f"{'':22}{'hand-driven':>14}{'engine':>14}{'engine/hand':>14}{'paired ratio':>14}")
    rows = [("decode tok/s", 2, None), ("  short prompts", 2, "short"), ("  long prompts", 2, "long"), ("TTFT ms short", 1, "short"), ("TTFT ms long", 1, "long")]
    for label, col, kind in rows:
        h, e = median("hand", col, kind), median("engine", col, kind)
        print(f"{label:22}{h:14.1f}{e:14.1f}{e / h:14.2f}{paired(col, kind):14.2f}")
    print(f"load average after: {load_after}  ({os.cpu_count()} CPUs; {len(requests)} prompts x {args.rounds} rounds, {args.tokens} tokens, {args.threads} threads)")
    print(f"engine settings: {describe(engine.settings)}")
    ok = paired(2, None) >= 0.9
    print("PASS" if ok else "FAIL", "engine decode tok/s >= 0.9x hand-driven (paired ratio)")
    return 0 if ok else 1


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    sys.exit(main())
