"""The Engine protocol: all the rest of the house may ask of a loaded deployment.

Measurement, quality, serving and the runner import only this module; each runtime
(:mod:`fractal_opt.runtimes`) implements it. A runtime maps the plan's fields onto its own settings
or refuses them in :meth:`Engine.refuse` (the runner calls it after the pass's own ``check``, and a
refused step is ``skipped`` with that reason, never silently ignored).

Example:
    >>> from fractal_opt.runtimes import build                        # doctest: +SKIP
    >>> engine = build(Plan(source="smollm2-135m-instruct"))           # doctest: +SKIP
    >>> engine.generate("What is the capital of France?")              # doctest: +SKIP
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..workloads.workload import Request

if TYPE_CHECKING:
    from ..core.machine import Machine
    from ..tower.plan import Plan
    from ..workloads.workload import Workload

__all__ = ["DEFAULT_MAX_NEW_TOKENS", "ContextLimit", "Engine", "Generation", "as_request", "tightest"]

DEFAULT_MAX_NEW_TOKENS = 256  # generate() budget when neither the plan nor the caller sets one


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
    cache_hit: str | None = None  # "exact" / "semantic" when the response cache answered (no generate call)
    prompt_tokens_saved: int = 0  # prompt tokens the plan's prompt budget removed
    streamed: bool = True  # False for beam search: no per-token clock, only t_done
    t_done: float | None = None  # perf_counter() when the answer was complete

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class ContextLimit:
    """The tokens one request may hold, prompt and answer together, and what sets that number.

    ``what`` names it for a user ("this deployment's context cap", "the model's context"), ``where``
    says where the number comes from or is set ("the context_cap pass", "its max_position_embeddings").

    Example:
        >>> str(ContextLimit(4096, "the model's context", "its max_position_embeddings"))
        "the model's context of 4,096 tokens (its max_position_embeddings)"
    """

    tokens: int
    what: str
    where: str = ""

    def __str__(self) -> str:
        return f"{self.what} of {self.tokens:,} tokens" + (f" ({self.where})" if self.where else "")


def tightest(*limits: ContextLimit | None) -> ContextLimit | None:
    """The smallest of ``limits`` (None when none is known)."""
    known = [limit for limit in limits if limit is not None]
    return min(known, key=lambda limit: limit.tokens) if known else None


class Engine(abc.ABC):
    """A loaded deployment serving requests as its Plan says.

    Attributes:
        plan: the plan it was built from.
        machine: the probed machine (None in tests that need none).
        load_s: seconds spent loading (0 when the weights came from a cache).
        default_max_new_tokens: the budget of a request that names none.
        model: the runtime's handle on what it loaded (a torch module, a llama.cpp server, a URL),
            None once closed. Only the runtime looks inside it; the rest of the house asks
            :attr:`closed`.
    """

    plan: Plan
    machine: Machine | None
    load_s: float
    default_max_new_tokens: int
    model: Any

    # ------------------------------------------------------------------ what a runtime can do
    @classmethod
    def refuse(cls, plan: Plan) -> str | None:
        """Why this runtime cannot honour ``plan`` (a field it cannot map), or None."""
        return None

    def activate(self) -> float:
        """Make this engine ready to compute, before a timed round: a runtime whose loaded models
        slow each other down while resident (llama.cpp servers in one process) releases the others
        and reloads this one. Returns the seconds that took, untimed by the measurement. Default: 0."""
        return 0.0

    def prepare(self, requests: Sequence[Request], workload: Workload) -> dict[str, float]:
        """Start-up work a user pays once before serving (compiling, warming caches), untimed by the
        measurement; returns the timings to show (e.g. ``{"compile_s": 41.0}``). Default: none."""
        return {}

    # ------------------------------------------------------------------ serving
    @abc.abstractmethod
    def serve(self, requests: Sequence[Request], *, max_new_tokens: int | None = None, seed: int = 0, sync: Any = None) -> list[Generation]:
        """Serve ``requests`` as the plan's scheduling says, with a clock reading per token."""

    @abc.abstractmethod
    def stream(self, prompt: str | Sequence[dict[str, str]], *, max_new_tokens: int | None = None) -> Iterator[str]:
        """Yield the answer's text piece by piece as tokens are generated."""

    @abc.abstractmethod
    def server(self, *, seed: int = 0, ignore_eos: bool = False) -> Any:
        """A request server (:class:`fractal_opt.serving.server.Server`) scheduled as the plan says."""

    def generate(self, prompt: str | Sequence[dict[str, str]], *, max_new_tokens: int | None = None) -> str:
        """Answer one prompt (a user message, or a list of chat messages) and return the text."""
        return self.serve([as_request(prompt)], max_new_tokens=max_new_tokens)[0].text

    def context_limit(self) -> ContextLimit | None:
        """The tokens one request may hold, prompt and answer together: the tightest of the plan's
        context cap and what the runtime knows of the model and its cache. None when nothing is
        known (a request is then bounded by its token budget alone).

        Default: the plan's ``model.context_cap``; a runtime adds the model's own context."""
        cap = self.plan.model.context_cap
        return ContextLimit(cap, "this deployment's context cap", "the context_cap pass") if cap else None

    def count_prompt(self, request: Request, *, limit: int | None = None) -> int | None:
        """The prompt tokens of ``request`` as the model will read them: its messages rendered as
        this engine renders them (the chat template included) and trimmed by the plan's prompt
        budget, if it has one. The one place serving counts a prompt (``fractal-opt serve``
        refuses a prompt over :meth:`context_limit` with it, before any compute).

        ``limit``: a prompt certain to hold more tokens than this from its size alone may be
        answered without tokenizing it, with a floor above ``limit``
        (:class:`fractal_opt.serving.prompting.AtLeast`).

        Default: the length of :meth:`prompt_ids`, or None where the engine renders no prompts (the
        runtime then refuses an oversized prompt itself).

        Raises:
            BadRequest: the model's chat template refuses the messages (``param`` "messages").
        """
        try:
            return len(self.prompt_ids(request))
        except NotImplementedError:
            return None

    def budget(self, max_new_tokens: int | None) -> int:
        """Tokens a request may generate: the caller's (or default) budget, capped by the plan."""
        budget = max_new_tokens or self.default_max_new_tokens
        cap = self.plan.application.max_new_tokens
        return min(budget, cap) if cap else budget

    # ------------------------------------------------------------------ inspection
    @abc.abstractmethod
    def census(self) -> dict[str, Any]:
        """What was built: at least ``weight_bytes`` and ``quantized_linear_layers``."""

    def next_token_logprobs(self, input_ids: Any, *, chunk: int = 512) -> Iterator[Any]:
        """Teacher-forced next-token log-probabilities for a 1-D token tensor, in ``[<=chunk, vocab]``
        pieces (the quality probes' KL and flip rate). A runtime that cannot give them raises."""
        raise NotImplementedError(f"{type(self).__name__} gives no teacher-forced log-probabilities")

    def top_logprobs(self, input_ids: Sequence[int], *, k: int) -> list[dict[int, float]]:
        """Teacher-forced top-``k`` next-token log-probabilities, one row per position of
        ``input_ids``: row ``j`` maps the ``k`` most likely tokens after ``input_ids[:j + 1]`` to
        their log-probabilities under the full softmax. A row may hold a few more known entries (vLLM
        adds the position's actual next token). The quality probes' fallback for a runtime that
        gives no full distributions (top-1 flips exactly, a lower bound on KL).

        Default: the top ``k`` of :meth:`next_token_logprobs`; a runtime that gives neither raises
        NotImplementedError.
        """
        import torch

        rows: list[dict[int, float]] = []
        for lp in self.next_token_logprobs(torch.as_tensor(list(input_ids), dtype=torch.long)):
            values, indices = lp.topk(min(k, lp.shape[-1]), dim=-1)
            rows.extend(dict(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist()))
        return rows

    def token_logprobs(self, input_ids: Sequence[int], tokens: Sequence[Sequence[int]]) -> list[dict[int, float]]:
        """Exact teacher-forced log-probabilities of chosen tokens: row ``j`` maps each token of
        ``tokens[j]`` to its log-probability after ``input_ids[:j + 1]`` under the full softmax (a
        row may hold a few more known entries). ``len(tokens)`` rows, at most ``len(input_ids)``.
        The quality probes' exact path on a runtime without cheap whole distributions (llama.cpp).

        Default: read off :meth:`next_token_logprobs`; a runtime that gives neither raises
        NotImplementedError.
        """
        import torch

        rows: list[dict[int, float]] = []
        for lp in self.next_token_logprobs(torch.as_tensor(list(input_ids), dtype=torch.long)):
            for row in lp[: len(tokens) - len(rows)]:
                chosen = list(tokens[len(rows)])
                rows.append(dict(zip(chosen, row[chosen].tolist())))
            if len(rows) >= len(tokens):
                break
        return rows

    def reset_response_cache(self) -> None:
        """Empty the plan's response cache and its counters (a no-op without one)."""

    def cache_stats(self) -> dict[str, int] | None:
        """The response cache's counters, or None without a cache."""
        return None

    # ------------------------------------------------------------------ measurement's needs
    # What measurement (fractal_opt.measure) and the quality probes ask of every runtime. The
    # defaults fit a runtime whose results are ready when a call returns (a CPU, another process).
    @property
    def device(self) -> str:
        """The device the model runs on ("cpu", "cuda:0", "mps"): whose memory a measurement watches."""
        from ..core.machine import resolve_device

        return resolve_device(self.plan.hardware.device, self.machine)

    @property
    def clock_sync(self) -> Callable[[], None] | None:
        """What waits for the device's queued work before the clock is read (``torch.cuda.synchronize``
        for a model on a GPU in this process); None where results are ready when a call returns."""
        return None

    @property
    def threads(self) -> int:
        """The CPU threads the plan runs with (what ``cpu_utilization`` divides by): the plan's
        number, the physical cores for ``auto``, else the runtime's default (torch's, when probed)."""
        threads = self.plan.hardware.threads
        if isinstance(threads, int):
            return threads
        if threads == "auto" and self.machine is not None:
            return self.machine.physical_cores
        probed = self.machine.torch_threads if self.machine is not None else None
        return max(1, probed or os.cpu_count() or 1)

    def health(self) -> str | None:
        """Why this engine cannot serve a request now (closed, a child server gone or restarting),
        or None when it can; ``fractal-opt serve``'s /health answers 503 with it.

        Raises:
            EngineError: it never will again (a child server that could not be restarted): a
                server process should exit, for its supervisor to start a fresh one.
        """
        return "the engine is closed" if self.closed else None

    def server_pids(self) -> list[int]:
        """Processes that serve this engine's requests besides this one (a child server): their
        peak memory and CPU time count in the measurement. Empty by default (in-process runtimes)."""
        return []

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` as this deployment's tokenizer reads it, no special tokens added
        (the quality probes score the reference text with them). A runtime without one raises."""
        raise NotImplementedError(f"{type(self).__name__} gives no tokenizer to encode text with")

    def prompt_ids(self, request: Request) -> list[int]:
        """The token ids the model receives for ``request``: rendered once by fractal_opt from the
        model's chat template, or as plain completion text for a model without one
        (:mod:`fractal_opt.weights.prompts`), the same on every runtime. A runtime without a
        tokenizer raises."""
        raise NotImplementedError(f"{type(self).__name__} gives no tokenizer to render prompts with")

    # ------------------------------------------------------------------ serving's needs
    # What the runtime-agnostic request server (fractal_opt.serving.server) asks of every runtime.
    # The defaults fit a runtime without a response cache whose server decodes text itself.
    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran: a closed engine serves nothing (a Server refuses to start)."""
        return self.model is None

    def decode(self, token_ids: Sequence[int]) -> str:
        """The answer's text for generated ``token_ids``: end-of-sequence tokens left out, cut before
        the plan's first stop sequence. A runtime whose server keeps the streamed text raises."""
        raise NotImplementedError(f"{type(self).__name__} decodes no token ids; its server keeps the text")

    def lookup_response(self, request: Request, budget: int, *, ignore_eos: bool = False) -> Any | None:
        """The plan's response cache answer for ``request`` under ``budget`` (None: a miss, or no
        cache): an object with ``value`` (what :meth:`store_response` stored: ``text``,
        ``token_ids``, ``prompt_tokens``, ``hit_cap``) and ``kind`` (``"exact"`` / ``"semantic"``).
        ``ignore_eos`` answers are kept apart: they run past end-of-sequence, so they are others."""
        return None

    def store_response(self, request: Request, budget: int, value: dict[str, Any], *, ignore_eos: bool = False) -> None:
        """Remember a finished answer in the plan's response cache (a no-op without one)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release what this engine holds (a server process, a model reference)."""


def as_request(prompt: str | Request | Sequence[dict[str, str]], *, where: str = "generate()") -> Request:
    """A Request from a user message, a Request, or a list of chat messages.

    Raises:
        RecipeError: the messages are not ``{"role", "content"}`` mappings (named after ``where``).
    """
    if isinstance(prompt, str):
        return Request(id="request", messages=(("user", prompt),))
    if isinstance(prompt, Request):
        return prompt
    return Request.from_data({"messages": list(prompt)}, index=0, where=where)
