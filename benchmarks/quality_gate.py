"""Is the quality gate itself right? Deliberately harmful changes must all be rolled back, harmless ones kept.

    python benchmarks/quality_gate.py [--json] [--only NAME ...] [--folder DIR]

Each change is a plan (or the baseline's engine with one setting broken after it is built) on the
embedded SmolLM2-135M-Instruct. Its quality evidence is measured exactly as a pipeline step
measures it (quality.probes.model_probes for KL, agreement with the baseline's greedy answers on
the quickstart workload, then, for a change still standing, the packaged basics eval with lost /
gained questions) and judged by the default policy (fractal_opt.language.policy.Policy: the default guards, nothing set by this script). Speed
is not measured: every candidate is given the same clear speed gain (its layer's objective 2x
better), so each verdict is the quality gate's alone, and no speed rounds are spent (on the 2-core
AMD EPYC the baseline and the four harmless changes on transformers and llama.cpp took 5 minutes at
load average 0.5-1.8; int4 quanto alone took over 8 minutes under load, docs/quality.md).

Harmful (must be rolled back): int4 weights with no skip list, a 2-bit KV cache, another model
family's chat template, a context cap that cuts the long prompts, a sampling temperature leaking
into serving, two layers swapped, llama.cpp's Q4_1 kernels (they change the README question's
answer), the GGUF re-quantized to Q4_0, special tokens split into text (a tokenizer setting).
Harmless (should be kept): one thread, the eager attention kernel, prepacked weights, bf16 on
transformers, bf16 on llama.cpp, a response cache. Measured and reported in neither set: the
weights in Q8_0 on llama.cpp (refused on the embedded Q4_1 GGUF: quantizing up). ``--folder DIR``
runs the same changes on the embedded model given as a folder (its safetensors conversion, copied
elsewhere), where llama.cpp gets the folder converted exactly (F32, harmless) instead of the GGUF's
Q4_1 kernels, and Q8_0 is a real step down from float32. Prints one line per change, then the totals;
``--json`` prints one object with ``harmful_total``, ``harmful_rejected``, ``harmless_total``,
``harmless_kept`` and each change's numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from fractal_opt.core.machine import Machine
from fractal_opt.language.policy import Policy
from fractal_opt.layers import get_pass
from fractal_opt.measure.metrics import METRICS
from fractal_opt.quality.evals import load_eval_set, score
from fractal_opt.quality.probes import QualityConfig, agreement, build_reference, model_probes
from fractal_opt.runtimes import build, clear_cache
from fractal_opt.tower.passes import Layer
from fractal_opt.tower.plan import Plan
from fractal_opt.workloads.workload import Workload

MODEL = "smollm2-135m-instruct"
MODEL_SOURCE = [MODEL]  # --folder replaces it: the embedded model's safetensors folder, copied elsewhere
WORKLOAD = Workload(suite="default", limit=4, max_new_tokens=32)  # the quickstart's prompts and length
EVAL_TOKENS = 24  # QualityConfig.eval_max_new_tokens' default
# Llama 2's template: a real mistake (a model served with another family's template).
WRONG_TEMPLATE = "{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{% endif %}{% endfor %}"


def _swap_layers(engine: Any) -> None:
    layers = engine.model.model.layers
    layers[5], layers[20] = layers[20], layers[5]


def _wrong_template(engine: Any) -> None:
    from fractal_opt.weights.prompts import PromptFormat

    engine.prompt_format = PromptFormat(WRONG_TEMPLATE, "another family's template")  # every prompt is rendered through it


def _split_special_tokens(engine: Any) -> None:
    engine.tokenizer.split_special_tokens = True  # "<|im_start|>" read as text, not the control token


# name -> (harmful?, layer, [(pass, params)], mutation of the built engine or None); harmful None:
# measured and reported, in neither set (it joins the harmless set once it keeps the eval).
CHANGES: dict[str, tuple[bool | None, Layer, list[tuple[str, dict]], Callable[[Any], None] | None]] = {
    "int4 weights, no skip list": (True, Layer.MODEL, [("quantize", {"bits": 4, "backend": "quanto", "skip": ()})], None),
    "2-bit KV cache": (True, Layer.MODEL, [("kv_cache", {"implementation": "quantized", "bits": 2, "backend": "quanto"})], None),
    "wrong chat template": (True, Layer.APPLICATION, [], _wrong_template),
    "context cut to 48 tokens": (True, Layer.APPLICATION, [("prompt_budget", {"max_tokens": 48, "strategy": "head_tail"})], None),
    "temperature leak (sampling at 1.0)": (True, Layer.APPLICATION, [("decoding", {"strategy": "sample", "temperature": 1.0})], None),
    "two layers swapped": (True, Layer.MODEL, [], _swap_layers),
    "llama.cpp Q4_1 kernels": (True, Layer.HARDWARE, [("runtime", {"backend": "llama_cpp"})], None),
    "llama.cpp Q4_0 re-quantization": (True, Layer.MODEL, [("runtime", {"backend": "llama_cpp"}), ("quantize", {"bits": 4, "backend": "gguf"})], None),
    "special tokens split into text": (True, Layer.APPLICATION, [], _split_special_tokens),
    "one thread": (False, Layer.HARDWARE, [("threads", {"count": 1})], None),
    "eager attention kernel": (False, Layer.HARDWARE, [("attention", {"implementation": "eager"})], None),
    "prepacked weights": (False, Layer.HARDWARE, [("prepack", {})], None),
    "bf16 on transformers": (False, Layer.HARDWARE, [("dtype", {"dtype": "bfloat16"})], None),
    "bf16 on llama.cpp": (False, Layer.HARDWARE, [("runtime", {"backend": "llama_cpp", "dtype": "bfloat16"})], None),
    "response cache": (False, Layer.APPLICATION, [("response_cache", {})], None),
    "llama.cpp Q8_0": (None, Layer.MODEL, [("runtime", {"backend": "llama_cpp"}), ("quantize", {"bits": 8, "backend": "gguf"})], None),
}
# The embedded GGUF's own Q4_1 blocks exist only there; a folder is converted exactly (F32) instead.
GGUF_ONLY = {"llama.cpp Q4_1 kernels"}
FOLDER_ONLY = {"llama.cpp F32 (the folder converted exactly)": (False, Layer.HARDWARE, [("runtime", {"backend": "llama_cpp"})], None)}
# On the embedded GGUF (Q4_1, 5 bits a weight) Q8_0 would be quantizing up, which the ladder refuses.
SOURCE_EXCLUDES = {"gguf": {"llama.cpp Q8_0"}, "folder": GGUF_ONLY}


def _plan(steps: list[tuple[str, dict]]) -> Plan:
    plan = Plan(source=MODEL_SOURCE[0])
    for name, params in steps:
        plan = get_pass(name)(**params).apply(plan)
    return plan


def _evidence(engine: Any, reference: Any) -> dict[str, Any]:
    """KL and agreement: the numbers a pipeline step's quality holds before its eval set."""
    gens = engine.serve(WORKLOAD.requests(), max_new_tokens=WORKLOAD.max_new_tokens)
    outputs = {g.request_id: list(g.token_ids) for g in gens}
    out = {**model_probes(reference, engine), **agreement(reference, outputs, cap=engine.plan.application.max_new_tokens)}
    out["outputs"] = outputs
    return out


def _verdict(layer: Layer, quality: dict[str, Any], baseline_quality: dict[str, Any]) -> Any:
    """The default policy's verdict on the quality evidence, the objective given a clear gain."""
    policy = Policy()
    objective = policy.objective_for(layer)
    gain = 1.0 if METRICS[objective] else -0.5  # 2x better either way
    before = {objective: 100.0}
    after = {objective: 100.0 * (1 + gain), **{k: v for k, v in quality.items() if k != "outputs"}}
    return policy.judge(layer, before, after, {objective: gain}, {objective: 0.05}, baseline=baseline_quality)


def _one(name: str, reference: Any, items: list, base: dict[str, Any], say: Callable[..., None]) -> dict[str, Any]:
    harmful, layer, steps, mutate = CHANGES[name]
    t0 = time.perf_counter()
    engine = build(_plan(steps), max_new_tokens=WORKLOAD.max_new_tokens, progress=say)
    try:
        if mutate is not None:
            mutate(engine)
        quality = _evidence(engine, reference)
        v = _verdict(layer, quality, base)
        # A change the KL guard already rolls back stays rolled back whatever its eval says: the
        # eval (the slowest probe: 45 answers, 20 minutes on int4 quanto under load) is scored only
        # where it can decide: a change still standing, or one whose agreement tripped, which the
        # eval then judges (the default agreement guard is judged_by accuracy). The pipeline scores
        # it on every step whose objective improved.
        if v.kept or _verdict(layer, {**quality, "accuracy": base["accuracy"]}, base).kept:
            quality.update(score(engine, items, max_new_tokens=EVAL_TOKENS, baseline=base["eval_items"]))
            v = _verdict(layer, quality, base)
    finally:
        engine.close()
        clear_cache()
        gc.collect()
    readme = quality["eval_items"][0]["answer"] if "eval_items" in quality else None
    return {"name": name, "harmful": harmful, "layer": str(layer), "kept": v.kept, "reason": v.reason,
            "kl_mean": quality.get("kl_mean"), "kl_method": quality.get("kl_method"), "agreement": quality["agreement"],
            "accuracy": quality.get("accuracy"), "eval_lost": quality.get("eval_lost"), "eval_gained": quality.get("eval_gained"),
            "readme_answer": readme, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--only", nargs="*", choices=sorted([*CHANGES, *FOLDER_ONLY]), help="these changes only")
    ap.add_argument("--folder", type=Path, help="the embedded model as a folder (its safetensors conversion, copied elsewhere) instead of its GGUF")
    args = ap.parse_args()
    if args.folder:
        MODEL_SOURCE[0] = str(args.folder)
        CHANGES.update(FOLDER_ONLY)
    excluded = SOURCE_EXCLUDES["folder" if args.folder else "gguf"]
    names = [n for n in (args.only or list(CHANGES)) if n not in excluded]
    # With --json the JSON object is the whole of stdout: progress (ours and the runtimes' load lines) goes to stderr.
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    machine, load_before, t0 = Machine.probe(), os.getloadavg(), time.perf_counter()
    items = load_eval_set("basics")
    say("baseline: float32 transformers, scoring the reference text, the workload and the eval set")
    engine = build(Plan(source=MODEL_SOURCE[0]), max_new_tokens=WORKLOAD.max_new_tokens, progress=say)
    reference = build_reference(engine, {}, QualityConfig())
    base = _evidence(engine, reference)
    reference.outputs = base.pop("outputs")
    base.update(score(engine, items, max_new_tokens=EVAL_TOKENS))
    engine.close()
    say(f"baseline: eval {base['eval_passed']}/{base['eval_total']}; README question: {base['eval_items'][0]['answer']!r}")
    results = []
    for name in names:
        r = _one(name, reference, items, base, say)
        results.append(r)
        say(f"{ {True: 'harmful', False: 'harmless', None: 'measured'}[r['harmful']] } | {name}: {'KEPT' if r['kept'] else 'rolled back'} "
            f"(kl {r['kl_mean']}, agreement {r['agreement']}, eval lost {r['eval_lost']} gained {r['eval_gained']}, {r['seconds']} s) "
            f"README: {('eval not scored: already rolled back' if r['readme_answer'] is None else r['readme_answer'])[:50]!r}")
    harmful = [r for r in results if r["harmful"]]
    harmless = [r for r in results if r["harmful"] is False]
    summary = {
        "harmful_total": len(harmful), "harmful_rejected": sum(not r["kept"] for r in harmful),
        "harmless_total": len(harmless), "harmless_kept": sum(r["kept"] for r in harmless),
        "baseline_eval": f"{base['eval_passed']}/{base['eval_total']}", "model": MODEL_SOURCE[0],
        "machine": {"cpu": machine.cpu, "logical_cores": machine.logical_cores, "flags": sorted(f for f in machine.cpu_flags if f.startswith(("avx512", "amx")))},
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()], "seconds": round(time.perf_counter() - t0, 1), "changes": results,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        say(f"harmful rolled back: {summary['harmful_rejected']}/{summary['harmful_total']}; harmless kept: {summary['harmless_kept']}/{summary['harmless_total']}")
    return 0


if __name__ == "__main__":
    from fractal_opt.core.quiet import quiet_third_party

    quiet_third_party()  # torchao's and torch's import-time warnings and load bars would come before the first line
    sys.exit(main())
