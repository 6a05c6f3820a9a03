"""LlamaCppEngine: the Engine protocol on llama.cpp's server, in this process through ``xllamacpp``,
or as a ``llama-server`` child process when the plan names one (``hardware.runtime_path``, :mod:`.process`).

``xllamacpp.Server`` is llama.cpp's HTTP server without the HTTP: ``handle_completions(body,
callback)`` blocks the calling thread while llama.cpp's own loop (continuous batching over
``n_parallel`` slots) produces the answer to a token-id prompt (rendered once by fractal_opt from
the model's own template, :mod:`fractal_opt.weights.prompts`: llama.cpp applies no chat template of
its own), and calls ``callback`` with one OpenAI-style chunk per streamed token. The server is thread-safe, so concurrency is one
calling thread per slot (:mod:`.server`). The clock is read in the callback, the moment a token
reaches Python: that is when a caller could see it.

Loaded servers are cached by their load-time settings (:class:`.settings.ServerSettings`): a pass
that changes decoding, stops or budgets reuses the loaded model, as in the transformers runtime.

One server is resident at a time. Two llama.cpp servers in one process share one OpenMP runtime
(libgomp), which counts the threads of both: once they outnumber the cores it cuts every thread's
spin-wait between kernels to almost nothing, and the server that computes decodes at less than
half its speed although the other is idle (measured: 82.9 -> 34.2 tok/s on the embedded model,
2 threads on 2 cores, with a second server loaded and idle; back to 81.5 once it was dropped). A
server on its own is what a deployment runs, so an engine holds a :class:`_Resident` handle that
loads its server on demand and drops the other one: :meth:`LlamaCppEngine.activate`, which the
measurement calls before every round (a reload from the page cache takes ~0.5 s for this model).

Example:
    >>> from fractal_opt.tower.plan import Plan, HardwarePlan                                # doctest: +SKIP
    >>> engine = LlamaCppEngine.build(Plan(source="smollm2-135m-instruct",
    ...                                    hardware=HardwarePlan(runtime="llama_cpp")))  # doctest: +SKIP
    >>> engine.generate("What is the capital of France?")                              # doctest: +SKIP
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ...core.errors import EngineError, RequestRejected
from ...core.machine import Machine
from ...engine.protocol import DEFAULT_MAX_NEW_TOKENS, ContextLimit, Engine, Generation, as_request, tightest
from ...serving.prompting import HFTokens
from ...serving.sampling import Decoding
from ...tower.plan import Plan
from ...weights.models import resolve
from ...weights.prompts import prompt_format, prompt_ids
from ...weights.tokenizers import load_tokenizer
from ...workloads.workload import Request
from . import logprobs
from .census import context_limits, eos_token_id, gguf_census
from .completion import Answer, OnTokens, complete, sampling_fields, stream_text
from .model_file import model_file, source_problem
from .process import LlamaServerProcess
from .settings import ServerSettings, common_params, refusals, request_body, server_settings

__all__ = ["LlamaCppEngine", "clear_cache", "evict_except"]

# The loaded xllamacpp server, by settings: at most one entry (see the module's note on libgomp).
_SERVERS: OrderedDict[ServerSettings, tuple[Any, tuple]] = OrderedDict()  # settings -> (server, plan.weights_key())
_SERVERS_LOCK = threading.Lock()  # slot threads of one engine may ask for its server at once

def _physical_cores() -> int:
    """The physical cores as Machine.probe counts them, without its torch import (psutil)."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


class LlamaCppEngine(Engine):
    """A GGUF model served by llama.cpp as a Plan says. Build with :meth:`build`."""

    def __init__(self, plan: Plan, handle: Any, settings: ServerSettings, *, machine: Machine | None = None, load_s: float = 0.0, max_new_tokens: int | None = None):
        self.plan = plan
        self.model = handle  # the xllamacpp.Server (None once closed); the Server base checks it
        self.settings = settings
        self.machine = machine
        self.load_s = load_s
        self.default_max_new_tokens = max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        self.eos_id = eos_token_id(settings.model_path)
        self._tokenizer: Any = None
        self._format: Any = None  # the prompt format (weights/prompts.py), read with the tokenizer
        self._tokens: HFTokens | None = None  # the tokenizer as prompts are counted (count_prompt)

    # ------------------------------------------------------------------ measurement's needs
    # clock_sync stays the protocol's None: a token reaches the callback only once computed.
    @property
    def device(self) -> str:
        """Always "cpu": the xllamacpp wheel is a CPU build (refuse() rejects other devices)."""
        return "cpu"

    @property
    def threads(self) -> int:
        """The threads llama.cpp was loaded with; without a plan value, its own default (the
        physical cores, which llama.cpp counts itself)."""
        if self.settings.threads is not None:
            return self.settings.threads
        return self.machine.physical_cores if self.machine is not None else max(1, (os.cpu_count() or 2) // 2)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, no special tokens added (the quality probes' reference text)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @property
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer (:func:`fractal_opt.weights.tokenizers.load_tokenizer`:
        a folder's own, or a GGUF's saved once under the cache), which renders every prompt
        (:meth:`prompt_ids`) and the quality probes' reference text.

        Raises:
            EngineError: transformers is not installed, or a hub id is not in the local cache.
        """
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(resolve(self.plan.source))
            self._format = prompt_format(self._tokenizer, self.plan.application.chat_template)
        return self._tokenizer

    def prompt_ids(self, request: Request) -> list[int]:
        """The token ids llama.cpp receives for ``request`` (weights/prompts.py: rendered once, the same on every runtime)."""
        tokenizer = self.tokenizer
        return prompt_ids(tokenizer, self._format, request.as_messages())

    def context_limit(self) -> ContextLimit | None:
        """The plan's cap, llama.cpp's context per request or the GGUF's trained context, whichever is smallest."""
        return tightest(super().context_limit(), *context_limits(self.settings))

    def count_prompt(self, request: Request, *, limit: int | None = None) -> int:
        """The length of :meth:`prompt_ids` (``limit``: the protocol's shortcut); raises BadRequest when the template refuses the messages."""
        tokenizer = self.tokenizer  # reads the prompt format too
        self._tokens = self._tokens or HFTokens(tokenizer, self._format)
        return self._tokens.count(request.as_messages(), limit=limit)

    # ------------------------------------------------------------------ construction
    @classmethod
    def refuse(cls, plan: Plan) -> str | None:
        """Why llama.cpp cannot serve ``plan``: its model source, then every unmapped field."""
        reasons = refusals(plan)
        # The weights: a folder converted by llama.cpp's converter, a type of the weight ladder
        # (headers and config.json only: nothing converts here).
        if (problem := source_problem(plan)) is not None:
            reasons.insert(0, problem)
        return "; ".join(reasons) if reasons else None

    @classmethod
    def build(cls, plan: Plan, *, machine: Machine | None = None, progress: Callable[[str], None] = print, max_new_tokens: int | None = None) -> LlamaCppEngine:
        """Load (or reuse) llama.cpp's server for ``plan``.

        Raises:
            EngineError: the plan asks for something llama.cpp cannot honour (the reason names
                each field), or xllamacpp is not installed.
        """
        reason = cls.refuse(plan)
        if reason:
            raise EngineError(f"the llama_cpp runtime cannot serve this plan: {reason}")
        cores = machine.physical_cores if machine is not None else _physical_cores()  # the count when the plan pins none (settings.server_settings)
        settings = server_settings(plan, str(model_file(plan, progress=progress)), physical_cores=cores)
        start = _starter(settings)
        if settings not in _SERVERS:
            where = f"a llama-server process ({settings.executable})" if settings.executable else "llama.cpp in this process"
            progress(f"loading {os.path.basename(settings.model_path)} into {where} ({settings.slots} slot(s), KV cache of {settings.kv_tokens} tokens{' shared' if settings.unified else ''})")
        handle = _Resident(settings, plan.weights_key(), start)
        load_s = handle.load()
        return cls(plan, handle, settings, machine=machine, load_s=load_s, max_new_tokens=max_new_tokens)

    def activate(self) -> float:
        """Make this engine's server the resident one (reloading it if another plan's server was
        used since), before a timed round; returns the seconds the reload took (0 when resident)."""
        return self.model.load() if isinstance(self.model, _Resident) else 0.0

    def server_pids(self) -> list[int]:
        """The llama-server child's pid when the plan runs one (its memory and CPU time count as
        this engine's); none for xllamacpp in this process."""
        if self.settings.executable is None or not isinstance(self.model, _Resident):
            return []
        return self.model.server().pids()  # a split or replicated plan: every part

    def health(self) -> str | None:
        """Closed, or the llama-server child restarting or not answering (raises once it cannot be
        restarted: :meth:`.process.LlamaServerProcess.health`); xllamacpp in this process serves while open."""
        if self.model is None:
            return "the engine is closed"
        return self.model.health() if isinstance(self.model, _Resident) else None

    def census(self) -> dict[str, Any]:
        """Weights by GGUF storage type, quantized linear layers, and the KV cache llama.cpp allocated."""
        return gguf_census(self.settings, context_cap=self.plan.model.context_cap)

    def close(self) -> None:
        """Forget this engine's server (the cache keeps it until evicted or :func:`clear_cache`)."""
        self.model = None

    # ------------------------------------------------------------------ serving
    def serve(self, requests: Sequence[Request], *, max_new_tokens: int | None = None, seed: int = 0, sync: Any = None) -> list[Generation]:
        """Serve ``requests``: one at a time (sequential), or all at once through llama.cpp's
        continuous batching (:meth:`server`). ``sync`` is unused: llama.cpp returns each token to
        the callback only once it is computed."""
        if self.plan.scheduling.batching == "continuous":
            from ...serving.server import serve_all

            return serve_all(self, requests, max_new_tokens=max_new_tokens, seed=seed)
        out = []
        for request in requests:
            t_submit = time.perf_counter()
            answer = self.complete(request, budget=self.budget(max_new_tokens), seed=seed)
            out.append(self._generation(request, answer, t_submit))
        return out

    def stream(self, prompt: str | Sequence[dict[str, str]], *, max_new_tokens: int | None = None) -> Iterator[str]:
        """Yield the answer's text piece by piece as llama.cpp streams it."""
        request = as_request(prompt)
        return stream_text(lambda on_tokens: self.complete(request, budget=self.budget(max_new_tokens), seed=0, on_tokens=on_tokens))

    def server(self, *, seed: int = 0, ignore_eos: bool = False) -> Any:
        """A request server on llama.cpp's continuous batching (queue, timeouts, cancel, streaming)."""
        from .server import LlamaServer

        return LlamaServer(self, seed=seed, ignore_eos=ignore_eos)

    def complete(self, request: Request, *, budget: int, seed: int = 0, ignore_eos: bool = False, on_tokens: OnTokens | None = None,
                 decoding: Decoding | None = None, stop: Sequence[str] = ()) -> Answer:
        """Run one request to its end on the calling thread (llama.cpp picks a free slot); the
        prompt goes as the token ids :meth:`prompt_ids` renders, the same every runtime receives.

        ``decoding``: the request's own sampling (``Server.decoding(ticket)``) instead of the
        plan's; llama.cpp takes sampling with every request, so nothing else changes. ``stop``: the
        request's own stop sequences, on top of the plan's: llama.cpp ends the answer there itself,
        so it still reports the request's usage (a request cut from outside never gets it).

        ``on_tokens(ids, times, text)`` is called as tokens arrive; returning True stops the
        request. A chunk normally holds one token; llama.cpp holds back a token that ends inside
        a UTF-8 character or a possible stop string and sends it with the next one, so such
        tokens share a clock reading.

        Raises:
            RequestRejected: llama.cpp refused the request (e.g. prompt + budget over the context).
            EngineError: the engine is closed, or llama.cpp reported another error.
        """
        if self.model is None:
            raise EngineError("the engine is closed: build a new one with LlamaCppEngine.build(plan)")
        ids = self.prompt_ids(request)
        if len(ids) >= self.settings.context_per_request:
            raise RequestRejected(f"the prompt is {len(ids):,} tokens, which leaves no room for an answer in llama.cpp's context per request of "
                                  f"{self.settings.context_per_request:,} tokens; shorten it, or raise the context_cap pass's tokens")
        budget = min(budget, self.settings.context_per_request - len(ids))  # the answer ends at the context (and n_predict is a C int)
        body = request_body(self.plan, ids, budget=budget, seed=seed, ignore_eos=ignore_eos)
        if decoding is not None:
            body.update(sampling_fields(decoding, seed))
        if stop:
            body["stop"] = [*body.get("stop", ()), *stop]
        # The end-of-sequence token is counted only without stop strings: a stop string's tokens
        # are decoded but held back too, so llama.cpp's count would not tell them apart.
        eos = None if stop or self.plan.application.stop else self.eos_id
        return complete(self.model, body, request_id=request.id, eos_id=eos, on_tokens=on_tokens, context_per_request=self.settings.context_per_request)

    def _generation(self, request: Request, answer: Answer, t_submit: float) -> Generation:
        return Generation(
            request_id=request.id, text=answer.text, token_ids=answer.token_ids, prompt_tokens=answer.prompt_tokens,
            t_submit=t_submit, t_prefill_start=answer.t_start, token_times=answer.token_times,
            hit_cap=answer.finish_reason == "length", t_done=answer.t_done,
        )

    # ------------------------------------------------------------------ quality probes
    def next_token_logprobs(self, input_ids: Any, *, chunk: int = 512) -> Iterator[Any]:
        """Not available: a whole-vocabulary row costs llama.cpp's server ~870 ms a position
        (:mod:`.logprobs`). :meth:`token_logprobs` gives the KL probe's tokens exactly instead."""
        raise NotImplementedError(
            "the llama_cpp runtime gives no full teacher-forced distributions (a whole-vocabulary row costs ~870 ms a position); "
            "LlamaCppEngine.token_logprobs(ids, tokens) gives chosen tokens' log-probabilities exactly"
        )

    def top_logprobs(self, input_ids: Sequence[int], *, k: int) -> list[dict[int, float]]:
        """Teacher-forced top-``k`` next-token log-probabilities at every position of ``input_ids``
        (llama.cpp's ``n_probs``: raw logits, before sampling; :mod:`.logprobs`). One request per
        position, each reusing the previous prefix's KV cache: 26 ms at k=20 on the embedded model
        (2-core CPU, load 1.4).

        Raises:
            RequestRejected: ``input_ids`` is longer than the context per request.
            EngineError: the engine is closed, or llama.cpp failed at a position.
        """
        return logprobs.top_logprobs(self._scoring_server(input_ids), [int(t) for t in input_ids], k=k, safe_token=self._safe_token())

    def token_logprobs(self, input_ids: Sequence[int], tokens: Sequence[Sequence[int]]) -> list[dict[int, float]]:
        """Exact teacher-forced log-probabilities of the chosen ``tokens[j]`` after
        ``input_ids[:j + 1]`` (two requests a position: :mod:`.logprobs` says how).

        Raises:
            RequestRejected: ``input_ids`` is longer than the context per request.
            EngineError: the engine is closed, or llama.cpp failed at a position.
        """
        return logprobs.token_logprobs(self._scoring_server(input_ids), [int(t) for t in input_ids], tokens, safe_token=self._safe_token())

    def _safe_token(self) -> int | None:
        """A token that is whole text on its own (the first of "a"), which llama.cpp always reports
        probabilities with (:mod:`.logprobs`); None without a tokenizer."""
        try:
            ids = self.encode("a")
        except Exception:  # noqa: BLE001 (no tokenizer here: the probes still run, without the retry's bias)
            return None
        return ids[0] if ids else None

    def _scoring_server(self, input_ids: Sequence[int]) -> Any:
        if self.model is None:
            raise EngineError("the engine is closed: build a new one with LlamaCppEngine.build(plan)")
        if len(input_ids) > self.settings.context_per_request:
            raise RequestRejected(f"{len(input_ids)} tokens to score exceed the context per request ({self.settings.context_per_request}); "
                                  "pass a shorter text or raise context_cap")
        return self.model


class _Resident:
    """What an engine holds instead of the ``xllamacpp.Server``: its settings. The server is
    loaded on first use and again whenever another plan's server was resident since, so only
    :data:`_SERVERS` ever holds a server (a server stops when its last reference goes)."""

    def __init__(self, settings: ServerSettings, weights_key: tuple, start: Callable[[ServerSettings], Any]):
        self.settings = settings
        self.weights_key = weights_key
        self.start = start  # settings -> a started server (xllamacpp.Server, or a LlamaServerProcess)
        self.loads = 0  # times this server was loaded (more than one: another plan's was resident in between)

    def load(self) -> float:
        """Make this server the resident one; the seconds that took (0.0 when it already was)."""
        return self._acquire()[1]

    def server(self) -> Any:
        """The loaded server (loading it if another plan's is resident)."""
        return self._acquire()[0]

    def _acquire(self) -> tuple[Any, float]:
        with _SERVERS_LOCK:
            if self.settings in _SERVERS:
                return _SERVERS[self.settings][0], 0.0
            _SERVERS.clear()
            gc.collect()  # the other server's threads stop here, before this one starts its own
            start = time.perf_counter()
            server = self.start(self.settings)
            _wait_until_serving(server)
            _SERVERS[self.settings] = (server, self.weights_key)
            self.loads += 1
            return server, time.perf_counter() - start

    def health(self) -> str | None:
        """The resident llama-server child's health (None for xllamacpp, or a server not resident:
        it is loaded on the next request)."""
        with _SERVERS_LOCK:
            entry = _SERVERS.get(self.settings)
        server = entry[0] if entry is not None else None
        return server.health() if isinstance(server, LlamaServerProcess) else None

    def handle_completions(self, body: dict[str, Any], callback: Callable[[dict[str, Any]], bool] | None = None) -> Any:
        server = self.server()
        return server.handle_completions(body) if callback is None else server.handle_completions(body, callback)


def _starter(settings: ServerSettings) -> Callable[[ServerSettings], Any]:
    """How to start the server for ``settings``: a llama-server child process when the plan names
    an executable (:mod:`.process`), else xllamacpp's server in this process.

    Raises:
        EngineError: in-process serving without the xllamacpp package.
    """
    if settings.executable is not None:
        from .placed import starter

        return starter(settings)  # one llama-server, or its rpc-servers or replicas with it
    try:
        import xllamacpp as xlc
    except ImportError:
        raise EngineError("the llama_cpp runtime needs xllamacpp: pip install xllamacpp (a prebuilt CPU wheel)") from None
    return lambda s: xlc.Server(common_params(s))


def _wait_until_serving(server: Any) -> None:
    """Return once ``server``'s request loop runs, by serving one 1-token completion through it.

    Why: ``xllamacpp.Server()`` returns before its loop thread has entered the loop, and a server
    destroyed in that window never sees the stop and its destructor waits forever, holding the GIL
    (measured: 25 create-and-drop cycles hung at the second without this request, and all 25
    passed with it). The one-resident rule drops a server as soon as another plan is built, so
    that window is hit in practice.
    """
    server.handle_completions({"prompt": "a", "max_tokens": 1, "temperature": 0.0, "cache_prompt": False, "stream": False})


def evict_except(keep: set[tuple]) -> None:
    """Drop the loaded server when its plan's ``weights_key()`` is not in ``keep``."""
    with _SERVERS_LOCK:
        for key in [s for s, (_, weights) in _SERVERS.items() if weights not in keep]:
            del _SERVERS[key]


def clear_cache() -> None:
    """Drop the loaded llama.cpp server (it stops once no call is using it)."""
    with _SERVERS_LOCK:
        _SERVERS.clear()

