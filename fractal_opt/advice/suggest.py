"""``suggest``: read the bottleneck before choosing a fix, then write the recipe that attacks it.

A short baseline (one round of the suite after a warm-up, at most 32 new tokens: under a minute on
the embedded model) is measured as a run's baseline is, and its roofline
(:meth:`~fractal_opt.pipeline.step_measurement.StepMeasurer.roofline`) labels each phase:
compute-, bandwidth-, overhead- or capacity-bound. Each label maps to the passes that attack that
limit (the seed's map, docs/troubleshooting.md):

- overhead-bound decode (far below the bandwidth ceiling): a runtime with fused kernels (llama.cpp),
  compile, threads;
- bandwidth-bound decode: fewer bytes per token (bfloat16 where the hardware has bf16 units,
  int8 weights, a GGUF runtime);
- capacity-bound: KV-cache bits, a context cap, offload;
- compute-bound prefill: fewer prompt tokens (a prompt budget), a prefix cache, flash attention;
- requests served one at a time: continuous batching and a concurrency ramp;
- answers that run to the token cap: a tighter cap (and stop sequences);
- answers that copy the prompt: prompt lookup (speculative tokens drafted from the prompt).

The recipe lists them in tower order, each with a one-line "why"; a pass this machine cannot run
(``unavailable`` / ``check`` / the runtime's ``refuse``) is left out with the reason as a comment.
"""

from __future__ import annotations

import datetime
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from ..core.errors import RecipeError
from ..core.machine import Machine, resolve_device
from ..language.recipe import Recipe, load_recipe
from ..language.targets import parse_targets
from ..layers import get_pass
from ..pipeline.targets import gaps
from ..tower.passes import Layer, Pass
from ..tower.plan import Plan
from ..workloads.workload import Workload

__all__ = ["Advice", "parse_target_arg", "suggest"]

# The short baseline: at most this many new tokens per request, one round after one warm-up.
SHORT_NEW_TOKENS = 32
# Answers that stop at the token cap this often are "long answers": a tighter cap is worth a step.
HIT_CAP_SHARE = 0.5
# Share of an answer's word 3-grams found in its prompt above which the answer "copies the prompt".
COPY_SHARE = 0.3


@dataclass
class Suggestion:
    p: Pass
    why: str
    written: dict[str, Any] = field(default_factory=dict)  # the parameters as the recipe writes them (the ones chosen here)


@dataclass
class Advice:
    """What ``suggest`` found: the baseline's numbers and labels, the passes with their reasons, and what was left out."""

    model: str
    workload: Workload
    baseline: dict[str, Any]
    roofline: dict[str, Any]
    labels: dict[str, str]
    suggestions: list[Suggestion] = field(default_factory=list)
    left_out: list[tuple[str, str]] = field(default_factory=list)
    targets: dict[str, float] = field(default_factory=dict)
    machine: str = ""
    notes: list[str] = field(default_factory=list)

    def to_yaml(self) -> str:
        """The recipe, with the findings and each pass's reason as comments (loads with load_recipe)."""
        b, r = self.baseline, self.roofline
        out = [f"# Suggested by fractal-opt suggest on {datetime.date.today().isoformat()} from a short baseline of {self.model}",
               f"# on this machine ({self.machine}).",
               "# Baseline (plain transformers, float32): " + _numbers(b),
               f"# Decode: {self.labels.get('decode', 'unknown')}" + _decode_detail(r),
               f"# Prefill: {self.labels.get('prefill', 'unknown')}" + _prefill_detail(r),
               ]
        out += [f"# {n}" for n in self.notes]
        out.append("# Run it: fractal-opt run THIS_FILE  (each pass is measured and kept only if it helps here).")
        name = "suggested-" + Path(self.model).name.replace(".gguf", "")
        out.append(yaml.safe_dump({"name": name, "model": self.model}, sort_keys=False).rstrip())
        # The budget the baseline was measured with: the cap and hit-cap advice refer to it.
        wl = {"suite": self.workload.suite, "max_new_tokens": self.baseline.get("max_new_tokens") or self.workload.max_new_tokens,
              "repeats": self.workload.repeats}
        if self.workload.limit:
            wl["limit"] = self.workload.limit
        out.append(yaml.safe_dump({"workload": wl}, sort_keys=False, default_flow_style=None).rstrip())
        if any(s.p.name == "runtime" for s in self.suggestions):
            out += ["policy:",
                    "  guards:",
                    "    # llama.cpp often prefills long prompts slower than transformers on a CPU while it decodes faster;",
                    "    # the default guard (TTFT at most 10% worse) then rolls it back. Uncomment to accept the trade:",
                    "    # ttft_ms: {max_regression: 1.5}",
                    "    kl_mean: {max: 0.05}"]
        if self.targets:
            out.append(yaml.safe_dump({"targets": self.targets}, sort_keys=False, default_flow_style=False).rstrip())
        out.append("passes:")
        for layer in Layer:
            mine = [s for s in self.suggestions if s.p.layer is layer]
            if not mine:
                continue
            out.append(f"  {layer.section}:")
            for s in mine:
                out.append(f"    # {s.why}")
                params = s.written or s.p.params()
                entry = yaml.safe_dump({s.p.name: params}, default_flow_style=True, width=1000, sort_keys=False).strip()[1:-1]
                out.append(f"    - {entry}")
        if self.left_out:
            out.append("# Left out: this machine cannot run them")
            out += [f"#   {what}: {why}" for what, why in self.left_out]
        return "\n".join(out) + "\n"

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        text = self.to_yaml()
        load_recipe(text, check_model=False)  # what is written must load
        path.write_text(text, encoding="utf-8")
        return path

    def recipe(self) -> Recipe:
        return load_recipe(self.to_yaml(), check_model=False)

    def summary(self) -> str:
        lines = [f"Baseline of {self.model}: {_numbers(self.baseline)}",
                 f"  decode: {self.labels.get('decode')}{_decode_detail(self.roofline)}",
                 f"  prefill: {self.labels.get('prefill')}{_prefill_detail(self.roofline)}"]
        if self.targets:
            for m, g in gaps(parse_targets(self.targets), self.baseline).items():
                lines.append(f"  target {m}: {g['text']}")
        lines += [f"  note: {n}" for n in self.notes]
        lines.append("Suggested passes (tower order):")
        lines += [f"  {s.p.layer.section}/{s.p.describe()}: {s.why}" for s in self.suggestions] or ["  none"]
        if self.left_out:
            lines.append("Left out (cannot run here):")
            lines += [f"  {what}: {why}" for what, why in self.left_out]
        return "\n".join(lines)


def parse_target_arg(text: str) -> dict[str, float]:
    """``"decode_tokens_per_s=30,ttft_ms_p90=800"`` -> a validated ``{metric: number}``."""
    out: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if "=" not in part:
            raise RecipeError(f"--targets: {part!r} is not metric=number (e.g. decode_tokens_per_s=30,ttft_ms_p90=800).")
        key, value = (s.strip() for s in part.split("=", 1))
        try:
            out[key] = float(value)
        except ValueError:
            raise RecipeError(f"--targets: {key}={value!r}: expected a number.") from None
    parse_targets(out, where="--targets")
    return out


# ---------------------------------------------------------------------------- measuring

def _baseline(model: str, workload: Workload, machine: Machine, build: Callable[..., Any] | None, limits: Any,
              say: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any], dict[str, str], Any]:
    from .. import runtimes
    from ..measure.machine_limits import probe_limits
    from ..measure.runner import measure
    from ..pipeline.step_measurement import StepMeasurer

    plan = Plan(source=model)
    short = replace(workload, max_new_tokens=min(workload.max_new_tokens, SHORT_NEW_TOKENS), repeats=1, warmup=1, load=None)
    requests = short.requests()
    if limits is None:
        say("suggest: probing the machine's bandwidth and matmul ceilings (cached per machine)")
        limits = probe_limits(resolve_device(plan.hardware.device, machine), machine=machine)
    steps = StepMeasurer(machine=machine, workload=short, requests=requests, min_effect=0.05, limits=limits, progress=say, build=build)
    say(f"suggest: loading {model}")
    engine = (build or runtimes.build)(plan, machine=machine, progress=say, max_new_tokens=short.max_new_tokens)
    try:
        engine.prepare(requests, short)
        say(f"suggest: measuring a short baseline ({len(requests)} requests, {short.max_new_tokens} new tokens)")
        m = measure(engine, short, requests=requests, progress=lambda msg: say(f"suggest:   {msg}"))
        roof = steps.roofline(engine, m)
        summary = dict(m.summary())
        summary["weight_mb"] = round(engine.census().get("weight_bytes", 0) / 2**20, 1)
        summary["copy_share"] = _copy_share(requests, m.texts)
        summary["requests"] = len(requests)
        summary["prompt_tokens_max"] = max((x.prompt_tokens for x in m.samples), default=0)
        summary["max_new_tokens"] = short.max_new_tokens
    finally:
        engine.close()
    labels = {"decode": _plain(roof.get("decode_bound")), "prefill": _plain(roof.get("prefill_bound"))}
    return summary, roof, labels, limits


def _copy_share(requests: list[Any], texts: Mapping[str, str]) -> float:
    """Share of answer word 3-grams that also occur in the prompt (median over requests)."""
    shares = []
    for r in requests:
        answer = (texts.get(r.id) or "").split()
        prompt = " ".join(c for _, c in r.messages).split()
        grams = [tuple(answer[i:i + 3]) for i in range(len(answer) - 2)]
        if not grams:
            continue
        seen = {tuple(prompt[i:i + 3]) for i in range(len(prompt) - 2)}
        shares.append(sum(1 for g in grams if g in seen) / len(grams))
    return round(statistics.median(shares), 3) if shares else 0.0


def _plain(label: str | None) -> str:
    return (label or "unknown").removesuffix("-bound") if label else "unknown"


# ---------------------------------------------------------------------------- choosing

def _candidates(summary: dict[str, Any], roof: dict[str, Any], labels: dict[str, str], machine: Machine, device: str, source: Any) -> list[Suggestion]:
    """The passes that attack the baseline's limits, each with its one-line why (llama.cpp and the
    weight ladder where the model can reach llama.cpp: a GGUF, or a folder the converter knows)."""
    from ..weights.convert import conversion_problem
    from ..weights.ladder import GGUF_METHODS, WEIGHT_TYPES
    from ..weights.ladder import ladder as weight_ladder

    gguf_ready = source.kind in ("embedded", "gguf") or (source.folder is not None and conversion_problem(source.folder) is None)
    ladder = weight_ladder(source) if gguf_ready and source.path is not None else ()
    decode, prefill = labels["decode"], labels["prefill"]
    frac = roof.get("bandwidth_fraction")
    used = f" ({frac:.0%} of the bandwidth ceiling)" if isinstance(frac, int | float) else ""
    out: list[Suggestion] = []

    def add(name: str, params: dict[str, Any], why: str) -> None:
        out.append(Suggestion(get_pass(name).from_params(params, where=f"suggest ({name})"), why, dict(params)))

    gpu = device.startswith("cuda")
    bf16_native = machine.cuda_bf16 if gpu else machine.cpu_native_bf16
    unknown = f"the decode bound could not be labelled ({roof.get('note') or 'no roofline numbers'})"
    if gguf_ready and decode in ("overhead", "bandwidth", "unknown"):
        _llama_cpp(add, decode, used, unknown, machine, gpu)
        for name in ladder[:2]:  # "8 bits first, then 4": the ladder's two widest types below the source's
            add("quantize", {"backend": "gguf", "bits": GGUF_METHODS[name.lower()], "method": name.lower()},
                f"the weight ladder on llama.cpp: {name}, {WEIGHT_TYPES[name].why}; the quality gate (KL, the eval) decides whether it keeps the answers")
    if decode == "overhead":
        add("threads", {"count": "auto"}, "decode is overhead-bound: one thread per physical core avoids spin-waiting hyper-threads")
        if gpu:
            add("compile", {"mode": "reduce-overhead"}, "decode is overhead-bound on a GPU: CUDA graphs remove per-kernel launch cost")
    if decode in ("bandwidth", "unknown"):  # fewer bytes help only where the bytes decide (overhead-bound: dequantizing costs more)
        if bf16_native:
            add("dtype", {"dtype": "bfloat16"}, f"decode is {decode}-bound: bfloat16 halves the bytes read per token and this hardware has bf16 units")
        lead = "decode is bandwidth-bound" if decode == "bandwidth" else unknown
        if not ladder:  # on llama.cpp the weight ladder above is the quantization
            add("quantize", {"bits": 8, "skip": ["lm_head"]}, f"{lead}: int8 weights read a quarter of float32's bytes per token")
    if decode == "capacity" or prefill == "capacity":
        add("kv_cache", {"implementation": "quantized", "bits": 8, "backend": "quanto"}, "memory is capacity-bound: an 8-bit KV cache halves its bytes")
        add("context_cap", {"tokens": 2048}, "memory is capacity-bound: a context cap bounds the KV cache each request may hold")
    longest = summary.get("prompt_tokens_max") or 0
    if prefill == "compute" and longest >= 512:  # short prompts have little to trim; the quality guards judge what is cut
        budget = max(256, longest // 2)
        add("prompt_budget", {"max_tokens": budget}, f"prefill is compute-bound and prompts reach {longest} tokens: a {budget}-token budget halves the FLOPs (older turns go first)")
    if summary.get("requests", 1) > 1:
        add("batching", {"mode": "continuous"}, f"{summary['requests']} requests are served one at a time: continuous batching shares each weight read across sequences")
        add("concurrency", {"mode": "ramp", "start": 2, "max_limit": 16}, "with batching, step the requests in flight up while throughput rises and the guards hold")
    hit = summary.get("hit_cap") or 0.0
    new = summary.get("new_tokens")
    if hit >= HIT_CAP_SHARE and new:
        cap = max(4, int(summary["max_new_tokens"] * 0.75))
        add("max_new_tokens", {"limit": cap}, f"{hit:.0%} of answers ran to the {summary['max_new_tokens']}-token cap: a tighter cap (and stop sequences) ends long answers sooner")
    if (summary.get("copy_share") or 0.0) >= COPY_SHARE:
        add("prompt_lookup", {"num_tokens": 10}, f"answers copy the prompt ({summary['copy_share']:.0%} of their 3-grams are in it): drafting from the prompt accepts several tokens per step")
    return out


def _llama_cpp(add: Callable[..., None], decode: str, used: str, unknown: str, machine: Machine, gpu: bool) -> None:
    """llama.cpp as the model's runtime: its own kernels, the weights widened to BF16, the build for this CPU."""
    why = {"overhead": f"decode is overhead-bound{used}: llama.cpp's fused C++ kernels cut the per-token Python and dispatch cost",
           "bandwidth": f"decode is bandwidth-bound{used}: llama.cpp computes in the GGUF's own weight types, with kernels made for them",
           "unknown": f"{unknown}: llama.cpp attacks both the per-token overhead and the bytes"}[decode]
    add("runtime", {"backend": "llama_cpp"}, why)
    add("runtime", {"backend": "llama_cpp", "dtype": "bfloat16"},
        "the same model on llama.cpp in BF16: half float32's bytes, and where a GGUF's own quantized kernels change answers, this keeps them")
    if not gpu and "avx512f" in machine.cpu_flags:
        # The xllamacpp wheel's CPU kernels are AVX2 only (docs/runtimes.md, "A llama.cpp built for this CPU").
        bf16 = " and AVX512_BF16 (then try dtype bfloat16 on it)" if machine.cpu_native_bf16 else ""
        add("runtime", {"backend": "llama_cpp", "path": "native"},
            f"this CPU has AVX-512{bf16}, which the xllamacpp wheel's kernels do not use: `make setup-llama-native` builds llama-server for it "
            "(about 6 minutes), and this step is skipped with that command until it is built")


def _runnable(suggestions: list[Suggestion], base: Plan, machine: Machine, refuse: Callable[[Plan], str | None]) -> tuple[list[Suggestion], list[tuple[str, str]]]:
    """Keep the passes this machine can run on the base plan or after the earlier suggestions
    (batching before its ramp; the weight ladder after the runtime that serves GGUF files)."""
    from ..pipeline.gate import skip_reason

    keep, left = [], []
    after = base  # the base plan with every suggestion kept so far, in tower order
    for s in suggestions:
        why = skip_reason(s.p, base, machine, refuse=refuse)
        if why is not None and after != base and skip_reason(s.p, after, machine, refuse=refuse) is None:
            why = None
        if why is None:
            keep.append(s)
            after = s.p.apply(after).with_applied(s.p.name)
        else:
            left.append((f"{s.p.layer.section}/{s.p.describe()}", why.removeprefix("check: ")))
    return keep, left


def suggest(model: str, *, workload: str | Workload = "default", targets: Mapping[str, float] | None = None, machine: Machine | None = None,
            build: Callable[..., Any] | None = None, refuse: Callable[[Plan], str | None] | None = None, limits: Any = None,
            progress: Callable[[str], None] | None = None, sample_load: bool = True) -> Advice:
    """Measure a short baseline of ``model`` on ``workload`` (a suite name or file, or a Workload) and
    suggest the passes that attack its bottleneck on this machine."""
    from .. import runtimes
    from ..weights import models

    say = progress or (lambda m: None)
    source = models.resolve(model)
    wl = workload if isinstance(workload, Workload) else Workload(suite=str(workload))
    wl.requests()  # a bad suite fails before any model loads
    if targets:
        parse_targets(dict(targets), where="--targets")
    machine = machine or Machine.probe()
    base = Plan(source=model)
    device = resolve_device(base.hardware.device, machine)
    notes = []
    if sample_load:
        from .doctor import busy_check

        load = busy_check(machine, sample_s=0.5)
        if load.verdict != "ok":
            notes.append(f"The machine was busy when measured ({load.found}): these numbers are noisy; run suggest again on a quiet machine.")
    summary, roof, labels, limits = _baseline(model, wl, machine, build, limits, say)
    candidates = _candidates(summary, roof, labels, machine, device, source)
    keep, left = _runnable(candidates, base, machine, refuse or runtimes.refuse)
    if labels["decode"] == "overhead" and not device.startswith("cuda"):
        notes.append("Not suggested: hardware compile. On a CPU it took ~5 min of start-up for +18% decode on SmolLM2 (docs/passes.md); "
                     "add {compile: {mode: default}} under hardware if start-up time is free.")
    if not keep:
        notes.append("No pass attacks this baseline's limits on this machine: it is as fast as this machine allows for this workload.")
    gpus = ", ".join(machine.cuda_devices) or "no GPU"
    return Advice(model=model, workload=wl, baseline=summary, roofline=roof, labels=labels, suggestions=keep, left_out=left,
                  targets=dict(targets or {}), machine=f"{machine.cpu}, {machine.physical_cores} cores, {gpus}", notes=notes)


def _numbers(b: Mapping[str, Any]) -> str:
    def f(key: str, fmt: str) -> str:
        v = b.get(key)
        return fmt.format(v) if isinstance(v, int | float) else "–"

    return (f"decode {f('decode_tokens_per_s', '{:.1f}')} tok/s, TTFT {f('ttft_ms', '{:.0f}')} ms, e2e {f('e2e_ms', '{:.0f}')} ms, "
            f"throughput {f('throughput_tokens_per_s', '{:.1f}')} tok/s, peak {f('peak_memory_mb', '{:.0f}')} MB, weights {f('weight_mb', '{:.0f}')} MB, "
            f"{(b.get('hit_cap') or 0):.0%} of answers at the cap")


def _decode_detail(r: Mapping[str, Any]) -> str:
    if not isinstance(r.get("achieved_bandwidth_gbs"), int | float):
        return ""
    out = f" ({r['achieved_bandwidth_gbs']:.1f} GB/s achieved"
    if isinstance(r.get("bandwidth_fraction"), int | float):
        out += f", {r['bandwidth_fraction']:.0%} of the ceiling; ceiling {r.get('decode_ceiling_tokens_per_s')} tok/s"
    return out + ")"


def _prefill_detail(r: Mapping[str, Any]) -> str:
    if not isinstance(r.get("achieved_gflops"), int | float):
        return ""
    out = f" ({r['achieved_gflops']:.1f} GFLOP/s achieved"
    if isinstance(r.get("compute_fraction"), int | float):
        out += f", {r['compute_fraction']:.0%} of the matmul ceiling"
    return out + ")"
