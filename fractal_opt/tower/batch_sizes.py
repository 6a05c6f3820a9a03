"""llama.cpp's batch sizes (``hardware.n_batch`` / ``n_ubatch``): their defaults and what a pair
may be. Pure vocabulary, shared by the ``llama_batch`` pass (checked when a recipe loads) and the
llama_cpp runtime (its refusals), so neither imports the other.
"""

from __future__ import annotations

__all__ = ["N_BATCH_DEFAULT", "N_UBATCH_DEFAULT", "batch_problems"]

# llama.cpp's batch sizes when the plan sets none (common_params' defaults: xllamacpp.CommonParams()
# reads n_batch 2048, n_ubatch 512). n_batch caps the tokens of one llama_decode call (the server
# puts every slot's tokens of a step in one); n_ubatch caps one forward pass within it.
N_BATCH_DEFAULT = 2048
N_UBATCH_DEFAULT = 512


def batch_problems(n_batch: int | None, n_ubatch: int | None) -> dict[str, str]:
    """What is wrong with a pair of llama.cpp batch sizes (None = llama.cpp's default): the field
    name -> why, with what is allowed. Empty when llama.cpp runs them as given.

    llama.cpp does not refuse ``n_ubatch > n_batch``: it silently runs ``min(n_batch, n_ubatch)``
    (llama_context's constructor), so such a plan would not say what was measured.

    Example:
        >>> batch_problems(256, 512)["n_ubatch"][:24]
        'exceeds n_batch=256 and '
    """
    out = {name: "is not a token count >= 1 (or null: llama.cpp's default)" for name, value in (("n_batch", n_batch), ("n_ubatch", n_ubatch))
           if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1)}
    if out or n_ubatch is None:
        return out
    batch = N_BATCH_DEFAULT if n_batch is None else n_batch
    if n_ubatch > batch:
        given = f"n_batch={n_batch}" if n_batch is not None else f"llama.cpp's default n_batch of {N_BATCH_DEFAULT}"
        out["n_ubatch"] = (f"exceeds {given} and llama.cpp needs n_ubatch <= n_batch (a forward pass is a slice of one decode call; "
                           f"it would silently run {batch}). Lower n_ubatch or raise n_batch to at least {n_ubatch}")
    return out
