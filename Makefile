# The two set-up commands of the README: `make serve` and `make test`.
PYTHON ?= python3
PIP := $(PYTHON) -m pip install --quiet --disable-pip-version-check

.PHONY: serve test install install-test protos

serve: install
	$(PYTHON) -m service $(ARGS)

test: install-test
	$(PYTHON) -m pytest -q $(ARGS)

install:
	$(PIP) -r requirements.txt

install-test:
	$(PIP) -r requirements-test.txt

# Regenerate generated/ from protos/ (checked in; a test fails when it is stale).
protos:
	$(PYTHON) -m generated
