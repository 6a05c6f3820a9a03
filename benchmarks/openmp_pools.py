"""torch throttled by its own OpenMP workers: a thread that ran a kernel and lives on slows the others.

libgomp keeps a pool of worker threads for every live thread that ran a parallel region, and once
the pools' threads outnumber the cores it cuts every thread's spin-wait between kernels to almost
nothing (docs/runtimes.md, "torch shares that OpenMP runtime"). This serves the embedded model's
float32 baseline one request at a time on a new thread (as the measurement's rounds run), then
runs one matmul on the main thread, which lives on, and serves again; then the same from the main
thread. It prints the decode rates and the cores busy.

    python benchmarks/openmp_pools.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def serve_suite(engine, requests, *, on_new_thread: bool) -> dict[str, float]:
    """Serve each request alone; the median decode rate and the cores busy while serving."""
    from fractal_opt.measure.metrics import Sample

    rates: list[float] = []
    busy: list[float] = []

    def work() -> None:
        cpu0, t0 = time.process_time(), time.perf_counter()
        for request in requests:
            rate = Sample.from_generation(engine.serve([request], max_new_tokens=32)[0]).decode_tokens_per_s  # the measurement's own reading
            if rate is not None:
                rates.append(rate)
        busy.append((time.process_time() - cpu0) / (time.perf_counter() - t0))

    if on_new_thread:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    else:
        work()
    rates.sort()
    return {"decode_tokens_per_s": round(rates[len(rates) // 2], 1), "cores_busy": round(busy[0], 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    import torch

    import fractal_opt
    from fractal_opt.core.machine import Machine
    from fractal_opt.engine.registry import RUNTIMES

    recipe = fractal_opt.load_recipe(ROOT / "recipes" / "quickstart.yaml")
    machine = Machine.probe()
    engine = RUNTIMES.build(recipe.base_plan(), machine=machine, progress=lambda _: None, max_new_tokens=32)
    requests = recipe.workload.requests()
    load_start = os.getloadavg()
    out = {"new thread, nothing else ran torch": serve_suite(engine, requests, on_new_thread=True)}
    a = torch.randn(1024, 1024)
    a @ a  # one parallel kernel on the main thread, which lives on with its pool
    out["new thread, after one matmul on the main thread"] = serve_suite(engine, requests, on_new_thread=True)
    out["main thread, after it"] = serve_suite(engine, requests, on_new_thread=False)
    first, after = out["new thread, nothing else ran torch"], out["new thread, after one matmul on the main thread"]
    out["slowdown_ratio"] = round(after["decode_tokens_per_s"] / first["decode_tokens_per_s"], 3)
    out.update(machine=f"{machine.cpu}, {machine.physical_cores} physical cores", date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               load_average={"start": [round(x, 2) for x in load_start], "end": [round(x, 2) for x in os.getloadavg()]})
    print(json.dumps(out, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()
    sys.exit(main())
