"""Teacher-forced log-probabilities from llama.cpp's server: the quality probes' view of a GGUF plan.

llama.cpp's server never returns a whole next-token distribution cheaply: ``n_probs`` lists the
top tokens of the raw softmax, and asking for all 49,152 of the embedded model's vocabulary took
870 ms a position (JSON for every token), against 26 ms for the top 20. Two cheaper questions are
exact:

- :func:`top_logprobs`: the top ``k`` of the raw softmax (``n_probs: k``). One request a position.
- :func:`token_logprobs`: the log-probabilities of *chosen* tokens at each position (what the KL
  probe needs: the baseline's top 256 there). Two requests a position:

  1. ``n_probs: 1`` gives the candidate's most likely token ``a`` and its exact log-probability
     ``log q_a`` under the full softmax.
  2. The chosen tokens ``S`` (with ``a`` added) get a logit bias of +100 and the sampler chain is
     cut to ``top_k: |S|``, so the candidates left after sampling are exactly ``S``, and
     ``post_sampling_probs`` returns their softmax *over S alone*: ``q_t / sum_S q``. The bias
     cancels in that ratio (it is the same for every token of S).

  Then ``q_t = q_a * p'_t / p'_a`` for every ``t`` in S: exact to float32 rounding (measured: the
  largest |log error| over 256 tokens against the full 49,152-token row was 4e-6).

Both reuse the previous prefix's KV cache (``cache_prompt``), so a request costs about one decode
step.

llama.cpp attaches a generated token's probabilities only once the token's text is complete UTF-8:
a token that is one byte of a multi-byte character (byte-fallback vocabularies such as Qwen2's,
where a random model samples them often) comes back with none. The generated token is the one
thing these requests do not need, so such a request is asked again: the first with a logit bias
towards ``safe_token``, a token that is whole text on its own (the raw top-1 it reports is taken
before any bias), the second with another seed at a higher temperature (``_RETRY_TEMPERATURE``;
the probabilities it reports are then of the logits over that temperature, which is undone).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ...core.errors import EngineError

__all__ = ["token_logprobs", "top_logprobs"]

# Large enough that every token of S outranks every other token: logits of this model span ~40
# nats; the same bias on every token of S cancels out of the probabilities read back.
_BIAS = 100.0
# A float32 probability of 0 (a token of S that underflowed under the bias-free softmax within S):
# floored here so its log stays finite; ~1e-45 is the smallest float32, so this is no rounding.
_FLOOR_LOGPROB = -103.0
# A retried request (the sampled token was part of a character): a flatter distribution over S so
# another, whole token is sampled; 4 keeps the largest log-ratio of a 40-nat logit range at 10 nats.
_RETRY_TEMPERATURE = 4.0
_RETRIES = 8


def top_logprobs(server: Any, ids: Sequence[int], *, k: int, safe_token: int | None = None) -> list[dict[int, float]]:
    """Row ``j``: the ``k`` most likely next tokens after ``ids[:j + 1]`` with their
    log-probabilities under the full softmax (raw logits, before sampling)."""
    rows: list[dict[int, float]] = []
    for j in range(1, len(ids) + 1):
        content = _raw_top(server, list(ids[:j]), k, j, safe_token)
        rows.append({int(t["id"]): float(t["logprob"]) for t in content.get("top_logprobs", [])})
    return rows


def token_logprobs(server: Any, ids: Sequence[int], tokens: Sequence[Sequence[int]], *, safe_token: int | None = None) -> list[dict[int, float]]:
    """Row ``j``: each token of ``tokens[j]`` (and the most likely one) mapped to its exact
    log-probability after ``ids[:j + 1]`` under the full softmax. ``len(tokens)`` rows."""
    rows: list[dict[int, float]] = []
    for j, chosen in enumerate(tokens, start=1):
        prompt = list(ids[:j])
        top = _raw_top(server, prompt, 1, j, safe_token)["top_logprobs"][0]
        anchor, anchor_lp = int(top["id"]), float(top["logprob"])
        wanted = sorted({int(t) for t in chosen} | {anchor})
        within, temperature = _within(server, prompt, wanted, j)
        if anchor not in within or not within.keys() >= set(wanted):
            msg = f"token_logprobs: llama.cpp returned {len(within)} of the {len(wanted)} biased tokens at position {j}"
            raise EngineError(msg)
        # log q_t = log q_a + T (log p'_t - log p'_a): the bias is the same on every token of S
        base = math.log(within[anchor])
        rows.append({t: (anchor_lp + temperature * (math.log(p) - base) if p > 0 else _FLOOR_LOGPROB) for t, p in within.items()})
    return rows


def _raw_top(server: Any, prompt: list[int], k: int, position: int, safe_token: int | None) -> dict[str, Any]:
    """The raw top-``k`` after ``prompt`` (``n_probs`` is read before sampling, so a bias that makes
    the generated token whole text changes nothing it reports)."""
    fields: dict[str, Any] = {"prompt": prompt, "n_probs": k, "temperature": 0.0, "top_k": 1}
    content = _one_token(server, fields, position)
    if "top_logprobs" not in content and safe_token is not None:
        content = _one_token(server, {**fields, "logit_bias": [[safe_token, _BIAS]]}, position)
    if "top_logprobs" not in content:
        raise EngineError(f"llama.cpp reported no probabilities at position {position} (its token was part of a character)")
    return content


def _within(server: Any, prompt: list[int], wanted: list[int], position: int) -> tuple[dict[int, float], float]:
    """The softmax over ``wanted`` alone (biased up, the sampler cut to them), and the temperature it is at."""
    for attempt in range(_RETRIES):
        temperature = 1.0 if attempt == 0 else _RETRY_TEMPERATURE
        body = {"prompt": prompt, "n_probs": len(wanted), "post_sampling_probs": True, "samplers": ["top_k", "temperature"],
                "top_k": len(wanted), "temperature": temperature, "seed": attempt, "logit_bias": [[t, _BIAS] for t in wanted]}
        content = _one_token(server, body, position)
        if "top_probs" in content:
            return {int(t["id"]): float(t["prob"]) for t in content["top_probs"]}, temperature
    return {}, 1.0


def _one_token(server: Any, fields: dict[str, Any], position: int) -> dict[str, Any]:
    """The probabilities llama.cpp reports for the one token it generates after ``fields["prompt"]``
    (empty when that token is part of a character: see the module's note)."""
    body = {**fields, "max_tokens": 1, "cache_prompt": True, "stream": False}
    out = server.handle_completions(body)
    if "error" in out:
        raise EngineError(f"llama.cpp failed at position {position}: {out['error'].get('message', out['error'])}")
    return ((out["choices"][0].get("logprobs") or {}).get("content") or [{}])[0]
