"""Measure each hardware and model pass alone against the baseline on the embedded model; print a table.

Every variant is one pass applied to the plain plan (not stacked), built by the Engine, timed by
fractal_opt.measure (warm-up excluded, medians over repeats) and scored by fractal_opt.quality
(KL vs the baseline on the reference text). Variants the machine cannot run are listed with the
pass's own ``check`` reason. Start-up costs (build, sensitivity analysis, compile) are shown in
their own column, never mixed into the steady-state numbers.

    python benchmarks/layers.py                 # all CPU-runnable variants, about 6-8 minutes on 2 cores
    python benchmarks/layers.py --only int8 kv  # variants whose label contains any of the words
    python benchmarks/layers.py --compile       # also torch.compile (about 5 minutes more on 2 cores)

Prints a Markdown table; ``--json PATH`` also writes the raw numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fractal_opt.core.machine import Machine
from fractal_opt.layers.hardware import Attention, Compile, Dtype, MatmulPrecision, Threads
from fractal_opt.layers.model import ContextCap, KVCache, Quantize
from fractal_opt.measure.runner import measure
from fractal_opt.quality.probes import QualityConfig, agreement, build_reference, model_probes
from fractal_opt.runtimes import Engine, clear_cache
from fractal_opt.tower.plan import Plan
from fractal_opt.workloads.workload import Workload

MODEL = "smollm2-135m-instruct"

VARIANTS = [
    ("dtype bfloat16", Dtype(dtype="bfloat16")),
    ("threads auto", Threads(count="auto")),
    ("attention eager", Attention(implementation="eager")),
    ("matmul_precision high", MatmulPrecision(precision="high")),
    ("kv_cache static", KVCache(implementation="static")),
    ("kv_cache static + context_cap 1024", None),  # two model-layer passes: the cap sizes the static cache
    ("kv_cache quantized quanto 4-bit", KVCache(implementation="quantized", backend="quanto", bits=4)),
    ("kv_cache quantized hqq 8-bit", KVCache(implementation="quantized", backend="hqq", bits=8)),
    ("quantize torchao int8 weight-only", Quantize(bits=8, backend="torchao")),
    ("quantize torchao int8 dynamic", Quantize(bits=8, method="dynamic")),
    ("quantize torchao int4 g32", Quantize(bits=4, backend="torchao", group_size=32)),
    ("quantize torchao int4 g32 + sensitivity", Quantize(bits=4, backend="torchao", sensitivity=True, max_kl=0.05)),
    ("quantize bitsandbytes int8", Quantize(bits=8, backend="bitsandbytes")),
    ("quantize bitsandbytes nf4", Quantize(bits=4, method="nf4")),
    ("quantize quanto int8", Quantize(bits=8, backend="quanto")),
    ("quantize quanto int8, attention kept (*.self_attn.*)", Quantize(bits=8, backend="quanto", skip=("lm_head", "*.self_attn.*"))),
    ("quantize quanto int4", Quantize(bits=4, backend="quanto")),
]
COMPILE = ("compile default (static cache, cap 1024)", Compile(mode="default"))


def _plan(label: str, p, base: Plan, machine: Machine) -> tuple[Plan | None, str | None]:
    if p is None:  # static cache + cap
        plan = ContextCap(tokens=1024).apply(KVCache(implementation="static").apply(base))
        return plan, None
    reason = p.check(base, machine)
    if reason is not None:
        return None, reason
    plan = p.apply(base)
    if isinstance(p, Compile):
        plan = ContextCap(tokens=1024).apply(plan)  # one cache shape: compile once, not per prompt length
    return plan, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="*", default=None, help="run variants whose label contains any of these words")
    ap.add_argument("--compile", action="store_true", help="include torch.compile (minutes of warm-up on a small CPU)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")

    machine = Machine.probe()
    # One short and one long (~500-token) prompt: decode speed and the prefill side of each trade.
    workload = Workload(suite="default", max_new_tokens=args.max_new_tokens, repeats=args.repeats, warmup=1)
    requests = [r for r in workload.requests() if r.id in ("short-1", "long-1")]
    variants = VARIANTS + ([COMPILE] if args.compile else [])
    if args.only:
        variants = [(label, p) for label, p in variants if any(w in label for w in args.only)]

    base = Plan(source=MODEL)
    t0 = time.perf_counter()
    engine = Engine.build(base, machine=machine, progress=lambda m: None)
    base_build = time.perf_counter() - t0
    base_m = measure(engine, workload, requests=requests)
    reference = build_reference(engine, base_m.outputs, QualityConfig(reference_tokens=512))
    rows = [_row("baseline (float32, sdpa, dynamic cache)", base_m, {"kl_mean": 0.0, "agreement": 1.0}, engine.census(), base_build, None)]
    print(f"# {MODEL} on {machine.cpu}, {machine.logical_cores} logical cores, torch threads default; {len(requests)} prompts x {args.repeats} repeats, {args.max_new_tokens} new tokens", flush=True)
    print(_header(), flush=True)
    print(_line(rows[0]), flush=True)
    for label, p in variants:
        plan, reason = _plan(label, p, base, machine)
        if plan is None:
            rows.append({"variant": label, "skipped": reason})
            print(f"| {label} | skipped: {reason} |", flush=True)
            continue
        clear_cache()  # one model in memory at a time
        try:
            t0 = time.perf_counter()
            eng = Engine.build(plan, machine=machine, progress=lambda m: None)
            build_s = time.perf_counter() - t0
            compile_s = None
            if plan.hardware.compile is not None:
                t0 = time.perf_counter()
                eng.serve(requests, max_new_tokens=args.max_new_tokens)
                compile_s = time.perf_counter() - t0
            m = measure(eng, workload, requests=requests)
            quality = {**model_probes(reference, eng), **agreement(reference, m.outputs)}
            row = _row(label, m, quality, eng.census(), build_s, compile_s, base_m)
        except Exception as e:  # noqa: BLE001  (a failing variant is a result too)
            row = {"variant": label, "failed": f"{type(e).__name__}: {e}"[:200]}
        rows.append(row)
        print(_line(row), flush=True)
    print(f"\nmachine: {platform.platform()}; {machine.cpu}; torch threads default; packages: "
          + ", ".join(f"{k} {v}" for k, v in machine.packages.items() if v), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 0


def _row(label, m, quality, census, build_s, compile_s, base_m=None) -> dict:
    def med(metric, rid):
        return m.per_request(metric).get(rid)

    return {
        "variant": label,
        "decode_short": med("decode_tokens_per_s", "short-1"),
        "decode_long": med("decode_tokens_per_s", "long-1"),
        "ttft_short_ms": med("ttft_ms", "short-1"),
        "ttft_long_ms": med("ttft_ms", "long-1"),
        "peak_mb": m.median("peak_memory_mb"),
        "weight_mb": census["weight_bytes"] / 2**20,
        "kv_kb_per_1k": census.get("kv_bytes_per_1k_tokens", 0) / 1024,
        "kl_mean": quality.get("kl_mean"),
        "agreement": quality.get("agreement"),
        "build_s": build_s,
        "compile_s": compile_s,
        "quantized": f"{census['quantized_linear_layers']}/{census['linear_layers']}",
    }


def _header() -> str:
    cols = ["variant", "decode tok/s short / long", "TTFT ms short / long", "peak MB", "weights MB", "KV KB/1k tok", "KL", "agree", "quantized linears", "build s (compile s)"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def _f(v, fmt="{:.1f}") -> str:
    return "–" if v is None else fmt.format(v)


def _line(r: dict) -> str:
    if "failed" in r:
        return f"| {r['variant']} | failed: {r['failed']} |"
    if "skipped" in r:
        return f"| {r['variant']} | skipped: {r['skipped']} |"
    build = _f(r["build_s"]) + (f" ({r['compile_s']:.0f})" if r.get("compile_s") is not None else "")
    return (
        f"| {r['variant']} | {_f(r['decode_short'])} / {_f(r['decode_long'])} | {_f(r['ttft_short_ms'], '{:.0f}')} / {_f(r['ttft_long_ms'], '{:.0f}')} "
        f"| {_f(r['peak_mb'], '{:.0f}')} | {_f(r['weight_mb'], '{:.0f}')} | {_f(r['kv_kb_per_1k'], '{:.0f}')} | {_f(r['kl_mean'], '{:.4f}')} "
        f"| {_f(r['agreement'], '{:.2f}')} | {r['quantized']} | {build} |"
    )


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    raise SystemExit(main())
