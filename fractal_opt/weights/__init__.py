"""The model's files: where a model comes from, and the GGUF / safetensors headers read without loading it."""
