"""Test helpers shared by the kernel tests: buffers and values, and the qgemm scaffolding
(weights, activations, both backends' products, guard pages, bad-argument checks)."""
import contextlib
import dataclasses

import numpy as np
import pytest
from hypothesis import strategies as st

from llambda.codegen.contract import BLOCK, GROUP
from llambda.runtime import buffers, layouts


def nan_buffer(shape, dtype=np.float32):
    """An aligned output buffer pre-filled with NaN, so an unwritten element fails."""
    return buffers.full(shape, np.nan, dtype)


def sizes(tile, large=300):
    """Sizes hitting every edge of a tile: 1, tile-1, tile, tile+1, 2*tile+1, and some large."""
    edges = sorted({1, max(1, tile - 1), tile, tile + 1, 2 * tile + 1})
    return st.one_of(st.sampled_from(edges), st.integers(1, large))


def float_arrays(draw, shape, scale=None):
    """Values with zeros, negatives, large and tiny magnitudes mixed in."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = scale if scale is not None else draw(st.sampled_from([1e-3, 1.0, 30.0, 1e4]))
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
    if x.size and draw(st.booleans()):
        mask = rng.random(shape) < 0.1
        x[mask] = 0.0
    return buffers.aligned_copy(x, np.float32)


# ---------------------------------------------------------------- qgemm scaffolding

def runnable(isa, kind=None):
    """``isa``, or skip the test where this CPU does not run that qgemm variant (for ``kind``)."""
    from llambda.runtime.native import quant as n_quant
    if isa not in n_quant.qgemm_isas(kind):
        pytest.skip(f"this CPU does not run the {isa} qgemm kernels")
    return isa


def random_activations(m, k, seed):
    """Aligned standard-normal f32 activations [m, k], like a hidden state."""
    return buffers.aligned_copy(np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32))


def q8_activations(native, x):
    """``x`` [m, k] quantized by the native quantize_q8: (qs int8, d, s per 32-block)."""
    m, k = x.shape
    qs, d, s = buffers.empty((m, k), np.int8), buffers.empty((m, k // BLOCK)), buffers.empty((m, k // BLOCK))
    native.quantize_q8(x, qs, d, s)
    return qs, d, s


def quantized_activations(native, draw, m, k):
    """Drawn activations (float_arrays) quantized by quantize_q8."""
    return q8_activations(native, float_arrays(draw, (m, k)))


def activation_magnitudes(qs, d):
    """|d_a q_a| [m, k] (float64) of quantized activations: the other factor of every term."""
    m, k = qs.shape
    return (np.abs(qs.astype(np.float64)).reshape(m, -1, BLOCK) * d.astype(np.float64)[..., None]).reshape(m, k)


def qgemm_on(native, isa, qs, d, s, w):
    """The native qgemm's output on ``isa``, into a NaN-filled buffer."""
    out = nan_buffer((qs.shape[0], w.n))
    native.qgemm(qs, d, s, w, out, isa=isa)
    return out


def qgemm_both(native, ref, qs, d, s, w, isa=None, rows=None, first=0):
    """(native, reference) qgemm outputs for activation rows ``first``.. (views that are only
    element-aligned, as the last token's row of a prefill) and output columns ``rows`` =
    (n0, n1), written into NaN-filled [m, n] buffers; checks that nothing outside those rows
    and columns was written and returns the buffers' rows ``first``.."""
    m = qs.shape[0]
    got, want = nan_buffer((m, w.n)), nan_buffer((m, w.n))
    native.qgemm(qs[first:], d[first:], s[first:], w, got[first:], rows=rows, isa=isa)
    ref.qgemm(qs[first:], d[first:], s[first:], w, want[first:], rows=rows)
    n0, n1 = rows if rows is not None else (0, w.n)
    assert np.isnan(got[:first]).all() and np.isnan(got[:, :n0]).all() and np.isnan(got[:, n1:]).all()
    return got[first:], want[first:]


def assert_close_to_reference(got, want, bound):
    """Integer block sums are exact; the error is f32 rounding of the scale products and of the
    running sum over k/32 blocks (plus the reference's f32 dequantization): at most
    ~(k/32 + 3) * 2^-24 of ``bound`` = sum (|terms the kernel adds|) |a|, inside 1e-5 of it
    for k <= 4096, on every ISA (they do the same f32 operations)."""
    np.testing.assert_array_less(np.abs(got.astype(np.float64) - want), 1e-5 * bound + 1e-30)


def misaligned(array):
    """A copy of ``array`` that starts 16 bytes past a 32-byte boundary."""
    raw = buffers.empty(array.nbytes + 16, np.uint8)[16:]
    copy = raw.view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def before_a_guard_page(array, keep):
    """A copy of ``array`` that ends where an unreadable page begins (``keep`` holds the mapping)."""
    import ctypes
    import mmap
    page = mmap.PAGESIZE
    pages = -(-array.nbytes // page) + 1
    mapping = mmap.mmap(-1, pages * page)
    keep.append(mapping)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(base + (pages - 1) * page, page, 0) == 0     # PROT_NONE
    start = (pages - 1) * page - array.nbytes
    copy = np.frombuffer(mapping, np.uint8, array.nbytes, start).view(array.dtype).reshape(array.shape)
    copy[...] = array
    return copy


def before_guard_pages(w, keep):
    """The packed weight ``w`` with each of its arrays ending at an unreadable page."""
    return dataclasses.replace(w, arrays={name: before_a_guard_page(a, keep) for name, a in w.arrays.items()})


def assert_refused(cases):
    """Each (message, call) of ``cases``: call() raises a ValueError matching ``message``."""
    for message, call in cases:
        with pytest.raises(ValueError, match=message):
            call()


# GGUF 32-blocks: (bytes per block, f16 scale fields in front of the quants), ggml-common.h
LEGACY_BLOCKS = {"Q4_0": (18, 1), "Q4_1": (20, 2), "Q8_0": (34, 1), "Q5_0": (22, 1), "Q5_1": (24, 2)}


def random_gguf_weight(type_name, n, k, seed=0, magnitude=1.0):
    """Raw GGUF bytes [n, row bytes] of a 32-block type: arbitrary quant bytes, f16 scales
    (and mins) mixing zeros, signs and ``magnitude`` (clipped to the f16 range)."""
    rng = np.random.default_rng(seed)
    block_bytes, fields = LEGACY_BLOCKS[type_name]
    raw = rng.integers(0, 256, (n, k // BLOCK, block_bytes), dtype=np.uint8)
    finite = np.finfo(np.float16).max
    scales = np.clip(rng.standard_normal((n, k // BLOCK, fields)) * magnitude, -finite, finite).astype(np.float16)
    scales[rng.random(scales.shape) < 0.1] = 0
    raw[..., :2 * fields] = scales.view(np.uint8)
    return raw.reshape(n, -1)


def drawn_weight(draw, type_name, n, k):
    """A packed random_gguf_weight of drawn seed and magnitude."""
    seed = draw(st.integers(0, 2**32 - 1))
    magnitude = draw(st.sampled_from([1e-6, 1e-3, 1.0, 300.0]))
    return layouts.pack(type_name, random_gguf_weight(type_name, n, k, seed, magnitude), n, k)


def assert_reads_nothing_past_the_weight(native, ref, isa, w, m, seed, bound):
    """qgemm of ``w`` with each of its arrays ending at an unreadable page (a stray read would
    crash) against the reference, within ``bound(qs, d)``: m activation rows from ``seed``."""
    keep = []
    w = before_guard_pages(w, keep)
    qs, d, s = q8_activations(native, random_activations(m, w.k, seed))
    got, want = qgemm_both(native, ref, qs, d, s, w, isa)
    assert_close_to_reference(got, want, bound(qs, d))


def assert_on_row_slices(native, ref, isa, draw, w, m, bound):
    """qgemm on activation and output rows first.. of m (views only element-aligned: the last
    token's row of a prefill feeds the LM head without a copy), within ``bound(qs, d)``."""
    qs, d, s = quantized_activations(native, draw, m, w.k)
    first = draw(st.integers(1, m - 1))
    got, want = qgemm_both(native, ref, qs, d, s, w, isa, first=first)
    assert_close_to_reference(got, want, bound(qs[first:], d[first:]))


def assert_row_range_writes_only_its_columns(native, ref, isa, draw, w, m, bound):
    """qgemm on a drawn column range (n0, n1): threads split the columns at multiples of the
    row group (8), so a range may start at an odd row group and end inside one."""
    qs, d, s = quantized_activations(native, draw, m, w.k)
    n0 = GROUP * draw(st.integers(0, (w.n - 1) // GROUP))
    n1 = draw(st.integers(n0 + 1, w.n))
    got, want = qgemm_both(native, ref, qs, d, s, w, isa, rows=(n0, n1))
    assert_close_to_reference(got[:, n0:n1], want[:, n0:n1], bound(qs, d)[:, n0:n1])


def zero_operands(m, n, k):
    """Zero qgemm operands: qs int8 [m, k], d and s [m, k / 32], out [m, n]."""
    return (buffers.zeros((m, k), np.int8), buffers.zeros((m, k // BLOCK)), buffers.zeros((m, k // BLOCK)),
            buffers.zeros((m, n)))


@contextlib.contextmanager
def widest_isa_chosen_under(monkeypatch, cap):
    """runtime/native/quant.py with its (cached) choice of the widest qgemm variant made afresh
    under LLAMBDA_ISA = ``cap`` (None: unset; monkeypatch None: the environment as it is) and
    forgotten afterwards."""
    from llambda.runtime.native import quant as n_quant
    n_quant.widest_qgemm_isa.cache_clear()
    try:
        if monkeypatch is not None and cap:
            monkeypatch.setenv("LLAMBDA_ISA", cap)
        elif monkeypatch is not None:
            monkeypatch.delenv("LLAMBDA_ISA", raising=False)
        yield n_quant
    finally:
        n_quant.widest_qgemm_isa.cache_clear()


def smaps_bytes(field, spans):
    """The sum of ``field`` (e.g. "AnonHugePages:") over this process's mappings that overlap
    any [start, end) of ``spans``, each mapping counted once (/proc/self/smaps), or None when
    none does. An madvise of part of a mapping splits it, and the kernel merges neighbours."""
    overlaps, total, found = False, 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                overlaps = any(start < last and first < end for first, last in spans)
                found = found or overlaps
            elif overlaps and head == field:
                total += int(line.split()[1]) << 10
    return total if found else None


# -- comparing a model's logits with the reference's

def mean_kl(ref, fast):
    p = np.exp(ref - ref.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    lq = fast - fast.max(-1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    lp = np.log(np.maximum(p, 1e-30))
    return float((p * (lp - lq)).sum(-1).mean())


def random_prompt(vocab, n, seed):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()
