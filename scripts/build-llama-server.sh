#!/usr/bin/env bash
# Build llama.cpp's tools for this CPU: llama-server (the llama_cpp runtime's `runtime_path:
# native`), llama-quantize (the GGUF weight ladder: K-quants and the rest, fractal_opt.weights.ladder)
# and rpc-server (a machine's CPU as a llama.cpp RPC backend, for a model split across processes).
#
# Why: the xllamacpp wheel is built for any x86-64 CPU (AVX2, no AVX-512), and no wheel on the
# registry ships these tools built for this one. The sources are the llama.cpp inside the sdist
# of the installed xllamacpp version (scripts/llama-sources.sh), so the build is the same
# llama.cpp as the wheel, with GGML_NATIVE=ON (-march=native) and GGML_RPC=ON (llama-server
# takes --rpc). Only these targets are built, without the parts that would download at build time
# (BoringSSL, llguidance) or need a system library (libcurl, OpenSSL): the runtime talks plain
# HTTP on the loopback interface. About 6 minutes on 2 cores. The executables go where
# fractal_opt.weights.llama_tools.native_tool() looks for them. The converter (pure Python) is
# installed first (scripts/install-llama-convert.sh), so a failed compile still leaves it.
# FORCE=1 rebuilds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
TOOLS=(llama-server llama-quantize rpc-server)  # the names they are installed under
TARGETS=(llama-server llama-quantize ggml-rpc-server)  # llama.cpp's CMake targets (and binaries) for them, in the same order

bash scripts/install-llama-convert.sh
dest="$("$PY" -c 'from fractal_opt.weights.llama_tools import native_dir; print(native_dir())')"
target="$dest/llama-server"
missing=0
for tool in "${TOOLS[@]}"; do [ -x "$dest/$tool" ] || missing=1; done
if [ "$missing" -eq 0 ] && [ -z "${FORCE:-}" ]; then
    echo "build-llama-server: already built: ${TOOLS[*]} in $dest (FORCE=1 rebuilds)"
    exit 0
fi
for tool in cmake c++ tar; do
    command -v "$tool" >/dev/null 2>&1 || { echo "build-llama-server: needs $tool on PATH (a C++ compiler and CMake build llama.cpp)" >&2; exit 1; }
done
src="$(bash scripts/llama-sources.sh)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

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
echo "build-llama-server: configuring (GGML_NATIVE=ON, GGML_RPC=ON)"
cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DGGML_RPC=ON -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_C_FLAGS="$isa_flags" -DCMAKE_CXX_FLAGS="$isa_flags" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_BORINGSSL=OFF -DLLAMA_LLGUIDANCE=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$work/configure.log" 2>&1 \
    || { tail -30 "$work/configure.log" >&2; exit 1; }
grep -h "CPU backend variant" "$work/configure.log" || true
echo "build-llama-server: compiling ${TOOLS[*]} on $(nproc) cores (about 6 minutes on 2)"
start=$(date +%s)
cmake --build "$work/build" --parallel "$(nproc)" --target "${TARGETS[@]}" > "$work/build.log" 2>&1 \
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
mkdir -p "$dest"
for i in "${!TOOLS[@]}"; do
    cp "$work/build/bin/${TARGETS[$i]}" "$dest/${TOOLS[$i]}.tmp"
    mv "$dest/${TOOLS[$i]}.tmp" "$dest/${TOOLS[$i]}"
done
echo "build-llama-server: built ${TOOLS[*]} in $dest in $(( $(date +%s) - start )) s"
"$target" --version 2>&1 | tail -2
