"""The shipped reference text (original prose, CC0): what the quality probes score and what
quantization calibration draws on. Pure data access, no torch."""

from __future__ import annotations

from importlib import resources

__all__ = ["reference_text"]


def reference_text() -> str:
    """The shipped reference text (original prose, CC0), without its header line."""
    text = (resources.files("fractal_opt") / "data" / "reference.txt").read_text(encoding="utf-8")
    return "\n".join(line for line in text.splitlines() if not line.startswith("# ")).strip()
