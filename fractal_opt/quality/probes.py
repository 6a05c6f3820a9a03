"""Quality probes, relative to the baseline plan: computed once for the baseline, reused per step.

- ``kl_mean`` / ``kl_p99`` / ``kl_max``: KL(baseline || candidate) of the teacher-forced
  next-token distributions on the shipped reference text (``fractal_opt/data/reference.txt``).
- ``top1_flip``: share of reference positions whose most likely next token changed (a tie for
  first place with the baseline's token is no change).
- ``ppl_ratio``: candidate perplexity / baseline perplexity on the same text, with a 95% interval
  (``ppl_ratio_low`` / ``ppl_ratio_high``) from the per-token log-likelihood differences.
- ``kl_method`` / ``ppl_method``: how those were computed. ``"full"`` from the candidate's full
  distributions (transformers); ``"exact (the baseline's top-256 tokens, first 256 positions)"``
  from the candidate's exact log-probabilities of the tokens the KL needs, on a runtime without
  cheap whole distributions (llama.cpp: ``Engine.token_logprobs``); ``"top-k lower bound (k=20,
  first 256 positions)"`` on a runtime that gives only its top-k rows (vLLM:
  ``Engine.top_logprobs``), the KL numbers then being lower bounds, which the policy does not judge
  a guard on (:func:`is_lower_bound`), and the flip rate exact (see topk.py); ``"unavailable:
  <why>"`` where the runtime gives none of these, the numbers then None.
- ``agreement``: greedy outputs on the workload, mean over requests of the matching prefix length
  divided by the baseline output's length (1.0 = identical; strict: one early flip gives ~0);
  ``similarity`` is the gentler token-sequence similarity (difflib ratio), averaged.
- ``accuracy``: share of a task eval set answered right (``quality.eval``; see evals.py).
- custom probes: ``quality.probes: ["pkg.module:function"]``; the function receives the engine and
  returns named numbers, stored as ``function.name``. A probe is code that runs in this process:
  a recipe that names one must also say ``quality.allow_code: true`` (docs/quality.md, "Trust
  boundary"), and ``fractal-opt check`` / ``run`` print what it imports.

Model-level probes (KL, flips, perplexity) are recomputed only when the plan's numerics changed
(``Plan.numerics_key``); a pass that changes only decoding or scheduling reuses them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .reference import reference_text

if TYPE_CHECKING:
    import torch

    from ..engine.protocol import Engine

__all__ = ["LOWER_BOUND", "QualityConfig", "Reference", "agreement", "build_reference", "is_lower_bound", "model_probes", "reference_text"]


@dataclass(frozen=True, kw_only=True)
class QualityConfig:
    """Recipe section ``quality``.

    Attributes:
        reference_tokens: how many tokens of the reference text (about 2,700 shipped) the KL probe
            scores, in chunks of 512; each model-changing step pays one prefill over them.
        top_k: the k asked of a runtime that gives only top-k log-probabilities (the KL lower
            bound tightens as k grows). 20 is vLLM's default ``--max-logprobs``, its largest k.
        top_k_positions: the first positions of the reference text a runtime without whole
            distributions scores (llama.cpp exactly, two requests a position; vLLM by its top-k).
            llama.cpp pays a decode step per request: on the embedded model at k=20, 256
            positions took 6.7 s on the shared 2-core CPU (load average 1.4), 1,023 took 46 s.
        eval: a packaged eval set name (``basics``), a .yaml/.jsonl path, or ``auto`` (the default:
            the packaged chat set ``basics`` for a model with a chat template, ``basics-completion`` for
            one without; ``null`` turns it off); scored on every step, judged against the baseline.
        eval_max_new_tokens: the answer budget for eval items.
        probes: custom probes, ``"package.module:function"``.
        allow_code: the recipe's author allows importing and running ``probes`` (Python code, with
            the permissions of whoever runs the recipe). Without it a recipe naming probes is refused.
    """

    reference_tokens: int = 1024
    top_k: int = 20
    top_k_positions: int = 256
    eval: str | None = "auto"
    eval_max_new_tokens: int = 24
    probes: tuple[str, ...] = ()
    allow_code: bool = False

    def __post_init__(self) -> None:
        from ..core.errors import RecipeError

        if self.reference_tokens < 16:
            raise RecipeError(f"quality, key 'reference_tokens': got {self.reference_tokens}, expected an integer >= 16.")
        for name in ("top_k", "top_k_positions"):
            if getattr(self, name) < 1:
                raise RecipeError(f"quality, key {name!r}: got {getattr(self, name)}, expected an integer >= 1.")
        if self.eval_max_new_tokens < 1:
            raise RecipeError(f"quality, key 'eval_max_new_tokens': got {self.eval_max_new_tokens}, expected an integer >= 1.")
        for spec in self.probes:
            if spec.count(":") != 1 or not all(spec.split(":")):
                raise RecipeError(f"quality, key 'probes': {spec!r} is not of the form 'package.module:function'.")
        if self.probes and not self.allow_code:
            raise RecipeError(
                f"quality, key 'probes': this recipe would import and run Python code: {', '.join(self.probes)}. "
                "A probe runs in this process with your permissions; if you trust that code, add `allow_code: true` under quality."
            )

    def load_probes(self) -> dict[str, Callable[..., dict[str, float]]]:
        """Import the custom probes (``module:function``); each takes the engine, returns named numbers."""
        import importlib

        from ..core.errors import RecipeError

        if self.probes and not self.allow_code:  # also for a QualityConfig changed after validation
            raise RecipeError(f"quality, key 'probes': importing {list(self.probes)} needs quality.allow_code: true.")
        out = {}
        for spec in self.probes:
            module_name, func_name = spec.split(":")
            try:
                func = getattr(importlib.import_module(module_name), func_name)
            except (ImportError, AttributeError) as e:
                raise RecipeError(f"quality, key 'probes': cannot import {spec!r}: {e}.") from None
            if not callable(func):
                raise RecipeError(f"quality, key 'probes': {spec!r} is not callable.")
            out[func_name] = func
        return out


# The baseline keeps only its top-K next-token log-probabilities per position, plus the mass of
# the rest: 2,048 positions × 256 × 12 bytes ≈ 6 MB instead of 400 MB of full distributions.
TOP_K = 256


@dataclass
class Reference:
    """The baseline's answers, computed once per run."""

    token_ids: torch.Tensor  # [T] reference text tokens
    top_ids: torch.Tensor  # [T-1, K] baseline's most likely next tokens at each position
    top_logprobs: torch.Tensor  # [T-1, K] their log-probabilities
    token_nll: torch.Tensor  # [T-1] baseline negative log-likelihood of the actual next token
    outputs: dict[str, list[int]]  # request id -> baseline greedy output tokens
    top_k: int = 20  # QualityConfig.top_k: the k asked of a top-k-only candidate
    top_k_positions: int = 256  # QualityConfig.top_k_positions: the positions such a candidate scores


def _reference_ids(engine: Engine, config: QualityConfig) -> torch.Tensor:
    import torch

    ids = torch.tensor(engine.encode(reference_text()), dtype=torch.long)
    return ids[: config.reference_tokens]


def _scored(engine: Engine, ids: torch.Tensor):
    """Yield (log-probs chunk [n, vocab], next tokens [n]) over the text, last position dropped."""
    start = 0
    for chunk in engine.next_token_logprobs(ids):
        n = chunk.shape[0]
        targets = ids[start + 1 : start + 1 + n]
        yield chunk[: targets.numel()], targets
        start += n


def build_reference(engine: Engine, outputs: dict[str, list[int]], config: QualityConfig) -> Reference:
    """Score the reference text with the baseline engine and keep what later steps compare to."""
    import torch

    ids = _reference_ids(engine, config)
    tops, top_lps, nlls = [], [], []
    for lp, targets in _scored(engine, ids):
        values, indices = lp.topk(min(TOP_K, lp.shape[-1]), dim=-1)
        tops.append(indices)
        top_lps.append(values)
        nlls.append(-lp.gather(1, targets.view(-1, 1))[:, 0])
    return Reference(token_ids=ids, top_ids=torch.cat(tops), top_logprobs=torch.cat(top_lps), token_nll=torch.cat(nlls), outputs=outputs,
                     top_k=config.top_k, top_k_positions=config.top_k_positions)


def model_probes(reference: Reference, engine: Engine) -> dict[str, Any]:
    """KL, flip rate and perplexity ratio of ``engine`` against the baseline, and how they were got.

    Exact wherever the runtime can say it: from the candidate's whole distributions
    (:meth:`Engine.next_token_logprobs`, ``kl_method: "full"``), else from the exact
    log-probabilities of the baseline's top tokens on the first ``reference.top_k_positions``
    positions (:meth:`Engine.token_logprobs`, ``"exact (... first N positions)"``). Only a runtime
    that gives neither falls back to its top-k rows (:meth:`Engine.top_logprobs`): the flip rate is
    then exact but KL only a lower bound, which a guard cannot be judged on
    (:func:`is_lower_bound`; the policy calls such a guard unknown). Else all None with
    ``"unavailable: <why>"``.
    """
    for probes in (_full_probes, _exact_probes, _top_k_probes):
        try:
            return probes(reference, engine)
        except NotImplementedError as e:
            why = f"unavailable: {e}"
    return {**dict.fromkeys(_PROBE_NUMBERS), "kl_method": why, "ppl_method": why}


_PROBE_NUMBERS = ("kl_mean", "kl_p99", "kl_max", "top1_flip", "ppl_ratio", "ppl_ratio_low", "ppl_ratio_high")
LOWER_BOUND = "top-k lower bound"  # how a kl_method that is only a lower bound begins


def is_lower_bound(kl_method: Any) -> bool:
    """True when the KL numbers were computed as a lower bound (a runtime's top-k rows only)."""
    return str(kl_method or "").startswith(LOWER_BOUND)


def _full_probes(reference: Reference, engine: Engine) -> dict[str, Any]:
    """The probes from full distributions.

    KL is computed over the baseline's top-K tokens plus one bucket for all other tokens (K = 256):
    the KL of these coarsened distributions, which is the metric the ``kl_*`` guards are defined on
    (docs/quality.md). It differs from the whole-vocabulary KL only by the part of the baseline's
    mass outside its top K.
    """
    import torch

    kls, flips, nlls = [], [], []
    start = 0
    for lp, targets in _scored(engine, reference.token_ids):
        n = lp.shape[0]
        top_ids = reference.top_ids[start : start + n]
        kls.append(_coarse_kl(reference.top_logprobs[start : start + n], lp.gather(1, top_ids)))
        flips.append(lp.gather(1, top_ids[:, :1])[:, 0] < lp.max(-1).values)  # a tie for first is no flip (topk.py)
        nlls.append(-lp.gather(1, targets.view(-1, 1))[:, 0])
        start += n
    kl = torch.cat(kls)
    return {**_kl_numbers(kl), "top1_flip": round(torch.cat(flips).float().mean().item(), 4),
            **_ppl_numbers(torch.cat(nlls) - reference.token_nll), "kl_method": "full", "ppl_method": "full"}


def _coarse_kl(base: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """KL(baseline || candidate) per position [n] over the baseline's top-K tokens and one bucket
    for the rest, from both sides' log-probabilities of those K tokens ([n, K])."""
    base_rest = (1 - base.exp().sum(-1)).clamp_min(1e-12)
    cand_rest = (1 - cand.exp().sum(-1)).clamp_min(1e-12)
    kl = (base.exp() * (base - cand)).sum(-1) + base_rest * (base_rest.log() - cand_rest.log())
    return kl.clamp_min(0)  # tiny negatives are rounding


def _exact_probes(reference: Reference, engine: Engine) -> dict[str, Any]:
    """The same numbers as :func:`_full_probes` on the first ``reference.top_k_positions``
    positions, from the candidate's exact log-probabilities of the baseline's top-K tokens and of
    the actual next token (:meth:`Engine.token_logprobs`; the row also holds the candidate's most
    likely token, so the flip rate is exact)."""
    import torch

    from .topk import flipped

    n = min(reference.top_k_positions, reference.top_ids.shape[0])
    top_ids, targets = reference.top_ids[:n].tolist(), reference.token_ids[1 : n + 1].tolist()
    rows = engine.token_logprobs(reference.token_ids[:n].tolist(), [ids + [t] for ids, t in zip(top_ids, targets)])
    if len(rows) < n:
        msg = f"{type(engine).__name__}.token_logprobs returned {len(rows)} rows for {n} positions"
        raise ValueError(msg)
    cand = torch.tensor([[row[t] for t in ids] for row, ids in zip(rows, top_ids)], dtype=torch.float64)
    kl = _coarse_kl(reference.top_logprobs[:n].double(), cand)
    flips = [flipped(row, ids[0]) for row, ids in zip(rows, top_ids)]
    nll = torch.tensor([-row[t] for row, t in zip(rows, targets)])
    method = f"exact (the baseline's top-{reference.top_ids.shape[1]} tokens, first {n} positions)"
    return {**_kl_numbers(kl), "top1_flip": round(sum(flips) / n, 4), **_ppl_numbers(nll - reference.token_nll[:n]),
            "kl_method": method, "ppl_method": method}


def _top_k_probes(reference: Reference, engine: Engine) -> dict[str, Any]:
    """The probes from the candidate's top-k rows on the first ``reference.top_k_positions``
    positions: the flip rate exactly, KL as a lower bound, perplexity where every actual next
    token is in its row (topk.py says why each holds)."""
    import torch

    from .topk import flipped, kl_lower_bound

    k = reference.top_k
    n = min(reference.top_k_positions, reference.top_ids.shape[0])
    # One token more than the rows kept: vLLM's row for a prompt's last position comes from the
    # generated token's top-k, which need not hold the actual next token (every other row does).
    rows = engine.top_logprobs(reference.token_ids[: n + 1].tolist(), k=k)[:n]
    if len(rows) < n:
        msg = f"{type(engine).__name__}.top_logprobs returned {len(rows)} rows for {n} positions"
        raise ValueError(msg)
    top_ids, top_lps = reference.top_ids[:n].tolist(), reference.top_logprobs[:n].tolist()
    targets = reference.token_ids[1 : n + 1].tolist()
    kls, flips, nlls = [], [], []
    for row, ids, lps, target in zip(rows, top_ids, top_lps, targets):
        kls.append(kl_lower_bound(dict(zip(ids, lps)), row))
        flips.append(flipped(row, ids[0]))
        nlls.append(-row[target] if target in row else None)
    missing = sum(v is None for v in nlls)
    out: dict[str, Any] = {**_kl_numbers(torch.tensor(kls, dtype=torch.float64)), "top1_flip": round(sum(flips) / n, 4)}
    if missing:
        out.update(dict.fromkeys(("ppl_ratio", "ppl_ratio_low", "ppl_ratio_high")))
        ppl_method = f"unavailable: the actual next token is outside the candidate's top-{k} at {missing} of {n} positions"
    else:
        out.update(_ppl_numbers(torch.tensor(nlls) - reference.token_nll[:n]))
        ppl_method = f"top-k (k={k}, first {n} positions; the actual next token is in every row)"
    return {**out, "kl_method": f"{LOWER_BOUND} (k={k}, first {n} positions)", "ppl_method": ppl_method}


def _kl_numbers(kl: torch.Tensor) -> dict[str, float]:
    """Mean, 99th percentile and max of per-position KLs [n]."""
    import torch

    return {"kl_mean": round(kl.mean().item(), 6), "kl_p99": round(torch.quantile(kl, 0.99).item(), 6), "kl_max": round(kl.max().item(), 6)}


def _ppl_numbers(diff: torch.Tensor) -> dict[str, float]:
    """Perplexity ratio and its 95% normal interval from per-token log-likelihood changes [n]."""
    mean, half = diff.mean().item(), 1.96 * diff.std().item() / math.sqrt(diff.numel())  # 95% normal interval
    return {"ppl_ratio": round(math.exp(mean), 4), "ppl_ratio_low": round(math.exp(mean - half), 4), "ppl_ratio_high": round(math.exp(mean + half), 4)}


def agreement_between(base: dict[str, list[int]], outputs: dict[str, list[int]]) -> float:
    """Share of requests whose token ids are identical in ``outputs`` and ``base`` (path equivalence)."""
    if not base:
        return 1.0
    return round(sum(1 for rid, ids in base.items() if outputs.get(rid) == ids) / len(base), 4)


def agreement(reference: Reference, outputs: dict[str, list[int]], cap: int | None = None) -> dict[str, Any]:
    """Greedy agreement of ``outputs`` with the baseline's outputs on the workload: per request, the
    share of the baseline's answer matched token by token before the first divergence, averaged;
    the first divergence's position; difflib's similarity. An answer that stopped at the plan's
    token ``cap`` is judged on the tokens it was allowed (a shorter cap is the application layer's
    choice, and the eval set shows what it costs); one that stopped early on its own is not."""
    import difflib

    ratios, first_div, similarity = [], [], []
    for rid, base in reference.outputs.items():
        cand = outputs.get(rid, [])
        similarity.append(difflib.SequenceMatcher(a=base, b=cand, autojunk=False).ratio() if base or cand else 1.0)
        n = 0
        for a, b in zip(base, cand):
            if a != b:
                break
            n += 1
        wanted = min(len(base), cap) if cap is not None and len(cand) >= cap else len(base)
        same = n == wanted and (len(cand) == len(base) or wanted < len(base))
        ratios.append(1.0 if same else n / max(1, wanted))
        if not same:
            first_div.append(n)
    return {
        "agreement": round(sum(ratios) / max(1, len(ratios)), 4),
        "first_divergence": min(first_div) if first_div else None,
        "similarity": round(sum(similarity) / max(1, len(similarity)), 4),
    }
