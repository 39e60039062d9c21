"""The profiler: the timed executor computes what the untimed one does, its stamps are
ordered, and the report accounts for every op of the plan and for all of a token's time.

No test asserts a time: only orderings, sums and the presence of every row.
"""
import json
import subprocess
import sys

import numpy as np
import pytest

import llambda
from llambda.model.forward import HEAD_TAG
from llambda.bench.profile import HEAD_SUFFIX, WAKE_UP, op_row
from llambda.runtime import library
from llambda.runtime import buffers
from llambda.runtime.plan import Plan, split_range
from llambda.runtime.pool import WorkerPool, read_tsc
from synth import write_random_llama

COPY = "llb_copy_f32__avx2"
SHAPE = dict(n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=96, vocab_size=300)
N_CTX = 256


# -- the timed executor -------------------------------------------------------------
def copy_chain(n, n_threads):
    """a -> b -> c -> a, split across threads; a barrier only after the middle copy
    (so stamps of ops with and without a barrier both occur)."""
    a, b, c = (buffers.zeros(n) for _ in range(3))
    a[:] = np.random.default_rng(n).standard_normal(n)
    plan = Plan(n_threads)
    for src, dst in ((a, b), (b, c), (c, a)):
        plan.add(COPY, per_thread=[None if chunk is None else [src[chunk[0]:chunk[1]], dst[chunk[0]:chunk[1]],
                                                                chunk[1] - chunk[0]]
                                   for chunk in split_range(n, n_threads, 16)],
                 barrier=src is b)
    return plan, (a, b, c)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_timed_run_computes_the_same_and_stamps_every_op_in_order(n_threads):
    n = 50_000
    plain, plain_bufs = copy_chain(n, n_threads)
    timed, timed_bufs = copy_chain(n, n_threads)
    stamps = timed.stamp_buffer()
    with WorkerPool(n_threads) as pool:
        plain.run(pool)
        before = read_tsc()
        timed.run(pool, stamps)
        after = read_tsc()
    for x, y in zip(plain_bufs, timed_bufs):
        np.testing.assert_array_equal(x, y)
    assert stamps.shape == (n_threads, timed.n_ops + 1, 2)
    ticks = stamps.astype(np.int64)
    for t in range(n_threads):
        entry, per_op = ticks[t, 0], ticks[t, 1:]
        assert entry[0] == entry[1]
        # entry <= returned(0) <= released(0) <= returned(1) <= ... on each thread's own clock
        sequence = np.concatenate([[entry[0]], per_op.ravel()])
        assert (np.diff(sequence) >= 0).all(), sequence
    assert before <= ticks[0, 0, 0] and ticks[0, -1, 1] <= after


def test_untimed_run_after_a_timed_one_and_an_empty_timed_plan():
    plan, _ = copy_chain(1000, 2)
    empty = Plan(2)
    with WorkerPool(2) as pool:
        empty_stamps = empty.stamp_buffer()
        pool.run(empty, empty_stamps)
        assert empty_stamps.shape == (2, 1, 2)
        pool.run(plan, plan.stamp_buffer())
        pool.run(plan)


def read_only(shape):
    out = np.zeros(shape, np.uint64)
    out.setflags(write=False)
    return out


@pytest.mark.parametrize("make_bad", [
    lambda plan: np.zeros(plan.stamp_shape, np.int64),
    lambda plan: np.zeros((plan.n_threads, plan.n_ops, 2), np.uint64),
    lambda plan: np.zeros((plan.n_threads + 1,) + plan.stamp_shape[1:], np.uint64),
    lambda plan: np.zeros(plan.stamp_shape[::-1], np.uint64).T,
    lambda plan: read_only(plan.stamp_shape),
    lambda plan: [0] * 10,
], ids=["dtype", "one-op-short", "threads", "not-contiguous", "read-only", "list"])
def test_bad_stamp_buffers_are_refused_and_the_pool_survives(make_bad):
    plan, bufs = copy_chain(1000, 2)
    with WorkerPool(2) as pool:
        with pytest.raises(ValueError, match="stamps"):
            pool.run(plan, make_bad(plan))
        pool.run(plan, plan.stamp_buffer())
    np.testing.assert_array_equal(bufs[0], bufs[2])


# -- the profiler on a model ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "tiny-Q4_1.gguf"
    write_random_llama(path, tensor_type="Q4_1", seed=11, n_ctx=N_CTX, **SHAPE)
    return path


@pytest.fixture(scope="module", params=[1, 2], ids=["1-thread", "2-threads"])
def tiny_model(request, tiny_gguf):
    model = llambda.load(tiny_gguf, n_ctx=N_CTX, threads=request.param, progress=False)
    yield model
    model.close()


def plan_rows(model, m):
    """(name, kernel) of every row the profile of a chunk of m tokens should have."""
    recorder = model.net._plan(m, True)
    return {op_row(op) for op in recorder.ops}


def check_phase(phase, rows, n_threads):
    assert {(op.name, op.kernel) for op in phase.ops} - {(WAKE_UP, "")} == rows
    for op in phase.ops:
        assert op.ms >= 0 and op.calls > 0
        assert 0 <= op.wait_pct <= 100
        assert op.gflops >= 0 and op.gbs >= 0
    # the ops' times add up to the native time exactly (they telescope)...
    assert sum(op.ms for op in phase.ops) == pytest.approx(phase.native_ms, rel=1e-9)
    # ...and native + dispatch + python to the wall time: shares of the whole token.
    total_pct = sum(op.pct for op in phase.ops) + phase.share(phase.dispatch_ms) + phase.python_pct
    assert total_pct == pytest.approx(100.0, abs=1.0)
    assert phase.python_ms >= 0 and phase.dispatch_ms >= 0
    assert len(phase.thread_busy_ms) == n_threads
    assert all(ms >= 0 for ms in phase.thread_busy_ms)


def test_report_covers_every_op_and_all_of_the_token(tiny_model):
    model = tiny_model
    model.evaluate([1, 2, 3])                   # something cached: profiling must clear it
    report = model.profile(tokens=6, prefill=32)
    n_layer = SHAPE["n_layer"]

    assert report.threads == model.net.threads
    assert report.tsc_hz > 0
    decode = report.decode
    assert decode.steps == 6 and decode.tokens_per_step == 1
    check_phase(decode, plan_rows(model, 1), report.threads)
    calls = {op.name: op.calls for op in decode.ops}
    assert len(calls) == len(decode.ops)                  # decode: one kernel per kind of op here
    assert calls["qgemm_q4_1"] == 7 * n_layer
    assert calls["attention"] == n_layer
    assert calls["qgemm_q4_1 (LM head)"] == 1             # tied embeddings: Q4_1 as well here

    prefill = report.prefill
    assert prefill.steps == 1 and prefill.tokens_per_step == 32
    check_phase(prefill, plan_rows(model, 32), report.threads)

    assert model.position == 0 and model._cached == []
    table = report.table()
    for name in {name for row in plan_rows(model, 1) for name in row} | {"python", "pool dispatch", "native"}:
        assert name in table
    out = json.loads(json.dumps(report.as_dict()))
    assert out["decode"]["python_pct"] == pytest.approx(decode.python_pct)
    assert {op["name"] for op in out["decode"]["ops"]} == {op.name for op in decode.ops}
    assert {op["kernel"] for op in out["decode"]["ops"]} == {op.kernel for op in decode.ops}


def test_every_op_names_the_kernel_it_calls(tiny_model):
    """A row leads to its generator: its kernel is a symbol of the library, ISA and tile
    in the name, the one the op's records call."""
    manifest = library.load().manifest
    for m in (1, 32):
        recorder = tiny_model.net._plan(m, 1)
        records = recorder.plan.records
        for handle, op in enumerate(recorder.ops):
            assert op.symbol in manifest, (op.name, op.symbol)
            assert "__" in op.symbol                      # ..._<tile>__<isa>
            chunks = recorder.plan.chunk_records(handle)      # a dynamic op's records, else the threads'
            fns = chunks["fn"] if len(chunks) else records["fn"][handle]
            called = {int(fn) for fn in fns if fn}
            assert called == {_address(op.symbol)}


def _address(symbol):
    import ctypes
    from llambda.runtime.native._lib import kernel
    return ctypes.cast(kernel(symbol), ctypes.c_void_p).value


def test_the_head_is_the_ops_the_model_tagged(tiny_model):
    """No guessing from the order of ops: the model tags the LM head's quantization and
    product, and nothing else (the final norm before it is a norm like the others)."""
    ops = tiny_model.net._plan(1, 1).ops
    tagged = [op for op in ops if op.tag == HEAD_TAG]
    assert [op.name for op in tagged] == ["quantize_q8", "qgemm_q4_1"]
    assert ops[-2:] == tagged and ops[-3].name == "rmsnorm" and not ops[-3].tag
    assert [op_row(op)[0] for op in tagged] == ["quantize_q8" + HEAD_SUFFIX, "qgemm_q4_1" + HEAD_SUFFIX]
    chunk = tiny_model.net._plan(4, 2).ops                 # every step ends with the head of its head rows
    assert [op.tag for op in chunk[-2:]] == [HEAD_TAG] * 2 and not any(op.tag for op in chunk[:-2])


def test_tags_nest_and_end_with_their_block(tiny_model):
    from llambda.runtime.recorder import PlanRecorder
    rec = PlanRecorder(1, 16, tiny_model.backend)
    x = buffers.zeros((1, 64))
    with rec.tagged("outer"):
        rec.scale(x, 2.0, x)
        with rec.tagged("inner"):
            rec.scale(x, 2.0, x)
        rec.scale(x, 2.0, x)
    rec.scale(x, 2.0, x)
    assert [op.tag for op in rec.ops] == ["outer", "inner", "outer", ""]
    assert {op.symbol for op in rec.ops} == {"llb_scale_f32__avx2"}


def test_profiling_then_generating_gives_what_generating_alone_gives(tiny_model):
    model = tiny_model
    want = "".join(model.generate([5, 6, 7], max_tokens=5, temperature=0))
    model.profile(tokens=3, prefill=0)
    assert "".join(model.generate([5, 6, 7], max_tokens=5, temperature=0)) == want


def test_the_timed_runner_gives_identical_logits(tiny_model):
    model = tiny_model
    ids = np.random.default_rng(3).integers(0, SHAPE["vocab_size"], 20).tolist()
    plain = [model.evaluate(ids[:k]).copy() for k in (17, 18, 19, 20)]     # a prefill, then decode
    model._cached = []
    with model.net.profile() as timer:
        timer.recording = True
        timed = [model.evaluate(ids[:k]).copy() for k in (17, 18, 19, 20)]
    assert len(timer.runs) == 4
    assert model.net.pool is timer.pool                   # the pool is back in place
    for a, b in zip(plain, timed):
        np.testing.assert_array_equal(a, b)
    model._cached = []


def test_decode_is_profiled_after_the_prompt_given(tiny_model):
    """Decode attention costs in proportion to the context: the steps run after the prompt
    given (ids or text), and a prompt the context cannot hold with them keeps its last ids."""
    from llambda.bench.profile import WARMUP_STEPS
    model = tiny_model
    ids = np.random.default_rng(4).integers(0, SHAPE["vocab_size"], 50).tolist()
    report = model.profile(tokens=4, prefill=0, prompt=ids)
    assert report.decode.positions == (50 + WARMUP_STEPS, 50 + WARMUP_STEPS + 3)
    assert report.prefill is None
    longer = ids * (N_CTX // 50 + 1)
    report = model.profile(tokens=4, prefill=0, prompt=longer)
    assert report.decode.positions == (N_CTX - 4, N_CTX - 1)          # the context, filled
    text = model.profile(tokens=2, prefill=0, prompt="hello world")
    assert text.decode.positions[0] == len(model.tokenize("hello world")) + WARMUP_STEPS
    for bad, message in (([], "at least one"), ([SHAPE["vocab_size"]], "outside"), ([1, "x"], "token ids"),
                         ([1.5], "token ids"), ([True], "token ids"), (["3"], "token ids")):
        with pytest.raises(ValueError, match=f"prompt: .*{message}"):
            model.profile(tokens=2, prompt=bad)


def test_bad_arguments(tiny_model):
    for bad in (0, -1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="tokens"):
            tiny_model.profile(tokens=bad)
    with pytest.raises(ValueError, match="prefill"):
        tiny_model.profile(prefill=-1)


def test_the_numpy_backend_has_no_plan_to_profile(tiny_gguf):
    model = llambda.load(tiny_gguf, n_ctx=64, backend="numpy", progress=False)
    with pytest.raises(ValueError, match="profile"):
        model.profile(tokens=2)


def test_cli_run_profile_prints_the_table_to_stderr(tiny_gguf):
    proc = subprocess.run([sys.executable, "-m", "llambda.cli", "run", "--model", str(tiny_gguf),
                           "--ctx", "128", "--threads", "2", "--max-tokens", "3", "--temperature", "0",
                           "--profile"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "| op" not in proc.stdout
    for needle in ("llambda profile:", "decode:", "prefill:", "qgemm_q4_1", "**python**"):
        assert needle in proc.stderr, proc.stderr


def test_cli_run_profile_decodes_after_the_runs_prompt(tiny_gguf, tmp_path):
    from llambda.bench.profile import WARMUP_STEPS
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello world " * 5)
    proc = subprocess.run([sys.executable, "-m", "llambda.cli", "run", "--model", str(tiny_gguf),
                           "--ctx", "128", "--max-tokens", "2", "--temperature", "0", "--json",
                           "--prompt-file", str(prompt), "--profile"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    n_prompt = len(json.loads(proc.stdout)["prompt_ids"])
    assert n_prompt > 10
    assert f"tokens at positions {n_prompt + WARMUP_STEPS}.." in proc.stderr, proc.stderr


def test_attention_work_honours_the_sliding_window():
    """A windowed attention op is costed over the keys its queries see, not the whole prefix."""
    from types import SimpleNamespace
    from llambda.bench.profile import _work
    from llambda.runtime.recorder import OpInfo
    config = SimpleNamespace(n_head=4, n_kv_head=1, head_dim=256)
    run = SimpleNamespace(m=3, pos0=100)
    unlimited = _work(OpInfo("attention"), run, config)
    windowed = _work(OpInfo("attention", window=8), run, config)
    assert unlimited == (4.0 * 3 * 4 * 256 * (100 + 2), 8.0 * 256 * 103)
    assert windowed == (4.0 * 4 * 256 * 3 * 8, 8.0 * 256 * (8 + 2))
    early = SimpleNamespace(m=1, pos0=2)                 # the window not yet full
    assert _work(OpInfo("attention", window=8), early, config) == _work(OpInfo("attention"), early, config)


def test_the_default_prefill_chunk_is_one_step_of_the_model(tmp_path):
    """Without ``prefill``, the profile times the chunk prefill really runs: 128 rows, 256 for
    a float model (llambda/model/forward.py FLOAT_BATCH), at most the context."""
    from llambda.model.forward import DEFAULT_BATCH, FLOAT_BATCH
    for tensor_type, rows in (("Q4_1", DEFAULT_BATCH), ("F16", FLOAT_BATCH)):
        path = write_random_llama(tmp_path / f"step-{tensor_type}.gguf", tensor_type=tensor_type, seed=5,
                                  n_ctx=512, **SHAPE)
        with llambda.load(path, n_ctx=512, progress=False) as model:
            assert model.profile(tokens=2).prefill.tokens_per_step == rows
        with llambda.load(path, n_ctx=96, progress=False) as model:
            assert model.profile(tokens=2).prefill.tokens_per_step == 96
