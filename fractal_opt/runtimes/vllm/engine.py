"""VllmEngine: a plan served by vLLM's OpenAI-compatible server, measured over HTTP streaming.

``build`` maps the plan to ``vllm serve`` flags (:mod:`.engine_args`), starts the server from its
own environment (:mod:`.process`) on a free loopback port, and waits until ``/v1/models`` answers;
``load_s`` is that whole start-up (process, weights, KV-cache allocation), which is what a user
waits for. Started servers are kept across builds (:mod:`.cache`): a plan whose flags, model and
environment match a running server's reuses it (``load_s`` 0), and closing an engine leaves the
server to the cache. With ``hardware.runtime_url`` / ``$FRACTAL_OPT_VLLM_URL`` it uses a running
server instead and starts nothing. Every token's clock reading is taken when its streamed chunk arrives
in this process, the same rule as the transformers runtime's streamer.

Example:
    >>> plan = Plan(source="smollm2-135m-instruct").replace_section("hardware", runtime="vllm")  # doctest: +SKIP
    >>> engine = VllmEngine.build(plan)                                                        # doctest: +SKIP
    >>> engine.generate("What is the capital of France?"); engine.close()                      # doctest: +SKIP
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ...core.errors import EngineError
from ...core.machine import Machine
from ...engine.protocol import DEFAULT_MAX_NEW_TOKENS, ContextLimit, Engine, Generation, as_request, tightest
from ...serving.prompting import HFTokens
from ...tower.plan import Plan
from ...weights.model_headers import safetensors_header
from ...weights.models import materialize, resolve
from ...weights.prompts import prompt_format, prompt_ids
from ...weights.tokenizers import load_tokenizer
from ...workloads.workload import Request
from . import cache
from ...weights.heads import tensor_parallel_problem
from .engine_args import _CONTINUOUS_DEFAULT_IN_FLIGHT, engine_args, ranks, refusals, sampling, server_env
from .openai_client import OpenAIClient
from .process import VllmProcess, find_executable, find_url, free_port, wait_started

__all__ = ["VllmEngine"]

_READY_TIMEOUT_S = 900.0  # a cold CPU start measured 81 s on the 2-core box; GPU starts with compile take minutes


class VllmEngine(Engine):
    """A plan served by a ``vllm serve`` process (or a running server). Build with :meth:`build`."""

    def __init__(self, plan: Plan, client: OpenAIClient, *, served: cache.Served | None = None, model_dir: str | None = None,
                 args: Sequence[str] = (), machine: Machine | None = None, load_s: float = 0.0, max_new_tokens: int | None = None):
        self.plan = plan
        self.client = client
        self.served = served  # the cached server this engine uses; None when given by URL (runtime_url)
        self.model_dir = model_dir
        self.args = list(args)
        self.machine = machine
        self.load_s = load_s
        self.default_max_new_tokens = max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        self.model: str | None = client.base_url  # None once closed; the Server base checks it
        s = plan.scheduling
        self.max_num_seqs = 1 if s.batching == "sequential" else s.max_concurrency or _CONTINUOUS_DEFAULT_IN_FLIGHT
        self._tokenizer: Any = None
        self._format: Any = None
        self._tokens: HFTokens | None = None  # the tokenizer as prompts are counted (count_prompt)
        self._max_model_len: int | None = None  # what /v1/models reports, read once

    @property
    def tokenizer(self) -> Any:
        """The model's transformers tokenizer, read in this process (the one vLLM loads from the same
        files): it renders every prompt (:meth:`prompt_ids`)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(resolve(self.plan.source))
            self._format = prompt_format(self._tokenizer, self.plan.application.chat_template)
        return self._tokenizer

    def prompt_ids(self, request: Request) -> list[int]:
        """The token ids vLLM receives for ``request`` (weights/prompts.py: rendered once, the same on every runtime)."""
        tokenizer = self.tokenizer
        return prompt_ids(tokenizer, self._format, request.as_messages())

    # ------------------------------------------------------------------ construction
    @classmethod
    def refuse(cls, plan: Plan) -> str | None:
        """Why vLLM cannot serve ``plan``: one reason per field it cannot honour, or None."""
        reasons = refusals(plan)
        if plan.hardware.tensor_parallel > 1 and (why := tensor_parallel_problem(plan.source, plan.hardware.tensor_parallel)):
            reasons.append(f"hardware.tensor_parallel={plan.hardware.tensor_parallel}: {why}")
        return "; ".join(reasons) if reasons else None

    @classmethod
    def build(cls, plan: Plan, *, machine: Machine | None = None, progress: Callable[[str], None] = print, max_new_tokens: int | None = None) -> VllmEngine:
        """Start (or connect to) the vLLM server for ``plan`` and wait until it serves.

        Raises:
            EngineError: a field vLLM cannot honour (the reason names each), no vLLM found (says
                where it looked), or the server died / hung during start-up (with its log's tail).
        """
        reason = cls.refuse(plan)
        if reason:
            raise EngineError(f"the vllm runtime cannot serve this plan: {reason}")
        url = find_url(plan.hardware.runtime_url)
        if url:
            client = OpenAIClient(url)
            client.wait_ready(timeout_s=30.0)
            model_id = client.resolve_model()
            progress(f"using the running vLLM server at {url} (model {model_id})")
            return cls(plan, client, model_dir=None, machine=machine, load_s=0.0, max_new_tokens=max_new_tokens)
        exe = find_executable(plan.hardware.runtime_path)
        model_dir = materialize(resolve(plan.source), progress=progress)
        draft = materialize(resolve(plan.application.draft), progress=progress) if plan.application.draft else None
        args = engine_args(plan, draft_model=draft)
        cores = (machine or Machine.probe()).physical_cores if plan.hardware.threads == "auto" or ranks(plan) > 1 else None
        env = server_env(plan, physical_cores=cores)

        def start() -> tuple[VllmProcess, float]:
            port = free_port()
            command = [str(exe), "serve", model_dir, "--host", "127.0.0.1", "--port", str(port), *args]
            progress(f"starting vllm serve ({' '.join(args)}); a CPU start takes about 80 s")
            started = time.perf_counter()
            process = VllmProcess(command, env=env, port=port)
            try:
                OpenAIClient(process.url, model=model_dir).wait_ready(timeout_s=_READY_TIMEOUT_S, alive=process.alive)
            except EngineError:
                process.stop()
                wait_started(process, started, _READY_TIMEOUT_S)
            process.ready = True
            return process, time.perf_counter() - started

        # Any device but the CPU may be a GPU, where an idle server's memory reservation would
        # make the new one fail to start.
        served, reused = cache.acquire(cache.server_key(str(exe), model_dir, args, env), weights_key=plan.weights_key(),
                                       start=start, frees_gpu=plan.hardware.device != "cpu")
        if reused:
            progress(f"reusing the running vllm serve (pid {served.process.pid}; same flags, model and environment)")
        client = OpenAIClient(served.process.url, model=model_dir)
        return cls(plan, client, served=served, model_dir=model_dir, args=args, machine=machine,
                   load_s=0.0 if reused else served.load_s, max_new_tokens=max_new_tokens)

    @property
    def process(self) -> VllmProcess | None:
        """The server process this engine uses (None when the server was given by URL)."""
        return self.served.process if self.served is not None else None

    # ------------------------------------------------------------------ bounds
    def context_limit(self) -> ContextLimit | None:
        """The plan's context cap, or the ``max_model_len`` the server reports (read once)."""
        if self._max_model_len is None and self.model is not None:
            served = self.client.models()
            value = served[0].get("max_model_len") if served else None
            self._max_model_len = int(value) if isinstance(value, int) and value > 0 else 0
        served_len = ContextLimit(self._max_model_len, "the model's context", "vLLM's max_model_len; the context_cap pass sets it") if self._max_model_len else None
        return tightest(super().context_limit(), served_len)

    def count_prompt(self, request: Request, *, limit: int | None = None) -> int:
        """The length of :meth:`prompt_ids` (``limit``: the protocol's shortcut); raises BadRequest when the template refuses the messages."""
        tokenizer = self.tokenizer  # reads the prompt format too
        self._tokens = self._tokens or HFTokens(tokenizer, self._format)
        return self._tokens.count(request.as_messages(), limit=limit)

    # ------------------------------------------------------------------ serving
    def serve(self, requests: Sequence[Request], *, max_new_tokens: int | None = None, seed: int = 0, sync: Any = None) -> list[Generation]:
        """Serve ``requests`` through a :class:`VllmServer` (vLLM batches them as the plan says).

        ``sync`` (a device synchronisation) is not needed: clock readings are taken in this
        process when each chunk arrives, after the server has finished the token.
        """
        with self.server(seed=seed) as server:
            tickets = [server.submit(r, max_new_tokens=max_new_tokens) for r in requests]
            out = []
            for t in tickets:
                g = t.result()
                g.t_done = t.t_end
                out.append(g)
        bad = [t for t in tickets if t.status != "done"]
        if bad:
            raise EngineError(f"{len(bad)} of {len(tickets)} requests did not finish: {bad[0].request.id!r} ended {bad[0].status} ({bad[0].error})")
        return out

    def stream(self, prompt: str | Sequence[dict[str, str]], *, max_new_tokens: int | None = None) -> Iterator[str]:
        """Yield the answer's text piece by piece as vLLM streams it."""
        self._check_open()
        request = as_request(prompt)
        stream = self.client.stream_completion(self.prompt_ids(request), sampling(self.plan, self.budget(max_new_tokens)))
        try:
            for chunk in stream:
                if chunk.text:
                    yield chunk.text
        finally:
            stream.cancel()  # a caller that stops iterating ends the request in vLLM too

    def server(self, *, seed: int = 0, ignore_eos: bool = False) -> Any:
        """A request server over HTTP streams: queue bound, deadlines, cancel, streaming delivery."""
        from .server import VllmServer

        self._check_open()
        return VllmServer(self, seed=seed, ignore_eos=ignore_eos)

    # ------------------------------------------------------------------ inspection
    def server_pids(self) -> list[int]:
        """``vllm serve`` and the processes it spawned (the engine core holds the weights and the KV
        cache), when this engine started it: their peak memory and CPU time count in a
        measurement. Empty for a server given by URL (runtime_url): it is not visible from here."""
        return self.process.pids() if self.process is not None else []

    def census(self) -> dict[str, Any]:
        """Weights as served (parameter count x the served dtype, from the safetensors headers),
        the flags vLLM was started with, and what the server reports (``max_model_len``)."""
        out: dict[str, Any] = {"runtime": "vllm", "engine_args": list(self.args), "quantized_linear_layers": 0}
        if self.model_dir is not None:
            params, linear = _safetensors_params(Path(self.model_dir))
            bits = {"float32": 32, "bfloat16": 16, "float16": 16}[self.plan.hardware.dtype]
            out["params"] = params
            out["weight_bytes"] = params * bits // 8
            if "--quantization" in self.args:  # fp8 / bitsandbytes quantize every Linear weight on load
                out["quantized_linear_layers"] = linear
                out["weight_bytes_note"] = "before vLLM's on-load quantization"
        else:
            out["weight_bytes"] = None  # a running server: its weights are not visible from here
        if self.model is not None:
            served = self.client.models()
            if served:
                out["max_model_len"] = served[0].get("max_model_len")
        if self.process is not None:
            out["server_pid"] = self.process.pid
        return out

    def next_token_logprobs(self, input_ids: Any, *, chunk: int = 512) -> Iterator[Any]:
        """Not available: vLLM returns only the top-k (at most ``--max-logprobs``, default 20)
        log-probabilities per prompt position (``prompt_logprobs`` on ``/v1/completions``), never the
        full vocabulary. The quality probes use :meth:`top_logprobs` instead."""
        raise NotImplementedError(
            "the vllm runtime returns only top-k prompt log-probabilities (prompt_logprobs, k <= --max-logprobs=20), "
            "not the full next-token distribution; VllmEngine.top_logprobs(ids, k=...) gives those (greedy flip rate, "
            "a top-k coarse-grained KL lower bound)")

    def top_logprobs(self, input_ids: Sequence[int], *, k: int) -> list[dict[int, float]]:
        """Teacher-forced top-``k`` next-token log-probabilities at every position of ``input_ids``
        (token id -> logprob); every row but the last also holds the position's actual next token,
        even outside the top-k (vLLM's ``prompt_logprobs`` always include the prompt token).

        One ``/v1/completions`` call with ``prompt_logprobs``; the quality probes turn the rows into
        an exact flip rate and a KL lower bound (:mod:`fractal_opt.quality.topk`).

        Raises:
            EngineError: the server refused (``k`` above its ``--max-logprobs``, a prompt over
                ``max_model_len``); the server's message is included.
        """
        from .logprobs import parse_prompt_logprobs

        self._check_open()
        ids = [int(t) for t in input_ids]
        body = {"model": self.client.resolve_model(), "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": k, "logprobs": k, "return_tokens_as_token_ids": True}
        choice = self.client.post_json("/v1/completions", body)["choices"][0]
        return parse_prompt_logprobs(choice, len(ids))

    def close(self) -> None:
        """Stop using the server: it keeps running for other engines and the cache, which stops
        it when evicted (:func:`.cache.evict_except`, :func:`.cache.clear_cache`); a server given
        by URL is left alone. Idempotent."""
        if self.model is None:
            return
        self.model = None
        if self.served is not None:
            cache.release(self.served)

    def _check_open(self) -> None:
        if self.model is None:
            raise EngineError("the vllm engine is closed: build a new one with VllmEngine.build(plan)")


def _safetensors_params(folder: Path) -> tuple[int, int]:
    """(parameters, 2-D projection weights) of every ``*.safetensors`` in ``folder``, read from the
    files' JSON headers only (8-byte length + header: no tensor is loaded)."""
    params = linear = 0
    for path in sorted(folder.glob("*.safetensors")):
        for name, info in safetensors_header(path).items():
            if name == "__metadata__":
                continue
            params += math.prod(info["shape"])
            if len(info["shape"]) == 2 and name.endswith("proj.weight"):
                linear += 1
    return params, linear
