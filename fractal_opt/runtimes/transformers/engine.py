"""Engine: turns a Plan into a loaded model that serves requests. The only place with side effects.

``Engine.build(plan)`` loads the model as the plan says (weights are cached by
``Plan.weights_key()``, so a pass that changes only decoding or batching reuses the loaded model),
and ``generate`` / ``stream`` / ``serve`` answer requests as the plan says. Global torch knobs
(threads) are set inside :func:`runtime`, which restores them, so a rolled-back pass cannot leak
into the next measurement. Apps load a tuned deployment with ``fractal_opt.Engine.from_recipe("recipe.yaml")``.

Example:
    >>> engine = TransformersEngine.build(Plan(source="smollm2-135m-instruct"))  # doctest: +SKIP
    >>> engine.generate("What is the capital of France?")       # doctest: +SKIP
    'The capital of France is Paris.'
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ...engine.protocol import DEFAULT_MAX_NEW_TOKENS, Engine, Generation, as_request
from ...errors import EngineError, RecipeError, RequestRejected, closest
from ...machine import Machine
from ...measure.clock import TokenClock
from ...plan import Plan
from ...workload import Request
from .app import AppRuntime, trim_stop
from .generate_kwargs import generate_kwargs, uses_streamer
from .loading import census, load
from .torch_knobs import no_grad, runtime

if TYPE_CHECKING:
    import torch

__all__ = ["TransformersEngine", "clear_cache", "eos_ids", "evict_except"]

# Loaded (model, tokenizer) pairs by Plan.weights_key(). Two entries: the pipeline alternates
# between the last kept plan and a candidate; more would only hold memory the run needs.
_MODEL_CACHE: OrderedDict[tuple, tuple[Any, Any]] = OrderedDict()
_MODEL_CACHE_SIZE = 2
MODES = ("sequential", "static", "continuous")


def evict_except(keep: set[tuple]) -> None:
    """Drop cached models whose ``Plan.weights_key()`` is not in ``keep``, so a rolled-back
    candidate's weights do not stay resident and inflate the next measurements' memory."""
    for key in [k for k in _MODEL_CACHE if k not in keep]:
        del _MODEL_CACHE[key]
    import gc

    gc.collect()


def clear_cache() -> None:
    """Drop every cached model (frees memory; the next build loads again)."""
    _MODEL_CACHE.clear()
    import gc

    gc.collect()


class TransformersEngine(Engine):
    """A Hugging Face transformers model serving requests as a Plan says (the baseline runtime).

    Build with :func:`fractal_opt.runtimes.build` (or ``TransformersEngine.build``)."""

    def __init__(self, plan: Plan, model: Any, tokenizer: Any, *, machine: Machine | None = None, load_s: float = 0.0, max_new_tokens: int | None = None):
        self.plan = plan
        self.model = model
        self.tokenizer = tokenizer
        self.machine = machine
        self.load_s = load_s  # seconds spent loading (0 when the weights came from the cache)
        self.default_max_new_tokens = max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        self._lock = threading.Lock()  # one generate() at a time on the shared model
        self.app = AppRuntime(plan, tokenizer)  # prompt budget, response cache, draft model

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(cls, plan: Plan, *, machine: Machine | None = None, progress=print, max_new_tokens: int | None = None) -> TransformersEngine:
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
        engine.app.prepare(tokenizer, progress=progress)  # draft / embedding models load before any clock runs
        return engine

    def census(self) -> dict[str, Any]:
        """What the built model holds (weights by storage type, quantized layers) and the KV-cache arithmetic of the plan."""
        return census(self.model, self.plan)

    def check_context(self, prompt_tokens: int, budget: int) -> None:
        """Refuse a request whose prompt plus token budget exceeds the plan's context cap.

        Raises:
            RequestRejected: naming both numbers and the ways to fit.
        """
        cap = self.plan.model.context_cap
        if cap is not None and prompt_tokens + budget > cap:
            msg = (
                f"request needs {prompt_tokens + budget} tokens of context ({prompt_tokens} prompt + {budget} new), over this "
                f"deployment's context cap of {cap}. Shorten the prompt (an application-layer prompt_budget pass trims it), "
                "lower max_new_tokens, or raise the context_cap pass's tokens."
            )
            raise RequestRejected(msg)

    def close(self) -> None:
        """Forget this engine's model (the cache keeps it until evicted or :func:`clear_cache`)."""
        self.model = None
        self.tokenizer = None

    # ------------------------------------------------------------------ serving
    def stream(self, prompt: str | Sequence[dict[str, str]], *, max_new_tokens: int | None = None) -> Iterator[str]:
        """Yield the answer's text piece by piece as tokens are generated."""
        from transformers import TextIteratorStreamer

        request = as_request(prompt)
        if self.app.cache is not None or not uses_streamer(self.plan) or self.plan.application.stop:
            # A cached answer, beam search (transformers cannot stream beams) and stop sequences
            # (the text is cut after generation) arrive in one piece.
            yield self.serve([request], max_new_tokens=max_new_tokens)[0].text
            return
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        inputs = self._encode([request])
        kwargs = self._generate_kwargs(max_new_tokens)
        self._check_rows(inputs, kwargs["max_new_tokens"])
        errors: list[BaseException] = []

        def work() -> None:
            try:
                with self._lock, runtime(self.plan, self.machine), no_grad():
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
        Continuous batching submits every request at once to a server (fractal_opt.serving);
        :meth:`server` gives apps that server directly (queue, timeouts, streaming, cancel).
        """
        if self.plan.scheduling.batching == "continuous":
            from ...serving.server import serve_all

            return serve_all(self, requests, max_new_tokens=max_new_tokens, seed=seed)  # the server consults the response cache
        size = self.plan.scheduling.batch_size if self.plan.scheduling.batching == "static" else 1
        out: list[Generation] = []
        for i in range(0, len(requests), size):
            batch = list(requests[i : i + size])
            out.extend(self._answer(batch, max_new_tokens, lambda todo, t0: self._generate_batch(todo, max_new_tokens=max_new_tokens, seed=seed, sync=sync, t_submit=t0)))
        return out

    def reset_response_cache(self) -> None:
        """Empty the plan's response cache and its counters (measure() does it before every pass over a suite)."""
        if self.app.cache is not None:
            self.app.cache.clear()

    def cache_stats(self) -> dict[str, int] | None:
        """The response cache's counters (exact_hits, semantic_hits, misses, ...), or None without a cache."""
        return self.app.cache.stats() if self.app.cache is not None else None

    def _answer(self, batch: list[Request], max_new_tokens: int | None, run) -> list[Generation]:
        """Answer ``batch`` from the response cache where it can, and with ``run(misses, t_submit)`` otherwise.

        Cache hits are timed like requests: submitted at ``t0``, with every token available at the
        moment the lookup returned (so TTFT = e2e = lookup time; no decode rate). Misses carry
        their lookup time too, because their clock also starts at ``t0``.
        """
        if self.app.cache is None:
            return run(batch, None)
        t0 = time.perf_counter()
        budget = self.budget(max_new_tokens)
        answers: list[Generation | None] = []
        for request in batch:
            hit = self.app.lookup(request, budget)
            if hit is None:
                answers.append(None)
                continue
            now, v = time.perf_counter(), hit.value
            answers.append(
                Generation(
                    request_id=request.id, text=v["text"], token_ids=list(v["token_ids"]), prompt_tokens=v["prompt_tokens"],
                    t_submit=t0, t_prefill_start=now, token_times=[now] * len(v["token_ids"]), hit_cap=v["hit_cap"],
                    cache_hit=hit.kind, t_done=now,
                )
            )
        misses = [r for r, a in zip(batch, answers) if a is None]
        generated = iter(run(misses, t0) if misses else [])
        out = []
        for request, answer in zip(batch, answers):
            if answer is None:
                answer = next(generated)
                value = {"text": answer.text, "token_ids": list(answer.token_ids), "prompt_tokens": answer.prompt_tokens, "hit_cap": answer.hit_cap}
                self.app.store(request, budget, value)
            out.append(answer)
        return out

    def server(self, *, seed: int = 0, ignore_eos: bool = False):
        """A request server scheduled as the plan says (``plan.scheduling.batching``).

        A continuous-batching server holds the engine's model until it is closed (other calls on the
        same engine wait); sequential and static servers take it per batch. With a response cache in
        the plan, ``submit`` answers a cached request at once (the ticket ends ``done`` with
        ``cache_hit`` set, never queued) and every request that ends ``done`` is stored.

        Raises:
            RecipeError: an unknown batching mode, with the valid ones and the closest match.
        """
        mode = self.plan.scheduling.batching
        if mode in ("sequential", "static"):
            from .static_batch import BatchServer

            return BatchServer(self, seed=seed, ignore_eos=ignore_eos)
        if mode == "continuous":
            from .continuous import ContinuousServer

            return ContinuousServer(self, seed=seed, ignore_eos=ignore_eos)
        raise RecipeError(f"plan.scheduling.batching: unknown mode {mode!r}. Valid modes are: {list(MODES)}.{closest(mode, MODES)}")

    def next_token_logprobs(self, input_ids: torch.Tensor, *, chunk: int = 512) -> Iterator[torch.Tensor]:
        """Teacher-forced next-token log-probabilities for a 1-D token tensor, yielded in chunks of
        ``[<=chunk, vocab]`` (float32, CPU) so a long text never holds all its logits at once
        (2,048 tokens × 49,152 vocab × 4 bytes would be 400 MB)."""
        import torch
        from transformers import DynamicCache

        with self._lock, runtime(self.plan, self.machine), no_grad():
            cache = DynamicCache()
            for start in range(0, input_ids.numel(), chunk):
                ids = input_ids[start : start + chunk].view(1, -1).to(self.model.device)
                # transformers 5 calls the cache argument `cache` (`past_key_values` is deprecated);
                # the DynamicCache grows in place, chunk after chunk.
                out = self.model(input_ids=ids, cache=cache, use_cache=True)
                yield torch.log_softmax(out.logits[0].float(), dim=-1).cpu()

    # ------------------------------------------------------------------ internals
    def _generate_kwargs(self, max_new_tokens: int | None) -> dict[str, Any]:
        return generate_kwargs(self.plan, self.tokenizer, budget=self.budget(max_new_tokens)) | self.app.generate_extras()

    def _check_rows(self, inputs: dict[str, Any], budget: int) -> None:
        if self.plan.model.context_cap is not None:
            for n in inputs["attention_mask"].sum(dim=1).tolist():  # prompt tokens per row, padding excluded
                self.check_context(int(n), budget)

    def _encode(self, requests: Sequence[Request]) -> dict[str, Any]:
        texts = [self._render(r) for r in requests]
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return {k: v.to(self.model.device) for k, v in enc.items()}

    def _render(self, request: Request) -> str:
        request = self.app.fit(request)  # the plan's prompt budget (a no-op without one)
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(request.as_messages(), add_generation_prompt=True, tokenize=False)
        return "\n".join(content for _, content in request.messages)

    def _generate_batch(self, batch: list[Request], *, max_new_tokens: int | None, seed: int, sync, t_submit: float | None = None) -> list[Generation]:
        import torch

        t_submit = time.perf_counter() if t_submit is None else t_submit
        inputs = self._encode(batch)
        kwargs = self._generate_kwargs(max_new_tokens)
        self._check_rows(inputs, kwargs["max_new_tokens"])
        # Beam search cannot stream in transformers: such requests are timed end to end only.
        clock = TokenClock(sync=sync) if uses_streamer(self.plan) else None
        with self._lock, runtime(self.plan, self.machine), no_grad():
            torch.manual_seed(seed)
            output = self.model.generate(**inputs, streamer=clock, **kwargs)
        if sync is not None:
            sync()
        t_done = time.perf_counter()
        prompt_len = inputs["input_ids"].shape[1]
        eos = eos_ids(self.model, self.tokenizer)
        stops = self.plan.application.stop
        results = []
        for row, request in enumerate(batch):
            new = output[row, prompt_len:].tolist()
            n = len(new)
            for j, tok in enumerate(new):
                if tok in eos:
                    n = j + 1  # the end-of-sequence token is generated work; padding after it is not
                    break
            if stops and len(batch) > 1:
                # A row that ended on a stop sequence is padded to the batch's longest row.
                while n and new[n - 1] == self.tokenizer.pad_token_id:
                    n -= 1
            ids = new[:n]
            hit_cap = n == kwargs["max_new_tokens"] and not (ids and ids[-1] in eos)
            text = self.tokenizer.decode([t for t in ids if t not in eos], skip_special_tokens=True)
            results.append(
                Generation(
                    request_id=request.id,
                    text=trim_stop(text, stops) if stops else text,
                    token_ids=ids,
                    prompt_tokens=int(inputs["attention_mask"][row].sum()),
                    t_submit=t_submit,
                    t_prefill_start=clock.prompt_time if clock is not None and clock.prompt_time is not None else t_submit,
                    token_times=clock.token_times[:n] if clock is not None else [],
                    hit_cap=hit_cap,
                    prompt_tokens_saved=self.app.saved.get(request.id, 0),
                    streamed=clock is not None,
                    t_done=t_done,
                )
            )
        return results


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
