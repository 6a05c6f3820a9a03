"""Engine: turns a Plan into a loaded model that serves requests. The only place with side effects.

``Engine.build(plan)`` loads the model as the plan says (weights are cached by
``Plan.weights_key()``, so a pass that changes only decoding or batching reuses the loaded model),
and ``generate`` / ``stream`` / ``serve`` answer requests as the plan says. Global torch knobs
(threads) are set inside :func:`runtime`, which restores them, so a rolled-back pass cannot leak
into the next measurement. Apps load a tuned deployment with ``fractal_opt.Engine.from_recipe("recipe.yaml")``.

Every request goes through this runtime's servers (static_batch.py, continuous.py; ``serve`` runs
the batch path in the caller's thread), which use the engine only through its public methods:
``encode_prompts``, ``generation_kwargs``, ``exclusive``, ``eos_ids``, ``check_context``.

Example:
    >>> engine = TransformersEngine.build(Plan(source="smollm2-135m-instruct"))  # doctest: +SKIP
    >>> engine.generate("What is the capital of France?")       # doctest: +SKIP
    'The capital of France is Paris.'
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...core.errors import EngineError, RecipeError, RequestRejected, closest
from ...core.machine import Machine
from ...engine.capabilities import refusals
from ...engine.protocol import DEFAULT_MAX_NEW_TOKENS, ContextLimit, Engine, Generation, as_request, tightest
from ...serving.server import Server, in_flight_limit, serve_all
from ...tower.plan import Plan
from ...weights.prompts import prompt_format, prompt_ids
from ...workloads.workload import Request
from .app import AppRuntime, trim_stop
from .capabilities import REFUSALS
from .census import census
from .generate_kwargs import generate_kwargs
from .loading import load
from .torch_knobs import no_grad, runtime

if TYPE_CHECKING:
    import torch

    from ...serving.response_cache import CacheHit
    from ...serving.sampling import Decoding
    from ...workloads.workload import Workload

__all__ = ["Encoded", "TransformersEngine", "clear_cache", "evict_except"]

# Loaded (model, tokenizer) pairs by Plan.weights_key(). Two entries: the pipeline alternates
# between the last kept plan and a candidate; more would only hold memory the run needs.
_MODEL_CACHE: OrderedDict[tuple, tuple[Any, Any]] = OrderedDict()
_MODEL_CACHE_SIZE = 2
MODES = ("sequential", "static", "continuous")
# Tokens per forward pass when the quality probe scores a text through a quantized KV cache: each
# step's positions attend to the earlier ones as the cache stores them (quanto keeps the newest 128
# tokens in full precision, so a 1,024-token text reads most of its context back quantized).
KV_SCORING_STEP = 32


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
        # How a request becomes token ids, the same on every runtime (weights/prompts.py).
        self.prompt_format = prompt_format(tokenizer, plan.application.chat_template) if tokenizer is not None else None
        self.app = AppRuntime(plan, tokenizer, self.prompt_format)  # prompt budget, response cache, draft model

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
        """What the built model holds (weights by storage type, quantized layers), the KV-cache
        arithmetic of the plan, and the thread count it runs with (what an export passes)."""
        return {**census(self.model, self.plan), "threads": self.threads}

    def check_context(self, prompt_tokens: int, budget: int) -> None:
        """Refuse a request whose prompt plus token budget exceeds :meth:`context_limit` (the plan's
        context cap, or the model's own context): no request generates past it.

        Raises:
            RequestRejected: naming both numbers and the ways to fit.
        """
        limit = self.context_limit()
        if limit is not None and prompt_tokens + budget > limit.tokens:
            fix = "raise the context_cap pass's tokens" if self.plan.model.context_cap == limit.tokens else "serve a model with a longer context"
            msg = (
                f"request needs {prompt_tokens + budget} tokens of context ({prompt_tokens} prompt + {budget} new), over {limit}. "
                f"Shorten the prompt (an application-layer prompt_budget pass trims it), lower max_new_tokens, or {fix}."
            )
            raise RequestRejected(msg)

    def context_limit(self) -> ContextLimit | None:
        """The plan's context cap, or the model's own context (its config's max_position_embeddings), whichever is smaller."""
        config = self.model.config.get_text_config() if self.model is not None else None
        positions = getattr(config, "max_position_embeddings", None)
        model = ContextLimit(positions, "the model's context", "its max_position_embeddings") if isinstance(positions, int) and positions > 0 else None
        return tightest(super().context_limit(), model, self._cb_cache())

    def _cb_cache(self) -> ContextLimit | None:
        """Continuous batching's paged KV cache, all requests together: a longer request would wait forever."""
        if self.plan.scheduling.batching != "continuous":
            return None
        from .continuous import cb_cache_tokens

        tokens = cb_cache_tokens(self.plan.scheduling, in_flight=in_flight_limit(self.plan.scheduling), budget=self.budget(None))
        return ContextLimit(tokens, "the continuous batch's KV cache", "scheduling.cb_num_blocks x cb_page_size") if tokens else None

    def count_prompt(self, request: Request, *, limit: int | None = None) -> int:
        """The request's prompt tokens as :meth:`encode_prompts` gives them: the chat template
        rendered, then trimmed by the plan's prompt budget (``limit``: the protocol's shortcut).

        Raises:
            BadRequest: the chat template refuses the messages.
        """
        return self.app.count(request, limit=limit)

    def close(self) -> None:
        """Forget this engine's model (the cache keeps it until evicted or :func:`clear_cache`)."""
        self.model = None
        self.tokenizer = None

    # ------------------------------------------------------------------ measurement's needs
    @property
    def device(self) -> str:
        """Where the model's first weights live (``cuda:0``; the first device of a device_map)."""
        return str(self.model.device) if self.model is not None else super().device

    @property
    def clock_sync(self) -> Callable[[], None] | None:
        """``torch.cuda.synchronize`` for a model on a GPU (kernels run asynchronously), else None."""
        if not self.device.startswith("cuda"):
            return None
        import torch

        return torch.cuda.synchronize

    @property
    def threads(self) -> int:
        """The plan's threads, or torch's intra-op thread count when the plan sets none (or ``auto`` without a machine)."""
        threads = self.plan.hardware.threads
        if isinstance(threads, int) or (threads == "auto" and self.machine is not None):
            return super().threads
        import torch

        return max(1, torch.get_num_threads())

    def encode(self, text: str) -> list[int]:
        """The tokenizer's ids for ``text``, no special tokens added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, request: Request) -> list[int]:
        """The token ids the model receives for ``request`` (weights/prompts.py: rendered once, the same on every runtime)."""
        return prompt_ids(self.tokenizer, self.prompt_format, request.as_messages())

    # ------------------------------------------------------------------ what this runtime can do
    @classmethod
    def refuse(cls, plan: Plan) -> str | None:
        """Why transformers cannot serve ``plan`` as it says, or None.

        Continuous batching would silently ignore some generate() arguments (beams, speculation,
        stop strings, a static cache), and the semantic response cache needs its embedding model.
        """
        bad = refusals(REFUSALS, plan)  # fields other runtimes read (capabilities.py): at their defaults they mean what transformers does anyway
        if bad:
            return "; ".join(bad)
        if plan.scheduling.batching == "continuous":
            from .continuous import cb_unsupported

            if bad := cb_unsupported(plan):
                return f"transformers' continuous batching would ignore the plan's {bad}; use static or sequential batching"
        if plan.application.response_cache == "semantic":
            from ...serving.response_cache import embedder_unavailable

            return embedder_unavailable()
        return None

    def prepare(self, requests: Sequence[Request], workload: Workload) -> dict[str, float]:
        """Compile the decode step before any clock runs, when the plan compiles it.

        Serves the whole suite once at the workload's full budget and seed, so the static cache
        reaches its final size and every shape the measurement needs is compiled: the start-up
        cost a user pays once. Returns ``{"compile_s": seconds}`` (unrounded), or ``{}``.
        """
        if self.plan.hardware.compile is None:
            return {}
        t0 = time.perf_counter()
        self.serve(requests, max_new_tokens=workload.max_new_tokens, seed=workload.seed)
        return {"compile_s": time.perf_counter() - t0}

    # ------------------------------------------------------------------ serving
    def stream(self, prompt: str | Sequence[dict[str, str]], *, max_new_tokens: int | None = None) -> Iterator[str]:
        """Yield the answer's text piece by piece as tokens are generated (through :meth:`server`).

        A cached answer, beam search (transformers cannot stream beams) and a plan with streaming
        off arrive in one piece. Leaving the loop early cancels the request.
        """
        with self.server() as server:
            yield from server.submit(as_request(prompt), max_new_tokens=max_new_tokens).text_deltas()

    def serve(self, requests: Sequence[Request], *, max_new_tokens: int | None = None, seed: int = 0, sync: Callable[[], None] | None = None) -> list[Generation]:
        """Serve ``requests`` as the plan's scheduling says, timing every token.

        Sequential plans answer one request at a time; static batching answers left-padded
        batches of up to ``in_flight_limit(plan)``, each timed from its own start (the server's
        batch path, run in this thread). Continuous batching submits every request at once to a
        server. ``seed`` is the sampling seed of every generate call; :meth:`server` gives apps
        the server directly (queue, timeouts, streaming, cancel).
        """
        if self.plan.scheduling.batching == "continuous":
            return serve_all(self, requests, max_new_tokens=max_new_tokens, seed=seed)  # the server consults the response cache
        from .static_batch import BatchServer

        with BatchServer(self, seed=seed, sync=sync) as server:
            return server.answer(requests, max_new_tokens=max_new_tokens)

    def server(self, *, seed: int = 0, ignore_eos: bool = False) -> Server:
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

    # ------------------------------------------------------------------ response cache (the Server asks)
    def lookup_response(self, request: Request, budget: int, *, ignore_eos: bool = False) -> CacheHit | None:
        """The plan's response cache answer for ``request`` (None: a miss, or no cache)."""
        return self.app.lookup(request, budget, ignore_eos=ignore_eos)

    def store_response(self, request: Request, budget: int, value: dict[str, Any], *, ignore_eos: bool = False) -> None:
        """Remember a finished answer in the plan's response cache (a no-op without one)."""
        self.app.store(request, budget, value, ignore_eos=ignore_eos)

    def reset_response_cache(self) -> None:
        """Empty the plan's response cache and its counters (measure() does it before every pass over a suite)."""
        if self.app.cache is not None:
            self.app.cache.clear()

    def cache_stats(self) -> dict[str, int] | None:
        """The response cache's counters (exact_hits, semantic_hits, misses, ...), or None without a cache."""
        return self.app.cache.stats() if self.app.cache is not None else None

    # ------------------------------------------------------------------ what this runtime's servers use
    def encode_prompts(self, requests: Sequence[Request]) -> Encoded:
        """The requests' prompts, chat template and prompt budget applied, as one left-padded batch on the model's device."""
        ids, saved = [], []
        for request in requests:
            fitted, n = self.app.fit_counted(request)  # the plan's prompt budget (a no-op without one)
            ids.append(self.prompt_ids(fitted))
            saved.append(n)
        enc = self.tokenizer.pad({"input_ids": ids}, return_tensors="pt", padding=True)  # left-padded (loading.py)
        inputs = {k: v.to(self.model.device) for k, v in enc.items()}
        prompt_tokens = [int(n) for n in enc["attention_mask"].sum(dim=1).tolist()]  # padding excluded
        return Encoded(inputs=inputs, prompt_tokens=prompt_tokens, saved=saved)

    def generation_kwargs(self, max_new_tokens: int | None, decoding: Decoding | None = None) -> dict[str, Any]:
        """``model.generate`` arguments for the plan, with the budget :meth:`budget` gives ``max_new_tokens``
        (``decoding``: a request's own sampling instead of the plan's)."""
        return generate_kwargs(self.plan, self.tokenizer, budget=self.budget(max_new_tokens), decoding=decoding) | self.app.generate_extras()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the model for the block: one generate at a time on the shared model, the plan's
        torch knobs set (and restored after), no autograd."""
        with self._lock, runtime(self.plan, self.machine), no_grad():
            yield

    def eos_ids(self) -> frozenset[int]:
        """Every token id that ends a sequence: the generation config's and the tokenizer's."""
        eos = self.model.generation_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The answer's text: end-of-sequence tokens left out, cut before the plan's first stop sequence."""
        eos = self.eos_ids()
        text = self.tokenizer.decode([t for t in token_ids if t not in eos], skip_special_tokens=True)
        stops = self.plan.application.stop
        return trim_stop(text, stops) if stops else text

    # ------------------------------------------------------------------ inspection
    def next_token_logprobs(self, input_ids: torch.Tensor, *, chunk: int = 512) -> Iterator[torch.Tensor]:
        """Teacher-forced next-token log-probabilities for a 1-D token tensor, yielded in chunks of
        ``[<=chunk, vocab]`` (float32, CPU) so a long text never holds all its logits at once
        (2,048 tokens × 49,152 vocab × 4 bytes would be 400 MB).

        The text is fed through the plan's own KV cache: with a quantized cache, in steps of
        :data:`KV_SCORING_STEP` tokens, so every position attends to earlier ones read back from
        the quantized cache, as decoding does (one pass over the whole text would attend to the
        exact keys and values it just computed, and the KL would never see the cache)."""
        import torch

        with self.exclusive():
            cache, step = self._scoring_cache(chunk)
            rows: list[torch.Tensor] = []
            for start in range(0, input_ids.numel(), step):
                ids = input_ids[start : start + step].view(1, -1).to(self.model.device)
                # transformers 5 calls the cache argument `cache` (`past_key_values` is deprecated);
                # the cache grows in place, step after step.
                out = self.model(input_ids=ids, cache=cache, use_cache=True)
                rows.append(torch.log_softmax(out.logits[0].float(), dim=-1).cpu())
                if sum(r.shape[0] for r in rows) >= chunk or start + step >= input_ids.numel():
                    yield torch.cat(rows)
                    rows = []

    def _scoring_cache(self, chunk: int) -> tuple[Any, int]:
        """The cache the plan decodes with, and the tokens fed per forward pass when scoring a text."""
        from transformers import DynamicCache, QuantizedCache

        m = self.plan.model
        if m.kv_cache == "quantized":
            config = self.model.config.get_text_config(decoder=True)
            return QuantizedCache(backend=m.kv_backend or "quanto", config=config, nbits=m.kv_bits or 4), KV_SCORING_STEP
        return DynamicCache(), chunk  # dynamic, static and offloaded caches hold the exact keys and values

@dataclass(frozen=True)
class Encoded:
    """Prompts encoded for one generate call.

    Attributes:
        inputs: ``input_ids`` and ``attention_mask``, ``[batch, longest prompt]``, left-padded, on the model's device.
        prompt_tokens: each row's prompt tokens, padding excluded.
        saved: each row's prompt tokens the plan's prompt budget removed.
    """

    inputs: dict[str, Any]
    prompt_tokens: list[int]
    saved: list[int]
