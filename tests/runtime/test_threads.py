"""Thread counts change who computes what, never the result.

Work is split by output columns, heads and rows, each computed with the same
summation order whatever the split, so logits must be bit-identical for any
thread count, including more threads than cores."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import llambda
from synth import write_random_llama


@pytest.fixture(scope="module", params=["Q4_1", "F16"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("threads") / f"tiny-{request.param}.gguf"
    write_random_llama(path, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300,
                       tensor_type=request.param, n_ctx=256, seed=3)
    return path


def _logits_and_decode(path, threads):
    with llambda.load(path, n_ctx=256, threads=threads, progress=False) as model:
        ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 150).tolist()
        prefill = model.logits(ids)
        steps = [model.evaluate(ids[:i]).copy() for i in (10, 11, 12)]
        return prefill, steps


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_results_identical_for_any_thread_count(tiny, threads):
    one_prefill, one_steps = _logits_and_decode(tiny, 1)
    prefill, steps = _logits_and_decode(tiny, threads)
    np.testing.assert_array_equal(prefill, one_prefill)
    for a, b in zip(steps, one_steps):
        np.testing.assert_array_equal(a, b)


def test_default_model_identical_on_one_and_two_threads(default_gguf):
    outputs = []
    for threads in (1, 2):
        with llambda.load(default_gguf, n_ctx=256, threads=threads, progress=False) as m:
            outputs.append("".join(m.generate("The capital of France is", max_tokens=16, temperature=0)))
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("threads", ["0", "-1", "two"])
def test_bad_thread_counts_are_clear_errors(tiny, threads):
    proc = subprocess.run([sys.executable, "-m", "llambda.cli", "run", "--model", str(tiny), "--threads", threads],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--threads" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_llambda_threads_variable(tiny):
    env = dict(os.environ, LLAMBDA_THREADS="0")
    proc = subprocess.run([sys.executable, "-m", "llambda.cli", "run", "--model", str(tiny)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode != 0 and "LLAMBDA_THREADS" in proc.stderr and "Traceback" not in proc.stderr


def test_ctrl_c_during_generation_exits_cleanly(tiny):
    """SIGINT mid-generation: the workers stop, the process exits promptly with 130."""
    proc = subprocess.Popen([sys.executable, "-m", "llambda.cli", "run", "--model", str(tiny), "--threads", "2",
                             "--max-tokens", "1000000", "--ctx", "200000", "--temperature", "1", "--ignore-eos"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # wait until it is generating (first bytes on stdout), then interrupt
    os.set_blocking(proc.stdout.fileno(), False)
    deadline = time.time() + 60
    while time.time() < deadline and not proc.stdout.read(1):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("llambda did not exit within 30 s of Ctrl-C")
    stderr = proc.stderr.read()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
