"""llama.cpp's slots against one request: does a server with slots for a burst decode one request slower?

Two plans on the embedded SmolLM2-135M-Instruct GGUF, the same but for their slots: llama.cpp
continuous batching with 1 slot and with 16 (``scheduling.max_concurrency``). Each round, for each
plan in turn (the order alternating), a burst of 16 of the default suite's requests is served
(untimed: it fills the slots' KV cache as a load would), then one short request alone is measured by
the one measurement runner (:func:`fractal_opt.measure.runner.measure`: one warm-up, one round):
its decode tokens/s. The answer is the paired change of the 16-slot plan against the 1-slot one
over the rounds, with its 95% t interval (:func:`fractal_opt.measure.noise.paired_interval`).

    python benchmarks/llama_slots.py --json    # {"decode_tokens_per_s": {"1 slot", "16 slots"}, "change", "interval", ...}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SLOTS = (1, 16)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="rounds per plan (the order alternating)")
    parser.add_argument("--path", default=None, help="runtime_path: 'native' for the llama-server built for this CPU (default: the xllamacpp wheel)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args()
    from fractal_opt.core.machine import Machine
    from fractal_opt.measure.noise import paired_interval
    from fractal_opt.measure.runner import measure
    from fractal_opt.runtimes import build
    from fractal_opt.tower.plan import Plan
    from fractal_opt.workloads.workload import Workload

    load_start = os.getloadavg()
    machine = Machine.probe()
    base = Plan(source="smollm2-135m-instruct").replace_section("hardware", runtime="llama_cpp", runtime_path=args.path)
    burst_wl = Workload(suite="default", max_new_tokens=32)
    burst = (burst_wl.requests() * 3)[:16]
    burst = [dataclasses.replace(r, id=f"{r.id}-{i}") for i, r in enumerate(burst)]
    one = Workload(suite="default", limit=1, max_new_tokens=64, repeats=1, warmup=1)
    engines = {n: build(base.replace_section("scheduling", batching="continuous", max_concurrency=n), machine=machine, progress=log, max_new_tokens=64)
               for n in SLOTS}
    decode: dict[int, list[float]] = {n: [] for n in SLOTS}
    try:
        for r in range(args.rounds):
            for n in (SLOTS if r % 2 == 0 else SLOTS[::-1]):
                engine = engines[n]
                engine.activate()
                engine.serve(burst, max_new_tokens=32)  # the burst, untimed
                m = measure(engine, one)
                decode[n].append(m.median("decode_tokens_per_s"))
                log(f"round {r + 1}/{args.rounds}, {n} slot(s): one request decodes {decode[n][-1]:.1f} tokens/s")
    finally:
        for engine in engines.values():
            engine.close()
    logs = {r: [math.log(decode[16][r] / decode[1][r])] for r in range(args.rounds)}
    iv = paired_interval(logs)
    out = {
        "decode_tokens_per_s": {"1 slot": round(statistics.median(decode[1]), 1), "16 slots": round(statistics.median(decode[16]), 1)},
        "change": round(iv.change, 4), "interval": iv.to_list(), "rounds": args.rounds, "per_round": {f"{n} slot(s)": [round(v, 1) for v in decode[n]] for n in SLOTS},
        "runtime": f"llama_cpp ({args.path or 'xllamacpp wheel'})", "burst": len(burst),
        "machine": f"{machine.cpu}, {machine.physical_cores} physical cores", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": {"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]},
    }
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    sys.exit(main())
