"""What a candidate that gives only its top-k next-token log-probabilities still says about quality.

Some runtimes (llama.cpp's server, vLLM) return per teacher-forced position only the k most likely
next tokens with their log-probabilities (:meth:`Engine.top_logprobs`), never the whole vocabulary.
Against the baseline's stored top-K (:class:`.probes.Reference`, K = 256) that still gives:

- **top-1 flip, exact.** The candidate's most likely token is the top of its row. A tie for first
  place is no flip (bfloat16 logits tie often; which of the tied tokens an argmax or a top-k
  returns first is arbitrary, and would make the full and top-k counts differ).
- **KL(baseline ‖ candidate), a lower bound.** At one position let S be the tokens whose
  log-probabilities are known on both sides (the baseline's top-K ∩ the candidate's row) and R
  the rest of the vocabulary, with masses p_R = 1 − Σ_S p_t and q_R = 1 − Σ_S q_t. The log-sum
  inequality, Σ_R p_t log(p_t / q_t) ≥ p_R log(p_R / q_R), gives

      KL(p ‖ q) = Σ_S p_t log(p_t / q_t) + Σ_R p_t log(p_t / q_t)
                ≥ Σ_S p_t log(p_t / q_t) + p_R log(p_R / q_R)

  with equality when p and q are proportional on R (R empty, say). It is the tightest bound a
  coarse-graining of the known masses allows: a block of the partition that is not inside S must
  hold both sides' unknown tokens, so there is only one such block. A bigger k grows S and tightens
  the bound. A mean, p99 or max of per-position lower bounds is a lower bound on the true mean, p99
  or max (order statistics are monotone), so a guard ``kl_mean: {max: x}`` applied to the bound
  trips only when the true KL is above x as well: it can be too lenient, never too strict.
- **perplexity, where the rows say it.** The candidate's log-probability of the actual next token
  is known only where that token is in its row (vLLM always adds it; llama.cpp only when it is in
  the top k). Where it is missing at some position the ratio is left None.

Example:
    >>> import math
    >>> p = {0: math.log(0.5), 1: math.log(0.3), 2: math.log(0.2)}   # the baseline, all known
    >>> q = {0: math.log(0.4), 1: math.log(0.4)}                       # the candidate's top-2
    >>> true_kl = sum(math.exp(lp) * (lp - lq) for lp, lq in zip(p.values(), [math.log(x) for x in (0.4, 0.4, 0.2)]))
    >>> round(kl_lower_bound(p, q), 4), round(true_kl, 4)  # here R = {2} holds 0.2 on both sides: exact
    (0.0253, 0.0253)
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["flipped", "kl_lower_bound"]

# The candidate's rest mass q_R is floored here before the log. Σ_S q_t of ~20 float32
# probabilities carries a rounding error of ~1e-6 (20 × 6e-8), so a computed q_R below that is
# noise; raising q_R only lowers p_R log(p_R / q_R), so the floor keeps the bound a lower bound.
_REST_FLOOR = 1e-6


def kl_lower_bound(base: Mapping[int, float], cand: Mapping[int, float]) -> float:
    """KL(p ‖ q) over {each token known on both sides, the rest}: a lower bound on the true KL (nats).

    Args:
        base: known log-probabilities of the baseline's full distribution p (token id -> logprob;
            its top-K, or all of it).
        cand: known log-probabilities of the candidate's full distribution q (its top-k row).
    """
    kl = p_shared = q_shared = 0.0
    for token in base.keys() & cand.keys():
        lp, lq = base[token], cand[token]
        p = math.exp(lp)
        kl += p * (lp - lq)
        p_shared += p
        q_shared += math.exp(lq)
    p_rest, q_rest = 1.0 - p_shared, max(1.0 - q_shared, _REST_FLOOR)
    if p_rest > 0.0:  # p log(p / q) -> 0 as p -> 0; a rounding negative is an empty rest
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(0.0, kl)  # KL >= 0; rounding can leave -1e-17 where the two agree


def flipped(row: Mapping[int, float], baseline_top: int) -> bool:
    """True when the candidate's top-k ``row`` puts some token above ``baseline_top`` (the
    baseline's most likely token): exact, since the row holds the candidate's top 1. A tie for
    first place is no flip."""
    return row.get(baseline_top, -math.inf) < max(row.values())
