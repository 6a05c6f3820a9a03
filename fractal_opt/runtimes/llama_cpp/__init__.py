"""The llama.cpp runtime: GGUF models served by llama.cpp in this process through ``xllamacpp``.

- :mod:`.settings`: which plan fields map onto llama.cpp (and the reasons for those that do not);
- :mod:`.engine`: :class:`LlamaCppEngine`, the Engine protocol on ``xllamacpp.Server``;
- :mod:`.server`: the shared request server on llama.cpp's continuous batching;
- :mod:`.census`: what the GGUF file holds, read from its header.

Importing this package does not import xllamacpp; building an engine does.
"""

from __future__ import annotations

from .engine import LlamaCppEngine, clear_cache, evict_except

__all__ = ["LlamaCppEngine", "clear_cache", "evict_except"]
