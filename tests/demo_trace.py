"""A trace shaped like `make demo`'s, for the report's tests: built by hand, its numbers from the issue
that asked for the first screen (the quickstart recipe on the embedded SmolLM2, 2-core AMD EPYC,
2026-12-05), so each test can plant the number it checks.

The run: llama.cpp on Q4_1 rolled back by the eval, llama.cpp on BF16 kept (one request at a time:
decode 15.3 -> 88.4 tokens/s), quantize skipped, continuous batching kept (throughput at the burst
of 4 clients, each stream slower), a 24-token cap kept. The confirmation measured both plans at 4
clients (the headline) and one request at a time (decode, traded by batching, where its own step
measured it); at 4 clients decode's interval is far too wide to bound anything (two rounds).
"""

from __future__ import annotations

from typing import Any

from fractal_opt.report.trace import Step, Trace

RECIPE = {"name": "quickstart", "model": "smollm2-135m-instruct",
          "workload": {"suite": "default", "limit": 4, "max_new_tokens": 32, "repeats": 3, "warmup": 1,
                       "load": {"mode": "closed", "concurrency": 4, "requests": 4}},
          "policy": {"objective": "auto", "min_effect": 0.05, "max_regression": 0.10, "guards": {"itl_ms_p90": {"max": 100}, "ttft_ms": {"max_regression": 1.5}}},
          "quality": {"eval": "auto"}}


def entry(change: float, low: float, high: float, before: float, after: float, *, band: float = 0.05) -> dict[str, Any]:
    """One metric of a confirmation, as pipeline/confirm.py records it."""
    gain = change
    verdict = "better" if abs(gain) > band and low * high > 0 else "within noise"
    return {"change": change, "interval": [low, high], "band": band, "verdict": verdict, "baseline_median": before, "final_median": after}


def _lower(change: float, low: float, high: float, before: float, after: float, *, band: float = 0.05) -> dict[str, Any]:
    """An entry of a metric where lower is better (a time, a cost)."""
    e = entry(change, low, high, before, after, band=band)
    if e["verdict"] == "better" and change > 0:
        e["verdict"] = "worse"
    return e


def confirmation() -> dict[str, Any]:
    at_four = {
        "decode_tokens_per_s": entry(0.153, -0.64, 2.691, 16.2, 32.1, band=0.9),
        "throughput_tokens_per_s": entry(1.197, 1.065, 1.337, 13.6, 30.2, band=0.13),
        "ttft_ms": _lower(-0.455, -0.794, 0.442, 2488.0, 1912.0, band=0.6),
        "ttft_ms_p90": _lower(-0.62, -0.70, -0.52, 5500.0, 2100.0, band=0.1),
        "itl_ms_p90": _lower(1.42, 1.10, 1.80, 13.0, 31.5, band=0.2),
        "e2e_ms": _lower(-0.321, -0.369, -0.269, 3680.0, 2630.0),
        "cpu_s_per_1k_tokens": _lower(-0.55, -0.60, -0.49, 41.2, 18.7),
        "weight_mb": {"change": -0.549, "baseline": 513.0, "final": 231.0, "source": "census", "verdict": "better"},
    }
    alone = {
        "decode_tokens_per_s": entry(4.78, 4.2, 5.41, 15.3, 88.4, band=0.28),
        "ttft_ms": _lower(0.82, -0.652, 8.524, 240.0, 437.0, band=0.5),
        "e2e_ms": _lower(-0.77, -0.80, -0.74, 2140.0, 492.0),
    }
    traded = {"decode_tokens_per_s": {"by": "scheduling/batching", "change": -0.785, "band": 0.219, "for": "throughput_tokens_per_s",
                                      "alone": {k: alone["decode_tokens_per_s"][k] for k in ("change", "interval", "band", "verdict", "baseline_median", "final_median")}},
              "throughput_tokens_per_s": {"by": "application/max_new_tokens", "change": -0.156, "band": 0.05, "for": "e2e_ms"}}
    return {"mode": "interleaved", "rounds": 3, "clients": 4, "objectives": ["e2e_ms"], "metrics": at_four, "traded": traded,
            "note": "baseline and final plan measured again after the last step, interleaved (A B / B A), at 4 clients (both plans' offered load)",
            "at_loads": [{"clients": 4, "label": "at 4 clients", "whose": "both plans' offered load", "headline": True, "status": "confirmed", "rounds": 3, "metrics": at_four},
                         {"clients": 1, "label": "at 1 client", "whose": "one request at a time, where decode_tokens_per_s was kept", "headline": False,
                          "status": "confirmed", "rounds": 2, "metrics": alone}]}


def _quality(passed: int, *, lost: int | None = None, gained: int | None = None, answers: dict[str, str]) -> dict[str, Any]:
    q: dict[str, Any] = {"kl_mean": 0.004, "agreement": 0.75, "eval_passed": passed, "eval_total": 45, "accuracy": round(passed / 45, 4), "answers": answers}
    if lost is not None:
        q.update(eval_lost=lost, eval_gained=gained, eval_changed=3)
    return q


def demo_trace() -> Trace:
    """The demo's trace: confirmed, at two loads, with traded objectives."""
    base_answers = {"r1": "Paris.", "r2": "Four.", "r3": "A cat.", "r4": "A long answer."}
    baseline = Step(pass_name="baseline", layer="-", params={}, status="baseline", reason="plain transformers",
                    metrics={"decode_tokens_per_s": 15.9, "throughput_tokens_per_s": 13.6, "e2e_ms": 3700.0, "weight_mb": 513.0, "peak_memory_mb": 900.0,
                             "quality": {**_quality(35, answers=base_answers), "prompts": {"r1": "Capital of France?", "r2": "2+2?", "r3": "A pet?", "r4": "Tell me more."}}})
    steps = [
        Step(pass_name="runtime", layer="hardware", params={"backend": "llama_cpp"}, status="rolled_back", reason="eval: 5 of 45 lost",
             metrics={"decode_tokens_per_s": 116.0}, changes={"decode_tokens_per_s": 6.3}, bands={"decode_tokens_per_s": 0.3}),
        Step(pass_name="runtime", layer="hardware", params={"backend": "llama_cpp", "dtype": "bfloat16"}, status="kept", reason="decode +471.5%",
             metrics={"decode_tokens_per_s": 93.9, "throughput_tokens_per_s": 38.1, "e2e_ms": 2900.0}, changes={"decode_tokens_per_s": 4.715}, bands={"decode_tokens_per_s": 0.05}),
        Step(pass_name="quantize", layer="model", params={"bits": 4}, status="skipped", reason="check: one weight type per GGUF"),
        Step(pass_name="batching", layer="scheduling", params={"mode": "continuous"}, status="kept", reason="throughput +10.2%",
             metrics={"decode_tokens_per_s": 20.1, "throughput_tokens_per_s": 42.2, "e2e_ms": 2800.0}, changes={"throughput_tokens_per_s": 0.102, "decode_tokens_per_s": -0.785},
             bands={"throughput_tokens_per_s": 0.05, "decode_tokens_per_s": 0.219}),
        Step(pass_name="max_new_tokens", layer="application", params={"limit": 24}, status="kept", reason="e2e -5.9%",
             metrics={"decode_tokens_per_s": 28.5, "throughput_tokens_per_s": 35.6, "e2e_ms": 2640.0, "weight_mb": 231.0,
                      "quality": _quality(35, lost=0, gained=0, answers={**base_answers, "r4": "A long"})},
             changes={"e2e_ms": -0.059, "throughput_tokens_per_s": -0.156}, bands={"e2e_ms": 0.05, "throughput_tokens_per_s": 0.05}),
    ]
    final = {"status": "confirmed", "kept": ["hardware/runtime", "scheduling/batching", "application/max_new_tokens"], "confirmation": confirmation(),
             "metrics": {**steps[-1].metrics, "decode_tokens_per_s": 32.1, "throughput_tokens_per_s": 30.2, "e2e_ms": 2630.0, "ttft_ms": 1912.0,
                         "ttft_ms_p90": 2100.0, "itl_ms_p90": 31.5, "cpu_s_per_1k_tokens": 18.7},
             "vs_baseline": {"decode_tokens_per_s": 0.153, "throughput_tokens_per_s": 1.197}}
    return Trace(recipe=RECIPE, machine={"cpu": "AMD EPYC", "logical_cores": 2, "physical_cores": 2}, baseline=baseline, steps=steps, final=final, finished=True,
                 calibration={"rounds": 3, "resolves": True, "min_effect": 0.05, "decode_tokens_per_s": 0.003, "intervals": {"decode_tokens_per_s": [-0.02, 0.026]},
                              "resolution": {"decode_tokens_per_s": 0.023}},
                 run={"started_at": "2026-12-05T02:35:46+00:00", "ended_at": "2026-12-05T02:41:31+00:00"})


def final_figures(data: dict[str, Any]) -> dict[tuple[str, int | None], set[float]]:
    """Every figure trace.json (``data``) holds for the final plan, by (metric, offered clients):
    ``final.metrics``, the confirmation's medians at each load, a traded objective's medians one
    request at a time, the drift's confirmed figures and the targets' values."""
    final = data["final"]
    conf = final.get("confirmation") or {}
    head = conf.get("clients")
    found: dict[tuple[str, int | None], set[float]] = {}

    def add(metric: str, clients: int | None, value: Any) -> None:
        if isinstance(value, int | float) and not isinstance(value, bool):
            found.setdefault((metric, clients), set()).add(float(value))

    for metric, value in (final.get("metrics") or {}).items():
        add(metric, head, value)
    for entries, clients in [(conf.get("metrics") or {}, head), *(((e.get("metrics") or {}), e.get("clients")) for e in conf.get("at_loads") or [])]:
        for metric, e in entries.items():
            add(metric, clients, e.get("final_median", e.get("final")))
    for metric, t in (conf.get("traded") or {}).items():
        if t.get("alone"):
            add(metric, 1, t["alone"]["final_median"])
            if t["alone"].get("drift"):
                add(metric, 1, t["alone"]["drift"]["confirmed"])
    if conf.get("drift"):
        add(conf["drift"]["metric"], head, conf["drift"]["confirmed"])
    for metric, gap in (final.get("targets") or {}).items():
        add(metric, head, gap.get("value"))
    return found
