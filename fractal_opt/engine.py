"""Engine: turns a Plan into a loaded model that serves requests. The only place with side effects.

``Engine.build(plan)`` loads the model as the plan says (weights are cached by
``Plan.weights_key()``, so a pass that changes only decoding or batching reuses the loaded model),
and ``generate`` / ``stream`` / ``serve`` answer requests as the plan says. Global torch knobs
(threads) are set inside :func:`runtime`, which restores them, so a rolled-back pass cannot leak
into the next measurement. Apps load a tuned deployment with ``Engine.from_recipe("recipe.yaml")``.

Example:
    >>> engine = Engine.from_recipe("fractal-out/recipe.yaml")  # doctest: +SKIP
    >>> engine.generate("What is the capital of France?")       # doctest: +SKIP
    'The capital of France is Paris.'
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import EngineError
from .generation import generate_kwargs
from .loading import census, load
from .machine import Machine
from .measure import TokenClock
from .plan import Plan
from .workload import Request

if TYPE_CHECKING:
    import torch

__all__ = ["Engine", "Generation", "runtime"]

# Loaded (model, tokenizer) pairs by Plan.weights_key(). Two entries: the pipeline alternates
# between the last kept plan and a candidate; more would only hold memory the run needs.
_MODEL_CACHE: OrderedDict[tuple, tuple[Any, Any]] = OrderedDict()
_MODEL_CACHE_SIZE = 2
_DEFAULT_MAX_NEW_TOKENS = 256  # generate() budget when neither the plan nor the caller sets one


@dataclass
class Generation:
    """One served request: the output and the clock readings the measurer needs."""

    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    t_submit: float  # perf_counter() when the request was handed to the engine
    t_prefill_start: float  # when generate() passed the prompt to the streamer (prefill starts)
    token_times: list[float] = field(default_factory=list)  # perf_counter() per generated token
    hit_cap: bool = False  # stopped by the token budget, not by end-of-sequence

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)


def clear_cache() -> None:
    """Drop every cached model (frees memory; the next build loads again)."""
    _MODEL_CACHE.clear()
    import gc

    gc.collect()


@contextlib.contextmanager
def runtime(plan: Plan, machine: Machine | None = None) -> Iterator[None]:
    """Apply the plan's global torch settings for the duration of the block, then restore them."""
    import torch

    before = torch.get_num_threads()
    threads = plan.hardware.threads
    if threads == "auto":
        threads = (machine or Machine.probe()).physical_cores
    try:
        if isinstance(threads, int) and threads != before:
            torch.set_num_threads(threads)
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


class Engine:
    """A loaded model serving requests as a Plan says. Build with :meth:`build` or :meth:`from_recipe`."""

    def __init__(self, plan: Plan, model: Any, tokenizer: Any, *, machine: Machine | None = None, load_s: float = 0.0, max_new_tokens: int | None = None):
        self.plan = plan
        self.model = model
        self.tokenizer = tokenizer
        self.machine = machine
        self.load_s = load_s  # seconds spent loading (0 when the weights came from the cache)
        self.default_max_new_tokens = max_new_tokens or _DEFAULT_MAX_NEW_TOKENS
        self._lock = threading.Lock()  # one generate() at a time on the shared model

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, plan: Plan, *, machine: Machine | None = None, progress=print, max_new_tokens: int | None = None) -> Engine:
        """Load (or reuse) the model for ``plan``. Raises EngineError when quantization did not apply."""
        key = plan.weights_key()
        start = time.perf_counter()
        if key in _MODEL_CACHE:
            _MODEL_CACHE.move_to_end(key)
            model, tokenizer = _MODEL_CACHE[key]
            load_s = 0.0
        else:
            while len(_MODEL_CACHE) >= _MODEL_CACHE_SIZE:
                _MODEL_CACHE.popitem(last=False)
            import gc

            gc.collect()
            model, tokenizer = load(plan, progress=progress)
            load_s = time.perf_counter() - start
            _MODEL_CACHE[key] = (model, tokenizer)
        engine = cls(plan, model, tokenizer, machine=machine, load_s=load_s, max_new_tokens=max_new_tokens)
        if plan.model.weight_bits is not None and engine.census()["quantized_linear_layers"] == 0:
            _MODEL_CACHE.pop(key, None)
            raise EngineError(f"quantization to {plan.model.weight_bits} bits with {plan.model.quant_backend} did not apply: no linear layer holds quantized weights after the build")
        return engine

    @classmethod
    def from_recipe(cls, recipe: Any, *, progress=print) -> Engine:
        """Build the deployment a recipe describes (a path, YAML text, a dict or a Recipe)."""
        from .recipe import load_recipe

        rec = load_recipe(recipe)
        return cls.build(rec.plan(), progress=progress, max_new_tokens=rec.workload.max_new_tokens)

    def census(self) -> dict[str, Any]:
        return census(self.model)

    def close(self) -> None:
        """Forget this engine's model (the cache keeps it until evicted or :func:`clear_cache`)."""
        self.model = None
        self.tokenizer = None

    # ------------------------------------------------------------------ serving
    def generate(self, prompt: str | Sequence[dict[str, str]], *, max_new_tokens: int | None = None) -> str:
        """Answer one prompt (a user message, or a list of chat messages) and return the text."""
        return self.serve([_as_request(prompt)], max_new_tokens=max_new_tokens)[0].text

    def stream(self, prompt: str | Sequence[dict[str, str]], *, max_new_tokens: int | None = None) -> Iterator[str]:
        """Yield the answer's text piece by piece as tokens are generated."""
        from transformers import TextIteratorStreamer

        request = _as_request(prompt)
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        inputs = self._encode([request])
        kwargs = self._generate_kwargs(max_new_tokens)
        errors: list[BaseException] = []

        def work() -> None:
            try:
                with self._lock, runtime(self.plan, self.machine), _no_grad():
                    self.model.generate(**inputs, streamer=streamer, **kwargs)
            except BaseException as e:  # surfaced to the caller below
                errors.append(e)
                streamer.end()

        thread = threading.Thread(target=work, daemon=True)
        thread.start()
        yield from streamer
        thread.join()
        if errors:
            raise EngineError(f"streaming generation failed: {errors[0]}") from errors[0]

    def serve(self, requests: Sequence[Request], *, max_new_tokens: int | None = None, seed: int = 0, sync=None) -> list[Generation]:
        """Serve ``requests`` as the plan's scheduling says, timing every token.

        Sequential plans answer one request at a time; static batching answers left-padded
        batches of up to ``batch_size``. ``seed`` is reset before each generate call.
        """
        size = self.plan.scheduling.batch_size if self.plan.scheduling.batching == "static" else 1
        out: list[Generation] = []
        for i in range(0, len(requests), size):
            out.extend(self._generate_batch(list(requests[i : i + size]), max_new_tokens=max_new_tokens, seed=seed, sync=sync))
        return out

    def next_token_logprobs(self, input_ids: torch.Tensor, *, chunk: int = 512) -> Iterator[torch.Tensor]:
        """Teacher-forced next-token log-probabilities for a 1-D token tensor, yielded in chunks of
        ``[<=chunk, vocab]`` (float32, CPU) so a long text never holds all its logits at once
        (2,048 tokens × 49,152 vocab × 4 bytes would be 400 MB)."""
        import torch
        from transformers import DynamicCache

        with self._lock, runtime(self.plan, self.machine), _no_grad():
            cache = DynamicCache()
            for start in range(0, input_ids.numel(), chunk):
                ids = input_ids[start : start + chunk].view(1, -1).to(self.model.device)
                # transformers 5 calls the cache argument `cache` (`past_key_values` is deprecated);
                # the DynamicCache grows in place, chunk after chunk.
                out = self.model(input_ids=ids, cache=cache, use_cache=True)
                yield torch.log_softmax(out.logits[0].float(), dim=-1).cpu()

    # ------------------------------------------------------------------ internals
    def budget(self, max_new_tokens: int | None) -> int:
        """Tokens a request may generate: the caller's (or default) budget, capped by the plan."""
        budget = max_new_tokens or self.default_max_new_tokens
        cap = self.plan.application.max_new_tokens
        return min(budget, cap) if cap else budget

    def _generate_kwargs(self, max_new_tokens: int | None) -> dict[str, Any]:
        return generate_kwargs(self.plan, self.tokenizer, budget=self.budget(max_new_tokens))

    def _encode(self, requests: Sequence[Request]) -> dict[str, Any]:
        texts = [self._render(r) for r in requests]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return {k: v.to(self.model.device) for k, v in enc.items()}

    def _render(self, request: Request) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(request.as_messages(), add_generation_prompt=True, tokenize=False)
        return "\n".join(content for _, content in request.messages)

    def _generate_batch(self, batch: list[Request], *, max_new_tokens: int | None, seed: int, sync) -> list[Generation]:
        import torch

        t_submit = time.perf_counter()
        inputs = self._encode(batch)
        kwargs = self._generate_kwargs(max_new_tokens)
        clock = TokenClock(sync=sync)
        with self._lock, runtime(self.plan, self.machine), _no_grad():
            torch.manual_seed(seed)
            output = self.model.generate(**inputs, streamer=clock, **kwargs)
        prompt_len = inputs["input_ids"].shape[1]
        eos = _eos_ids(self.model, self.tokenizer)
        results = []
        for row, request in enumerate(batch):
            new = output[row, prompt_len:].tolist()
            n = len(new)
            for j, tok in enumerate(new):
                if tok in eos:
                    n = j + 1  # the end-of-sequence token is generated work; padding after it is not
                    break
            ids = new[:n]
            hit_cap = n == kwargs["max_new_tokens"] and not (ids and ids[-1] in eos)
            results.append(
                Generation(
                    request_id=request.id,
                    text=self.tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True),
                    token_ids=ids,
                    prompt_tokens=int(inputs["attention_mask"][row].sum()),
                    t_submit=t_submit,
                    t_prefill_start=clock.prompt_time if clock.prompt_time is not None else t_submit,
                    token_times=clock.token_times[:n],
                    hit_cap=hit_cap,
                )
            )
        return results


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def _no_grad():
    import torch

    # no_grad rather than inference_mode: some quantized tensor subclasses (quanto int4) fail
    # under inference_mode ("Cannot set version_counter for inference tensor").
    return torch.no_grad()


def _as_request(prompt: str | Sequence[dict[str, str]]) -> Request:
    if isinstance(prompt, str):
        return Request(id="request", messages=(("user", prompt),))
    if isinstance(prompt, Request):
        return prompt
    return Request.from_data({"messages": list(prompt)}, index=0, where="generate()")
