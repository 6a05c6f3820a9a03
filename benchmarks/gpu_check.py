"""One short, prepared check of the CUDA-only paths, for a machine that has a GPU.

Exercises, on the tiny random model (seconds each; nothing downloaded), what the CPU test suite
can only check by refusal: ``device: cuda``, ``device_map: auto`` with ``max_memory``, flash
attention 2, bitsandbytes int8 / nf4 / fp4 on CUDA, torchao int4 (Int4WeightOnlyConfig) and int8,
quanto int8, TF32 (``matmul_precision: high``), torch.compile ``reduce-overhead`` (CUDA graphs)
with a static cache sized by a context cap, and the offloaded / quantized KV caches. Each check
compares greedy tokens with the plain float build where that is meaningful, and prints one line:

    RAN  <check>: <what it showed>
    SKIP <check>: <why (the pass's own check() reason, or a missing package)>
    FAIL <check>: <error>

    python benchmarks/gpu_check.py            # about 1-3 minutes on one GPU (compile dominates)
    python benchmarks/gpu_check.py --no-compile

Exit status: 0 when nothing FAILed (skips are fine), 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fractal_opt.core.machine import Machine
from fractal_opt.layers.hardware import Attention, Compile, Device, Dtype, MatmulPrecision
from fractal_opt.layers.model import ContextCap, KVCache, Quantize
from fractal_opt.runtimes import Engine, clear_cache
from fractal_opt.testing import tiny_model
from fractal_opt.tower.plan import Plan
from fractal_opt.workloads.workload import Request

PROMPT = "Tell me about bridges and the rivers under them."
NEW = 8  # greedy tokens compared per check


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile check (the slowest)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    machine = Machine.probe()
    print(f"machine: {machine.cpu}; GPUs: {list(machine.cuda_devices) or 'none'}; packages: " + ", ".join(f"{k} {v}" for k, v in machine.packages.items() if v))
    tmp = Path(tempfile.mkdtemp(prefix="fractal-gpu-check-"))
    model_dir = tiny_model(tmp / "tiny", hidden_size=256, layers=4)
    base = Plan(source=str(model_dir))
    failures = 0

    def quiet(message: str) -> None:
        pass

    def tokens(plan: Plan) -> list[int]:
        engine = Engine.build(plan, machine=machine, progress=quiet)
        (gen,) = engine.serve([Request(id="check", messages=(("user", PROMPT),))], max_new_tokens=NEW)
        return gen.token_ids

    def run(name: str, passes: list, *, compare_to: Plan | None = None, extra=None) -> None:
        nonlocal failures
        plan = base
        for p in passes:
            reason = p.check(plan, machine)
            if reason is not None:
                print(f"SKIP {name}: {p.name}: {reason}", flush=True)
                return
            plan = p.apply(plan)
        try:
            clear_cache()
            t0 = time.perf_counter()
            got = tokens(plan)
            seconds = time.perf_counter() - t0
            engine = Engine.build(plan, machine=machine, progress=quiet)
            census = engine.census()
            note = f"{len(got)} tokens in {seconds:.1f} s (build + first call), quantized linears {census['quantized_linear_layers']}/{census['linear_layers']}"
            if compare_to is not None:
                want = tokens(compare_to)
                same = sum(1 for a, b in zip(got, want) if a == b)
                note += f", greedy tokens equal to the reference plan: {same}/{len(want)}"
            if extra is not None:
                note += ", " + extra(engine, census)
            print(f"RAN  {name}: {note}", flush=True)
        except Exception as e:  # noqa: BLE001  (a failing check is reported, the next one runs)
            failures += 1
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            traceback.print_exc(limit=2)

    cuda = Device(device="cuda")
    on_gpu = cuda.apply(base) if machine.has_cuda else base
    run("device cuda", [cuda], compare_to=None, extra=lambda e, c: f"model on {e.model.device}")
    run("device_map auto + max_memory", [Device(device="cuda", device_map="auto", max_memory={0: "4GiB", "cpu": "8GiB"})], compare_to=on_gpu,
        extra=lambda e, c: f"hf_device_map devices {sorted(set(map(str, e.model.hf_device_map.values())))}")
    run("dtype bfloat16 + flash_attention_2", [cuda, Dtype(dtype="bfloat16"), Attention(implementation="flash_attention_2")],
        compare_to=Dtype(dtype="bfloat16").apply(on_gpu))
    run("matmul_precision high (TF32)", [cuda, MatmulPrecision(precision="high")], compare_to=on_gpu)
    for label, q in [
        ("bitsandbytes int8", Quantize(bits=8, backend="bitsandbytes")),
        ("bitsandbytes nf4", Quantize(bits=4, method="nf4")),
        ("bitsandbytes fp4", Quantize(bits=4, method="fp4")),
        ("torchao int8 weight-only", Quantize(bits=8, backend="torchao")),
        ("torchao int4 weight-only (bf16)", None),
        ("quanto int8", Quantize(bits=8, backend="quanto")),
    ]:
        passes = [cuda, Dtype(dtype="bfloat16"), Quantize(bits=4, backend="torchao", group_size=128)] if q is None else [cuda, q]
        run(f"quantize {label} on CUDA", passes, extra=lambda e, c: f"weights {c['weight_bytes'] / 2**20:.1f} MiB")
    run("kv_cache offloaded", [cuda, KVCache(implementation="offloaded")], compare_to=on_gpu)
    run("kv_cache quantized quanto 4-bit", [cuda, KVCache(implementation="quantized", bits=4)],
        extra=lambda e, c: f"KV bytes per 1k tokens {c['kv_bytes_per_1k_tokens']} (saved {c['kv_bytes_saved_per_1k_tokens']})")
    if args.no_compile:
        print("SKIP compile reduce-overhead: --no-compile")
    else:
        run("compile reduce-overhead + static cache (cap 512)", [cuda, Compile(mode="reduce-overhead"), ContextCap(tokens=512)], compare_to=on_gpu,
            extra=lambda e, c: f"compiled call present: {hasattr(e.model, '_compiled_call')}")
    print(f"done: {failures} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    raise SystemExit(main())
