"""The four layer modules of the tower. Importing this package registers the built-in passes.

Layer modules must not import torch at module level: ``check`` and ``apply`` are pure plan
arithmetic, and the engine is the only place that touches torch state.
"""

from . import application, hardware, model, scheduling

__all__ = ["application", "hardware", "model", "scheduling"]
