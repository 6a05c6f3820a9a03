"""What vLLM can say about next-token distributions, and the honest bounds it allows.

vLLM's ``/v1/completions`` returns, for a token-id prompt, the top-k log-probabilities at every
prompt position (``prompt_logprobs: k``, k <= the server's ``--max-logprobs``, 20 by default),
never the whole vocabulary. From top-k one can compute, against a baseline's full distribution p:

- the greedy flip (does vLLM's top-1 differ from the baseline's?): exact for any k >= 1;
- a lower bound on KL(p || q): coarse-grain both distributions to {each top-k token, "the rest"}.
  By the log-sum (data-processing) inequality the KL of the coarse-grained pair is <= the true KL,
  and it is exact when the rest is empty. A quality guard on this bound can only be too lenient,
  so the trace must say "KL >= x (top-k lower bound)", not "KL = x".

Example:
    >>> coarse_kl_lower_bound([-0.1, -2.5, -4.0], {0: -0.1, 1: -2.5})  # same top-2: bound is 0
    0.0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["coarse_kl_lower_bound", "parse_prompt_logprobs", "top_flip"]


def parse_prompt_logprobs(choice: dict[str, Any], n_prompt: int) -> list[dict[int, float]]:
    """Per position j < n_prompt, the top-k log-probabilities of the token after j (token id -> logprob).

    ``choice`` is one ``/v1/completions`` choice asked with ``prompt_logprobs`` and ``logprobs``
    (``return_tokens_as_token_ids`` on, so the generated token's alternatives carry ids).
    vLLM's ``prompt_logprobs[i]`` is the distribution *of* token i given tokens < i (entry 0 is
    None), so position j's next-token distribution is entry j + 1; the last position's is the first
    generated token's ``top_logprobs``.
    """
    prompt = choice.get("prompt_logprobs") or []
    out: list[dict[int, float]] = []
    for entry in prompt[1:n_prompt]:
        out.append({int(tok): float(v["logprob"] if isinstance(v, dict) else v) for tok, v in (entry or {}).items()})
    tops = ((choice.get("logprobs") or {}).get("top_logprobs") or [None])[0]
    if tops is not None and len(out) == n_prompt - 1:
        out.append({_token_id(tok): float(lp) for tok, lp in tops.items()})
    return out


def _token_id(token: str) -> int:
    """``"token_id:123"`` (vLLM's form with return_tokens_as_token_ids) -> 123."""
    if not token.startswith("token_id:"):
        msg = f"top_logprobs key {token!r}: expected 'token_id:N'; ask /v1/completions with return_tokens_as_token_ids=true"
        raise ValueError(msg)
    return int(token.split(":", 1)[1])


def top_flip(baseline_logprobs: Sequence[float], top: dict[int, float]) -> bool:
    """True when vLLM's most likely token differs from the baseline's (exact from top-1; a tie for first is no flip)."""
    from ...quality.topk import flipped

    return flipped(top, max(range(len(baseline_logprobs)), key=baseline_logprobs.__getitem__))


def coarse_kl_lower_bound(baseline_logprobs: Sequence[float], top: dict[int, float]) -> float:
    """KL(p || q) over {each token in ``top``, the rest}: a lower bound on the true KL (nats).

    Args:
        baseline_logprobs: the baseline's full next-token log-probabilities (vocab-sized).
        top: vLLM's top-k for the same position (token id -> log-probability).
    """
    from ...quality.topk import kl_lower_bound

    return kl_lower_bound({t: baseline_logprobs[t] for t in top}, top)
