"""A model file truncated while ``llambda run`` generates from it (issue 39): the process ends
with one line naming the file and exit status 135 (128 + SIGBUS), no traceback, no core.

The SIGBUS handler comes from the kernel library (codegen/sigbus.py), never generated on
first use, so a new cache folder changes nothing. The file is truncated as soon as the first
generated text arrives, with the context far from full: no sleep, no guess of the speed."""
import os
import subprocess
import sys

import pytest

from llambda.model import convert
from llambda.runtime import faults, library
from synth import write_random_llama

CONTEXT = 32768         # the generation cannot end on its own before the truncation


@pytest.fixture(scope="module")
def model_llb(tmp_path_factory):
    folder = tmp_path_factory.mktemp("truncated")
    gguf = write_random_llama(folder / "m.gguf", n_layer=2, dim=64, n_head=2, n_kv_head=1, ffn_dim=128,
                              vocab_size=300, tensor_type="Q4_1", n_ctx=CONTEXT)
    return convert.convert(gguf, folder / "m.llb", progress=False)


def checkout_env(cache):
    """A checkout install as a user has it: a new, empty cache folder and the kernel library
    this test process uses (the checkout's own, built here first, unless LLAMBDA_KERNEL_DIR
    names another), so the process builds nothing."""
    library.ensure_built()
    env = {k: v for k, v in os.environ.items() if k != "LLAMBDA_BACKEND"}
    env["LLAMBDA_CACHE_DIR"] = str(cache)
    return env


def run_and_truncate(model, env, size):
    """Start ``llambda run`` on ``model``, truncate it to ``size`` bytes once the first text
    arrives, and return (exit status, stderr)."""
    command = [sys.executable, "-m", "llambda", "run", "--model", str(model), "--prompt", "Once upon a time",
               "--max-tokens", "100000", "--ignore-eos", "--ctx", str(CONTEXT), "--threads", "1"]
    with subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=env) as proc:
        try:
            first = proc.stdout.read1(1)        # blocks until the first token's text is written
            assert first, proc.stderr.read().decode()
            os.truncate(model, size)
            _, stderr = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    return proc.returncode, stderr.decode("utf-8", "replace")


@pytest.mark.parametrize("size", [4096, 0], ids=["header-left", "emptied"])
def test_a_model_truncated_while_run_generates_ends_with_one_line_naming_it(model_llb, tmp_path, size):
    model = tmp_path / "m.llb"
    model.write_bytes(model_llb.read_bytes())
    status, stderr = run_and_truncate(model, checkout_env(tmp_path / "new-cache"), size)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert status == faults.EXIT_STATUS, stderr
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert str(model) in lines[0] and "changed while in use" in lines[0], stderr
    assert not list((tmp_path / "new-cache").rglob("sigbus*")), "a handler was generated into the cache"
    assert not list(tmp_path.glob("core*"))


def test_the_handler_comes_from_the_kernel_library():
    """Its bytes are the library's function, with only the table's address to patch."""
    kernels = library.load()
    code = faults._handler_code(kernels)
    assert code is not None and len(code) == kernels.manifest["llb_sigbus_handler__avx2"]["code_bytes"]
    assert faults.arm(kernels)
