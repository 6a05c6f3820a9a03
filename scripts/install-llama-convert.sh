#!/usr/bin/env bash
# Install llama.cpp's own model converter (convert_hf_to_gguf.py, its `conversion` package and
# llama.cpp's gguf-py) from the xllamacpp sdist into the fractal-opt cache
# (fractal_opt.weights.llama_tools.converter_dir()), where fractal_opt.weights.convert finds it:
# a transformers model folder then reaches the llama_cpp runtime as a GGUF. Pure Python (no
# compiler); about a minute the first time (the sdist download), nothing after. FORCE=1 reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"

dest="$("$PY" -c 'from fractal_opt.weights.llama_tools import converter_dir; print(converter_dir())')"
if [ -f "$dest/convert_hf_to_gguf.py" ] && [ -z "${FORCE:-}" ]; then
    echo "install-llama-convert: already installed: $dest (FORCE=1 reinstalls)"
    exit 0
fi
src="$(bash scripts/llama-sources.sh)"
rm -rf "$dest.tmp"
mkdir -p "$dest.tmp"
cp -r "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" "$dest.tmp/"
# Qwen2's vocabulary as llama.cpp's own tests ship it (5.7 MB): the tests' tiny qwen2 model takes its
# tokenizer from it (fractal_opt/testing_families.py).
mkdir -p "$dest.tmp/vocab"
cp "$src/models/ggml-vocab-qwen2.gguf" "$dest.tmp/vocab/"
# The converter must import here (torch, transformers, sentencepiece, numpy, its own gguf-py).
"$PY" "$dest.tmp/convert_hf_to_gguf.py" --print-supported-models > "$dest.tmp/supported-models.txt" 2>&1 \
    || { tail -20 "$dest.tmp/supported-models.txt" >&2; echo "install-llama-convert: the converter does not run here" >&2; exit 1; }
rm -rf "$dest"
mv "$dest.tmp" "$dest"
echo "install-llama-convert: installed $dest ($(grep -c . "$dest/supported-models.txt") lines of supported architectures)"
