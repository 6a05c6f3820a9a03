"""Hugging Face transformers as a runtime: loading, quantization, torch knobs, static and continuous batching."""
