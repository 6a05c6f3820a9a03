"""Mapping a plan's model and application sections to ``model.generate`` keyword arguments.

The engine calls :func:`generate_kwargs` for every generate call; application-layer passes that
change decoding only need a plan field and a line here.
"""

from __future__ import annotations

from typing import Any

from ...serving.sampling import Decoding
from ...tower.plan import Plan

__all__ = ["cache_kwargs", "generate_kwargs", "uses_streamer"]


def generate_kwargs(plan: Plan, tokenizer: Any, *, budget: int, decoding: Decoding | None = None) -> dict[str, Any]:
    """``generate()`` arguments for ``plan`` with a budget of ``budget`` new tokens.

    ``decoding``: a request's own sampling (``Server.decoding(ticket)``) instead of the plan's.
    """
    app = plan.application
    if decoding is None:
        decoding = Decoding(app.do_sample, app.temperature, app.top_p, app.top_k, app.min_p) if app.do_sample else Decoding(False)
    kwargs: dict[str, Any] = {
        "max_new_tokens": budget,
        "do_sample": decoding.do_sample,
        "repetition_penalty": app.repetition_penalty,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if decoding.do_sample:
        kwargs.update(temperature=decoding.temperature, top_p=decoding.top_p, top_k=decoding.top_k or 0, min_p=decoding.min_p)
    else:
        # Neutralize sampling defaults a checkpoint's generation_config may carry, so greedy
        # means greedy (and transformers does not warn about unused sampling flags).
        kwargs.update(temperature=None, top_p=None, top_k=None, min_p=None)
    kwargs.update(_application_kwargs(plan, tokenizer))
    kwargs.update(cache_kwargs(plan))
    return kwargs


def cache_kwargs(plan: Plan) -> dict[str, Any]:
    """KV-cache and compile arguments: the model layer's cache, sized by the context cap, and the
    hardware layer's torch.compile of the decode step (which needs a static cache)."""
    mp, hw = plan.model, plan.hardware
    out: dict[str, Any] = {}
    cache = mp.kv_cache
    if hw.compile is not None and cache == "dynamic":
        cache = "static"  # a compiled decode step needs fixed shapes: transformers compiles only static caches
    if cache == "off":
        out["use_cache"] = False
    elif cache == "static":
        out["cache_implementation"] = "static"
        if mp.context_cap is not None:
            # One cache size for every request: no reallocation and no recompilation per prompt length.
            out["max_cache_len"] = mp.context_cap
    elif cache == "quantized":
        out["cache_implementation"] = "quantized"
        out["cache_config"] = {"backend": mp.kv_backend or "quanto", "nbits": mp.kv_bits or 4}
    elif cache == "offloaded":
        out["cache_implementation"] = "offloaded"
    if hw.compile is not None and cache == "static":
        from transformers import CompileConfig

        config = CompileConfig(mode=hw.compile, fullgraph=False)
        # transformers compiles on CUDA only unless told otherwise; this flag is its switch for CPU.
        config._compile_all_devices = True
        out["compile_config"] = config
        out["disable_compile"] = False
    return out


def _application_kwargs(plan: Plan, tokenizer: Any) -> dict[str, Any]:
    """Application-layer arguments beyond sampling: beams, repetition controls, stops, speculation.

    The draft model itself (``assistant_model``) is added by the engine, which loads it.
    """
    app = plan.application
    out: dict[str, Any] = {}
    if app.num_beams > 1:
        # Beam search keeps the best finished beam; early_stopping=True ends once num_beams are done.
        out.update(num_beams=app.num_beams, early_stopping=True)
    if app.no_repeat_ngram_size:
        out["no_repeat_ngram_size"] = app.no_repeat_ngram_size
    if app.stop:
        # stop_strings needs the tokenizer to map strings onto token sequences.
        out.update(stop_strings=list(app.stop), tokenizer=tokenizer)
    if app.prompt_lookup_tokens:
        out["prompt_lookup_num_tokens"] = app.prompt_lookup_tokens
    if app.draft:
        out["num_assistant_tokens"] = app.draft_tokens
    return out


def uses_streamer(plan: Plan) -> bool:
    """Whether generate() can report tokens as they come: transformers refuses a streamer with beams."""
    return plan.application.num_beams <= 1
