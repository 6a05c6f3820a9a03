"""Silence third-party chatter (load bars, import-time warnings) where our own report is the output.

The one place that does: used by the CLI, by :func:`fractal_opt.optimize` / ``Pipeline.run`` (so
a notebook shows the same clean progress as the terminal) and by the benchmarks before their first
line. A setting the user made (an environment variable set before) wins; nothing here imports
torch or transformers.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

__all__ = ["quiet_third_party"]


def quiet_third_party() -> None:
    """Quiet torchao's missing-kernel warnings on CPU, torch pytree deprecations, and the hub's
    and transformers' progress bars and advisory warnings (already imported modules included)."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # tqdm.auto in a notebook without ipywidgets warns on import (transformers imports it); the bars are off anyway.
    warnings.filterwarnings("ignore", message="IProgress not found")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if not _on_a_terminal():
        # Written to a file or a pipe (`make demo | tee`, CI), a bar's redraws pile up on one line
        # of thousands of characters (transformers' GGUF -> safetensors conversion draws a plain
        # tqdm bar); tqdm reads TQDM_DISABLE when it is imported. On a terminal a bar redraws in place.
        os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # The variables are read at import; a notebook may have imported these already.
    if "huggingface_hub" in sys.modules and os.environ.get("HF_HUB_DISABLE_PROGRESS_BARS") == "1":
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules and os.environ.get("TRANSFORMERS_VERBOSITY") == "error":
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def _on_a_terminal() -> bool:
    """Whether stderr, where progress bars draw, is a terminal."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False
