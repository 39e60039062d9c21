"""The plan builder and the executor's calling convention (records -> registers, stack, xmm)."""
import ctypes
import gc
import weakref

import numpy as np
import pytest
from hypothesis import given, strategies as st

from helpers import float_arrays, nan_buffer, sizes

from llambda.runtime import buffers
from llambda.runtime.plan import (Plan, RECORD, MAX_INT_ARGS, MAX_FLOAT_ARGS, chunk_ranges, split_range,
                                  kernel_address)
from llambda.runtime.pool import WorkerPool

ECHO = "llb_echo_args__avx2"
ECHO_BYTES = 112


def echo_result(out):
    """What llb_echo_args__avx2 wrote: (a1..a12 as u64, (f0, f1), rsp % 16 at its entry)."""
    return list(out[:96].view(np.uint64)), tuple(out[96:104].view(np.float32)), int(out[104:].view(np.uint64)[0])


def test_record_layout_matches_the_generated_executor():
    from llambda.codegen import executor
    assert RECORD.itemsize == executor.RECORD_BYTES
    assert RECORD.fields["fn"][1] == executor.FN_OFFSET
    assert RECORD.fields["float_args"][1] == executor.FLOAT_ARGS_OFFSET
    assert RECORD.fields["barrier"][1] == executor.BARRIER_OFFSET
    assert RECORD.fields["chunks"][1] == executor.CHUNKS_OFFSET
    assert RECORD.fields["int_args"][1] == executor.INT_ARGS_OFFSET
    assert (MAX_INT_ARGS, MAX_FLOAT_ARGS) == (executor.MAX_INT_ARGS, executor.MAX_FLOAT_ARGS)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_every_argument_reaches_the_kernel(n_threads):
    """13 integer-class args (6 in registers, 7 on the stack) and 2 floats, per thread,
    with rsp 16-byte aligned at the call (so rsp % 16 == 8 at the kernel's entry)."""
    outs = [buffers.zeros(ECHO_BYTES, np.uint8) for _ in range(n_threads)]
    ints = [[1000 * t + k for k in range(1, 12)] + [-1 - t] for t in range(n_threads)]
    plan = Plan(n_threads)
    plan.add(ECHO, per_thread=[[outs[t]] + ints[t] for t in range(n_threads)], float_args=[1.5, -2.25e-7])
    with WorkerPool(n_threads) as pool:
        plan.run(pool)
    for t in range(n_threads):
        got_ints, got_floats, rsp_mod_16 = echo_result(outs[t])
        assert got_ints == [x % 2**64 for x in ints[t]]        # negative ints arrive two's complement
        assert got_floats == (np.float32(1.5), np.float32(-2.25e-7))
        assert rsp_mod_16 == 8


def test_patched_arguments_take_effect_without_rebuilding():
    out, other = buffers.zeros(ECHO_BYTES, np.uint8), buffers.zeros(ECHO_BYTES, np.uint8)
    plan = Plan(2)
    handle = plan.add(ECHO, per_thread=[[out] + list(range(12)), None], float_args=[0.0, 0.0])
    with WorkerPool(2) as pool:
        plan.run(pool)
        assert echo_result(out)[0][3] == 3
        plan.set_int_arg(handle, 4, 2**64 - 1)
        plan.set_float_arg(handle, 1, 7.0)
        plan.run(pool)
        ints, floats, _ = echo_result(out)
        assert ints[3] == 2**64 - 1 and floats == (0.0, 7.0)
        plan.set_int_arg(handle, 0, [other, None])      # per thread; None leaves thread 1 idle
        plan.run(pool)
        assert echo_result(other)[0][3] == 2**64 - 1
    assert plan.records["fn"][0, 1] == 0


def test_the_plan_keeps_its_arrays_alive_until_replaced():
    plan = Plan(1)
    out = buffers.zeros(ECHO_BYTES, np.uint8)
    alive = weakref.ref(out)
    handle = plan.add(ECHO, int_args=[out] + [0] * 12, float_args=[0, 0])
    del out
    gc.collect()
    assert alive() is not None
    plan.set_int_arg(handle, 0, buffers.zeros(ECHO_BYTES, np.uint8))
    gc.collect()
    assert alive() is None


@given(st.data(), sizes(8, 2000))
def test_copy_writes_exactly_n_floats(data, n):
    src = float_arrays(data.draw, (n,))
    guarded = nan_buffer(n + 16)            # NaN beyond n must stay NaN
    plan = Plan(1)
    plan.add("llb_copy_f32__avx2", int_args=[src, guarded, n])
    with WorkerPool(1, pin=False) as pool:
        plan.run(pool)
    np.testing.assert_array_equal(guarded[:n], src)     # a copy: bit-exact
    assert np.isnan(guarded[n:]).all()


def test_plans_grow_past_their_initial_capacity():
    src, dst = buffers.full(16, 3.0), buffers.zeros(16)
    plan = Plan(1)
    handles = [plan.add("llb_copy_f32__avx2", int_args=[src, dst, 16]) for _ in range(300)]
    assert handles == list(range(300)) and plan.n_ops == 300
    with WorkerPool(1) as pool:
        plan.run(pool)
    assert (dst == 3.0).all()


def test_a_plan_grown_after_a_run_runs_on_its_new_arrays():
    """The pool passes the records', chunks' and state's addresses it remembers from the
    plan's last run only while those arrays are the plan's: a plan grown past its capacity
    after a run (every array replaced) runs every op, old and new, and so does one rebuilt
    from its parts."""
    src, dst = buffers.full(16, 5.0), buffers.zeros(16)
    plan = Plan(2)
    plan.add("llb_copy_f32__avx2", chunks=[[src, dst, 16]])
    with WorkerPool(2) as pool:
        plan.run(pool)
        outs = [buffers.zeros(16) for _ in range(300)]
        for out in outs:
            plan.add("llb_copy_f32__avx2", chunks=[[dst, out, 8], [dst[8:], out[8:], 8]])
        plan.run(pool)
        assert all((out == 5.0).all() for out in outs)
        copy = Plan.from_parts(2, *plan.parts())
        for out in outs:
            out[:] = 0
        copy.run(pool)
    assert all((out == 5.0).all() for out in outs)


@given(st.integers(1, 5000), st.integers(1, 9), st.sampled_from([1, 8, 16, 64]))
def test_split_range_covers_the_range_in_aligned_chunks(n, n_threads, multiple):
    chunks = split_range(n, n_threads, multiple)
    assert len(chunks) == n_threads
    spans = [c for c in chunks if c is not None]
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))      # contiguous, in order
    assert all(start % multiple == 0 and stop > start for start, stop in spans)
    sizes = [stop - start for start, stop in spans[:-1]]             # the last one may be a short tail
    assert not sizes or max(sizes) - min(sizes) <= multiple
    assert len(spans) == min(n_threads, -(-n // multiple))          # idle only when work runs out


@given(st.integers(1, 5000), st.integers(1, 3000), st.sampled_from([1, 8, 16, 64]))
def test_chunk_ranges_cover_the_range_in_aligned_chunks(n, size, multiple):
    chunks = chunk_ranges(n, size, multiple)
    assert chunks[0][0] == 0 and chunks[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert all(start % multiple == 0 and stop > start for start, stop in chunks)
    rounded = -(-size // multiple) * multiple
    assert all(stop - start == rounded for start, stop in chunks[:-1])


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_every_chunk_gets_its_own_arguments(n_threads):
    """Dynamic ops: each chunk's 13 integers and the op's 2 floats reach the kernel,
    with rsp aligned, whichever thread claims the chunk; patches reach every chunk."""
    n_chunks = 7
    outs = [buffers.zeros(ECHO_BYTES, np.uint8) for _ in range(n_chunks)]
    ints = [[1000 * c + k for k in range(1, 12)] + [-1 - c] for c in range(n_chunks)]
    plan = Plan(n_threads)
    handle = plan.add(ECHO, chunks=[[outs[c]] + ints[c] for c in range(n_chunks)], float_args=[1.5, -2.0])
    assert plan.records["chunks"][handle].tolist() == [n_chunks] * n_threads
    with WorkerPool(n_threads) as pool:
        plan.run(pool)
        for c in range(n_chunks):
            got_ints, got_floats, rsp_mod_16 = echo_result(outs[c])
            assert got_ints == [x % 2**64 for x in ints[c]]
            assert got_floats == (np.float32(1.5), np.float32(-2.0)) and rsp_mod_16 == 8
        plan.set_int_arg(handle, 2, 77)
        plan.set_int_arg(handle, 3, [None] * (n_chunks - 1) + [5])
        plan.set_int_arg_of_ops([handle], 4, 99)
        plan.set_float_arg(handle, 0, 3.0)
        plan.run(pool)
    for c in range(n_chunks):
        got_ints, got_floats, _ = echo_result(outs[c])
        assert got_ints[1] == 77 and got_ints[3] == 99 and got_floats[0] == 3.0
        assert got_ints[2] == (5 if c == n_chunks - 1 else ints[c][2])


def test_bad_chunks_raise_before_anything_is_added():
    out = buffers.zeros(ECHO_BYTES, np.uint8)
    good = [out] + [0] * 12
    plan = Plan(2)
    with pytest.raises(ValueError, match="chunks: expected 1"):
        plan.add(ECHO, chunks=[], float_args=[0, 0])
    with pytest.raises(ValueError, match=r"chunks\[1\]: the kernel takes 13"):
        plan.add(ECHO, chunks=[good, good[:2]], float_args=[0, 0])
    with pytest.raises(ValueError, match=r"chunks\[0\]: every chunk needs"):
        plan.add(ECHO, chunks=[None], float_args=[0, 0])
    with pytest.raises(ValueError, match="give one of int_args, per_thread or chunks"):
        plan.add(ECHO, per_thread=[good, None], chunks=[good], float_args=[0, 0])
    with pytest.raises(ValueError, match="float_args: the kernel takes 2"):
        plan.add(ECHO, chunks=[good], float_args=[0])
    assert plan.n_ops == 0
    handle = plan.add(ECHO, chunks=[good, good, good], float_args=[0, 0])
    with pytest.raises(ValueError, match="value: expected one value per chunk"):
        plan.set_int_arg(handle, 1, [1, 2])


def test_ops_added_after_a_run_start_from_fresh_counters():
    src, dst = buffers.full(64, 2.0), buffers.zeros(64)
    plan = Plan(2)
    plan.add("llb_copy_f32__avx2", chunks=[[src[a:], dst[a:], b - a] for a, b in chunk_ranges(64, 16)])
    with WorkerPool(2) as pool:
        plan.run(pool)
        plan.run(pool)
        out = buffers.zeros(64)
        plan.add("llb_copy_f32__avx2", chunks=[[dst[a:], out[a:], b - a] for a, b in chunk_ranges(64, 32)])
        assert plan.runs == 0 and not plan.state.any()
        plan.run(pool)
    assert (out == 2.0).all() and plan.done.tolist() == [4, 2]


def test_bad_arguments_raise_before_anything_runs():
    out = buffers.zeros(ECHO_BYTES, np.uint8)
    good = [out] + [0] * 12
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="n_threads"):
            Plan(bad)
    plan = Plan(2)
    with pytest.raises(ValueError, match="int_args: the kernel takes 13"):
        plan.add(ECHO, int_args=good[:-1], float_args=[0, 0])
    with pytest.raises(ValueError, match="int_args: an op record holds at most 13"):
        plan.add(ECHO, int_args=good + [0], float_args=[0, 0])
    with pytest.raises(ValueError, match="float_args: the kernel takes 2"):
        plan.add(ECHO, int_args=good, float_args=[0])
    with pytest.raises(ValueError, match="float_args: expected a finite"):
        plan.add(ECHO, int_args=good, float_args=[0, float("nan")])
    with pytest.raises(ValueError, match="per_thread: expected one entry per thread"):
        plan.add(ECHO, per_thread=[good], float_args=[0, 0])
    with pytest.raises(ValueError, match="either int_args"):
        plan.add(ECHO, int_args=good, per_thread=[good, None], float_args=[0, 0])
    with pytest.raises(ValueError, match=r"per_thread\[1\]: the kernel takes 13"):
        plan.add(ECHO, per_thread=[good, good[:3]], float_args=[0, 0])
    with pytest.raises(ValueError, match="does not fit in 64 bits"):
        plan.add(ECHO, int_args=[out, 2**64] + [0] * 11, float_args=[0, 0])
    with pytest.raises(ValueError, match="expected an integer or a numpy array"):
        plan.add(ECHO, int_args=[out, 1.5] + [0] * 11, float_args=[0, 0])
    with pytest.raises(ValueError, match="kernel: kernel llb_nope__avx2 is not in"):
        plan.add("llb_nope__avx2")
    with pytest.raises(ValueError, match="kernel: expected a kernel symbol"):
        plan.add(12345)
    assert plan.n_ops == 0                  # nothing half-added
    handle = plan.add(ECHO, int_args=good, float_args=[0, 0])
    with pytest.raises(ValueError, match="handle"):
        plan.set_int_arg(handle + 1, 0, 0)
    with pytest.raises(ValueError, match="index: op 0 has integer arguments 0..12"):
        plan.set_int_arg(handle, 13, 0)
    with pytest.raises(ValueError, match="value: expected one value per thread"):
        plan.set_int_arg(handle, 1, [1, 2, 3])
    with pytest.raises(ValueError, match="index: op 0 has 2 float arguments"):
        plan.set_float_arg(handle, 2, 0.0)
    with WorkerPool(1) as pool, pytest.raises(ValueError, match="plan: built for 2 threads"):
        pool.run(plan)


def test_foreign_functions_need_float32_argtypes():
    libc = ctypes.CDLL(None)
    with pytest.raises(ValueError, match="has no argtypes"):
        kernel_address(libc.labs)
    libc.fabs.argtypes = [ctypes.c_double]
    with pytest.raises(ValueError, match="double arguments are not supported"):
        kernel_address(libc.fabs)
    libc.labs.argtypes = [ctypes.c_long]
    address, n_int, n_float = kernel_address(libc.labs)
    assert address and (n_int, n_float) == (1, 0)
