"""Elementwise and row-wise FP32 kernels: add, scale, exp, SiLU*mul, GELU*mul, bias add, RMSNorm,
softmax and RoPE.

Every kernel handles any length: unrolled steps of several 8-lane vectors,
then single vectors, then one masked vector for the tail (VMASKMOVPS), so
nothing beyond a row is read or written. ``stream`` emits that loop shape once
for all of them; a kernel only says what one vector step does (``streaming_kernel``
and ``row_kernel`` emit the function around it). Rows need not be
32-byte aligned (unaligned loads cost nothing on aligned data), which is what
lets row kernels take any row length.

Row kernels (RMSNorm, softmax, RoPE) take the number of rows, so a whole
prefill batch is one call. They are memory-bound: each pass over a row after
the first hits L1, and no pass does a horizontal operation inside its loop.
"""
from peachpy import Constant
from peachpy.x86_64 import (GeneralPurposeRegister64, YMMRegister, XMMRegister, LOAD, Loop,
                            RETURN, LABEL, Label, JMP, JB, JNZ, JBE, ADD, SUB, MOV, IMUL,
                            LEA, SHR, XOR, VADDPS, VMULPS, VDIVPS, VSUBPS, VMAXPS, VANDPS, VXORPS,
                            VMOVAPS, VBROADCASTSS, VBLENDVPS, VPERMILPS, VPERM2F128,
                            VFMADD231PS, VFMADD132PS, VCVTPS2PD, VEXTRACTF128, VFMADD231PD, VADDPD, VPERMILPD,
                            VXORPD, VUCOMISS, VCVTSS2SD, VCVTSI2SD, VDIVSD, VADDSD, VSQRTSD, VMOVAPD,
                            VCVTSD2SS)

from .common import LANES, Kernel, fold_lanes, function, stream, symbol
from .vmath import exp_ps

FAMILY = "elementwise"
FLOAT_BYTES = 4

# Vectors per unrolled step: enough independent work to hide latency, small
# enough that the step's registers (and exp_ps's scratch) fit in 16 ymm.
UNROLL_STREAMING = 4     # one or two operations per vector: add, scale, RMSNorm/softmax output
UNROLL_EXP = 2           # exp_ps needs 3-4 live registers per vector

# RMSNorm sums squares in f32; a row whose sum leaves this range (overflow of
# huge values, underflow of tiny ones, NaN) is summed again in f64.
RMS_F32_SUM_MAX = 2.0 ** 120
RMS_F32_SUM_MIN = 2.0 ** -60


# --------------------------------------------------------------------------- stream loops

def stream_row(length, step, unroll, extra_offsets=()):
    """``stream`` over one row of ``length`` floats with fresh index registers.

    ``extra_offsets`` are GP registers holding byte offsets: each adds an
    index register starting there (a second stream within the same row)."""
    count, index = GeneralPurposeRegister64(), GeneralPurposeRegister64()
    MOV(count, length)
    XOR(index.as_dword, index.as_dword)
    indices = [index]
    for offset in extra_offsets:
        shifted = GeneralPurposeRegister64()
        MOV(shifted, offset)
        indices.append(shifted)
    stream(count, indices, step, unroll)


def load_arguments(args):
    """One GP register per argument (pointers and sizes), in order."""
    regs = []
    for arg in args:
        reg = GeneralPurposeRegister64()
        LOAD.ARGUMENT(reg, arg)
        regs.append(reg)
    return regs


def load_float_argument(arg):
    """A float argument broadcast to all 8 lanes."""
    value = YMMRegister()
    LOAD.ARGUMENT(value.as_xmm, arg)
    VBROADCASTSS(value, value.as_xmm)
    return value


def combine(op, accumulators):
    """Fold a list of accumulators into the first (pairwise, to keep the chain short)."""
    while len(accumulators) > 1:
        for a, b in zip(accumulators[0::2], accumulators[1::2]):
            op(a, a, b)
        accumulators = accumulators[0::2]
    return accumulators[0]


def negative_zero():
    return Constant.float32x8(-0.0)


# --------------------------------------------------------------------------- kernel skeletons

def f32_kernel(isa, name, sig, body, types="f32"):
    """Kernel ``name`` of C signature ``sig``: ``body(*arguments)`` emits its code up to the return."""
    fn, args = function(symbol(name, types, "", isa), sig, isa)
    with fn:
        body(*args)
        RETURN()
    return Kernel(fn, FAMILY, isa, tile=f"{LANES}", args=sig)


def load_by_name(sig, args):
    """The arguments by name: integers and pointers loaded into GP registers (in order), and
    the float arguments themselves, for the caller to load as it needs them."""
    integers = [(arg_name, arg) for (arg_name, ctype), arg in zip(sig, args) if ctype != "float"]
    registers = dict(zip((arg_name for arg_name, _ in integers), load_arguments(arg for _, arg in integers)))
    floats = {arg_name: arg for (arg_name, ctype), arg in zip(sig, args) if ctype == "float"}
    return registers, floats


def streaming_kernel(isa, name, sig, unroll, step):
    """Kernel ``name`` over the ``n`` floats of its arrays (``n`` last in ``sig``): ``step(v,
    **arguments)`` emits the work of one ``stream`` vector ``v``, given every other argument
    by name: pointers in GP registers, floats broadcast to a ymm."""
    def body(*args):
        registers, floats = load_by_name(sig, args)
        registers.update((arg_name, load_float_argument(arg)) for arg_name, arg in floats.items())
        n = registers.pop(sig[-1][0])
        index = GeneralPurposeRegister64()
        XOR(index.as_dword, index.as_dword)
        stream(n, [index], lambda v: step(v, **registers), unroll)
    return f32_kernel(isa, name, sig, body)


def row_kernel(isa, name, sig, row, prepare=None):
    """Kernel ``name`` over ``rows`` rows of floats from ``x`` to ``out`` (the row length is the
    argument after ``rows``): ``row(**values)`` emits one row's work, then x and out step to
    the next row. ``values`` holds the integer and pointer arguments by name, in GP
    registers, and what ``prepare(**values, **float_arguments)`` returns (run once, before
    the loop: it loads the float arguments as it needs them)."""
    def body(*args):
        values, floats = load_by_name(sig, args)
        if prepare is not None:
            values.update(prepare(**values, **floats))
        names = [arg_name for arg_name, _ in sig]
        row_bytes = GeneralPurposeRegister64()
        LEA(row_bytes, [values[names[names.index("rows") + 1]] * FLOAT_BYTES])
        with Loop() as row_loop:
            row(**values)
            ADD(values["x"], row_bytes)
            ADD(values["out"], row_bytes)
            SUB(values["rows"], 1)
            JNZ(row_loop.begin)
    return f32_kernel(isa, name, sig, body)


# --------------------------------------------------------------------------- elementwise

def emit_add(isa):
    """out[i] = a[i] + b[i] for i < n."""
    def step(v, a, b, out):
        x, y = YMMRegister(), YMMRegister()
        v.load(x, a)
        v.load(y, b)
        VADDPS(x, x, y)
        v.store(out, x)

    sig = [("a", "const float*"), ("b", "const float*"), ("out", "float*"), ("n", "size_t")]
    return streaming_kernel(isa, "add", sig, UNROLL_STREAMING, step)


def emit_scale(isa):
    """out[i] = x[i] * s for i < n."""
    def step(v, x, s, out):
        value = YMMRegister()
        v.load(value, x)
        VMULPS(value, value, s)
        v.store(out, value)

    sig = [("x", "const float*"), ("s", "float"), ("out", "float*"), ("n", "size_t")]
    return streaming_kernel(isa, "scale", sig, UNROLL_STREAMING, step)


def emit_exp(isa):
    """out[i] = exp(x[i]) for i < n: vmath.exp_ps as a kernel, so it can be tested on its own."""
    def step(v, x, out):
        value, t1, t2 = YMMRegister(), YMMRegister(), YMMRegister()
        v.load(value, x)
        exp_ps(value, value, t1, t2)
        v.store(out, value)

    sig = [("x", "const float*"), ("out", "float*"), ("n", "size_t")]
    return streaming_kernel(isa, "exp", sig, UNROLL_EXP, step)


def store_gated(v, g, e, spare, up, out):
    """out = g / (1 + e) * up for vector ``v``: both gates are g * sigmoid(something), and
    ``e`` is exp(-something) (it is overwritten, and ``spare`` clobbered)."""
    VADDPS(e, e, Constant.float32x8(1.0))
    VDIVPS(e, g, e)
    v.load(spare, up)
    VMULPS(e, e, spare)
    v.store(out, e)


GATED_SIGNATURE = [("gate", "const float*"), ("up", "const float*"), ("out", "float*"), ("n", "size_t")]


def emit_silu_mul(isa):
    """out[i] = gate[i] / (1 + exp(-gate[i])) * up[i] for i < n (SwiGLU's SiLU(gate) * up).

    The division is a real VDIVPS: exact, and cheaper than it looks next to
    exp. Very negative gates make exp(-g) inf, so the quotient is -0."""
    def step(v, gate, up, out):
        g, e, t1, t2 = YMMRegister(), YMMRegister(), YMMRegister(), YMMRegister()
        v.load(g, gate)
        VXORPS(e, g, negative_zero())                   # -g
        exp_ps(e, e, t1, t2)
        store_gated(v, g, e, t1, up, out)

    return streaming_kernel(isa, "silu_mul", GATED_SIGNATURE, UNROLL_EXP, step)


# GELU, tanh approximation (as llama.cpp's ggml_gelu and Gemma use):
#   gelu(x) = 0.5 x (1 + tanh(y)),  y = sqrt(2/pi) (x + 0.044715 x^3)
#           = x / (1 + exp(-2y))            (0.5 (1 + tanh y) = 1 / (1 + e^-2y))
# The second form has no tanh to overflow and no 1 + tanh(y) cancelling to 0
# for negative x; -2y = x (GELU_K1 + GELU_K2 x^2) is one FMA and a multiply.
GELU_SQRT_2_OVER_PI = 0.79788456080286535588
GELU_COEF_A = 0.044715
GELU_K1 = -2.0 * GELU_SQRT_2_OVER_PI
GELU_K2 = -2.0 * GELU_SQRT_2_OVER_PI * GELU_COEF_A
# Gates are clamped below at GELU_CLAMP first, where gelu is already -0 in f32
# (exp(-2y) overflows): then -inf gives -0 rather than -inf / inf = NaN. NaN stays NaN.
GELU_CLAMP = -20.0


def emit_gelu_mul(isa):
    """out[i] = gelu_tanh(gate[i]) * up[i] for i < n (GeGLU, Gemma's FFN).

    Computed as gate / (1 + exp(-2y)) (see GELU_K1): huge positive gates give
    gate (exp(-2y) is 0, x^3 may be inf), huge negative ones -0, never NaN."""
    def step(v, gate, up, out):
        g, z, t1, t2 = YMMRegister(), YMMRegister(), YMMRegister(), YMMRegister()
        v.load(z, gate)
        VMOVAPS(g, Constant.float32x8(GELU_CLAMP))
        VMAXPS(g, g, z)                                 # constant first: a NaN gate survives
        VMULPS(z, g, g)
        VMOVAPS(t1, Constant.float32x8(GELU_K1))
        VFMADD132PS(z, t1, Constant.float32x8(GELU_K2))   # K2 x^2 + K1
        VMULPS(z, z, g)                                 # -2y
        exp_ps(z, z, t1, t2)
        store_gated(v, g, z, t1, up, out)

    return streaming_kernel(isa, "gelu_mul", GATED_SIGNATURE, UNROLL_EXP, step)


def emit_add_bias(isa):
    """out[r, :] = x[r, :] + bias[:] for each of ``rows`` rows of ``n`` floats (Q/K/V biases).

    out may be x: each element is read before it is written."""
    def row(x, bias, out, rows, n):
        def step(v):
            value, b = YMMRegister(), YMMRegister()
            v.load(value, x)
            v.load(b, bias)
            VADDPS(value, value, b)
            v.store(out, value)

        stream_row(n, step, UNROLL_STREAMING)

    sig = [("x", "const float*"), ("bias", "const float*"), ("out", "float*"), ("rows", "size_t"),
           ("n", "size_t")]
    return row_kernel(isa, "add_bias", sig, row)


# --------------------------------------------------------------------------- RMSNorm

def sum_squares_f32(row, length):
    """Sum of squares of a row, in f32 with one accumulator per unrolled vector.

    Returns a ymm whose every lane holds the sum."""
    accumulators = [YMMRegister() for _ in range(UNROLL_STREAMING)]
    for acc in accumulators:
        VXORPS(acc, acc, acc)

    def step(v):
        value = YMMRegister()
        v.load(value, row)                      # masked lanes load 0: they add nothing
        VFMADD231PS(accumulators[v.group], value, value)

    stream_row(length, step, UNROLL_STREAMING)
    total = combine(VADDPS, accumulators)
    fold_lanes(VADDPS, total)
    return total


def sum_squares_f64(row, length, total):
    """Sum of squares of a row in f64 into the xmm ``total`` (low lane): the slow, safe path."""
    unroll = 2
    accumulators = [YMMRegister() for _ in range(2 * unroll)]
    for acc in accumulators:
        VXORPD(acc, acc, acc)

    def step(v):
        value, low, high = YMMRegister(), YMMRegister(), YMMRegister()
        v.load(value, row)
        VCVTPS2PD(low, value.as_xmm)
        VEXTRACTF128(high.as_xmm, value, 1)
        VCVTPS2PD(high, high.as_xmm)
        VFMADD231PD(accumulators[2 * v.group], low, low)
        VFMADD231PD(accumulators[2 * v.group + 1], high, high)

    stream_row(length, step, unroll)
    acc = combine(VADDPD, accumulators)
    swapped = YMMRegister()
    VPERM2F128(swapped, acc, acc, 0x01)
    VADDPD(acc, acc, swapped)
    VPERMILPD(swapped.as_xmm, acc.as_xmm, 0b01)
    VADDSD(total, acc.as_xmm, swapped.as_xmm)


def sum_squares(row, length):
    """Sum of squares of a row, as an f64 in the low lane of the returned xmm.

    f32 lanes first; a sum that overflowed (|x| beyond ~1e19), is so small
    that its squares underflowed, or is NaN is done again in f64."""
    sum_f32 = sum_squares_f32(row, length)
    total = XMMRegister()
    slow, done = Label(), Label()
    # (Constants are loaded as whole ymm: PeachPy needs one constant size per function.)
    limit = YMMRegister()
    VMOVAPS(limit, Constant.float32x8(RMS_F32_SUM_MAX))
    VUCOMISS(limit.as_xmm, sum_f32.as_xmm)
    JBE(slow)                                   # sum >= MAX, or NaN (unordered)
    VMOVAPS(limit, Constant.float32x8(RMS_F32_SUM_MIN))
    VUCOMISS(sum_f32.as_xmm, limit.as_xmm)
    JB(slow)                                    # sum < MIN (tiny or zero row)
    VCVTSS2SD(total, sum_f32.as_xmm, sum_f32.as_xmm)
    JMP(done)
    LABEL(slow)
    sum_squares_f64(row, length, total)
    LABEL(done)
    return total


def inverse_rms(sum_of_squares, d_f64, eps_f64):
    """1 / sqrt(sum / d + eps) computed in f64 (no overflow for any float row),
    rounded once to f32 and broadcast to a ymm. Clobbers ``sum_of_squares``."""
    ss = sum_of_squares
    VDIVSD(ss, ss, d_f64)
    VADDSD(ss, ss, eps_f64)
    VSQRTSD(ss, ss, ss)
    one = YMMRegister()
    VMOVAPD(one, Constant.float64x4(1.0))
    VDIVSD(ss, one.as_xmm, ss)
    inv_rms = YMMRegister()
    VCVTSD2SS(inv_rms.as_xmm, ss, ss)
    VBROADCASTSS(inv_rms, inv_rms.as_xmm)
    return inv_rms


def emit_rmsnorm(isa):
    """out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w for each of ``rows`` rows of ``d`` floats.

    Two passes per row: the sum of squares (``sum_squares``), then the scaled
    output. Huge rows (|x| ~ 1e30) normalise like ordinary ones."""
    def prepare(d, eps, **_):
        eps_f64 = XMMRegister()
        LOAD.ARGUMENT(eps_f64, eps)
        VCVTSS2SD(eps_f64, eps_f64, eps_f64)
        d_f64 = XMMRegister()
        VXORPD(d_f64, d_f64, d_f64)
        VCVTSI2SD(d_f64, d_f64, d)
        return dict(eps_f64=eps_f64, d_f64=d_f64)

    def row(x, w, out, rows, d, eps_f64, d_f64):
        inv_rms = inverse_rms(sum_squares(x, d), d_f64, eps_f64)

        def normalize(v):
            value, weight = YMMRegister(), YMMRegister()
            v.load(value, x)
            v.load(weight, w)
            VMULPS(value, value, inv_rms)
            VMULPS(value, value, weight)
            v.store(out, value)

        stream_row(d, normalize, UNROLL_STREAMING)

    sig = [("x", "const float*"), ("w", "const float*"), ("out", "float*"),
           ("rows", "size_t"), ("d", "size_t"), ("eps", "float")]
    return row_kernel(isa, "rmsnorm", sig, row, prepare)


# --------------------------------------------------------------------------- softmax

def row_max(row, length):
    """Maximum of a row; every lane of the returned ymm holds it."""
    accumulators = [YMMRegister() for _ in range(UNROLL_STREAMING)]
    for acc in accumulators:
        VMOVAPS(acc, Constant.float32x8(float("-inf")))

    def step(v):
        acc = accumulators[v.group]
        if v.mask is None:
            VMAXPS(acc, acc, v.address(row))
        else:
            value = YMMRegister()
            v.load(value, row)
            VBLENDVPS(value, acc, value, v.mask)        # unused lanes repeat acc: max unchanged
            VMAXPS(acc, acc, value)

    stream_row(length, step, UNROLL_STREAMING)
    total = combine(VMAXPS, accumulators)
    fold_lanes(VMAXPS, total)
    return total


def emit_softmax(isa):
    """out[r] = exp(x[r] - max(x[r])) / sum(...) for each of ``rows`` rows of ``n`` floats.

    Three passes: max; exp stored to out and summed; scale by 1/sum. out may
    be x: every pass reads an element before it writes it. -inf gives 0."""
    def row(x, out, rows, n):
        peak = row_max(x, n)
        sums = [YMMRegister() for _ in range(UNROLL_EXP)]
        for acc in sums:
            VXORPS(acc, acc, acc)

        def exponentiate(v):
            e, t1, t2 = YMMRegister(), YMMRegister(), YMMRegister()
            v.load(e, x)
            VSUBPS(e, e, peak)
            exp_ps(e, e, t1, t2)
            v.store(out, e)
            if v.mask is not None:
                VANDPS(e, e, v.mask)                # unused lanes hold exp(-max)
            VADDPS(sums[v.group], sums[v.group], e)

        stream_row(n, exponentiate, UNROLL_EXP)
        total = combine(VADDPS, sums)
        fold_lanes(VADDPS, total)
        inv_sum = YMMRegister()
        VMOVAPS(inv_sum, Constant.float32x8(1.0))
        VDIVPS(inv_sum, inv_sum, total)

        def normalize(v):
            value = YMMRegister()
            v.load(value, out)
            VMULPS(value, value, inv_sum)
            v.store(out, value)

        stream_row(n, normalize, UNROLL_STREAMING)

    sig = [("x", "const float*"), ("out", "float*"), ("rows", "size_t"), ("n", "size_t")]
    return row_kernel(isa, "softmax", sig, row)


# --------------------------------------------------------------------------- RoPE

ROPE_SIGNATURE = [("x", "const float*"), ("positions", "const int32_t*"), ("cos", "const float*"),
                  ("sin", "const float*"), ("out", "float*"), ("m", "size_t"), ("n_heads", "size_t"),
                  ("head_dim", "size_t")]


def rotate_pairs(x_head, out_head, cos_row, sin_row, head_dim):
    """One head, llama.cpp/GGUF convention: out = x*cos + swap_adjacent(x)*sin.

    A vector starts at an even lane of the head (heads and vectors have even
    sizes), so the swap never crosses a pair, the masked tail included."""
    def step(v):
        value, partner, table = YMMRegister(), YMMRegister(), YMMRegister()
        v.load(value, x_head)
        VPERMILPS(partner, value, 0b10110001)           # lanes 1,0,3,2,...
        v.load(table, cos_row)
        VMULPS(value, value, table)
        v.load(table, sin_row)
        VFMADD231PS(value, partner, table)
        v.store(out_head, value)

    stream_row(head_dim, step, UNROLL_STREAMING)


def rotate_halves(x_head, out_head, cos_row, sin_row, half, half_bytes):
    """One head, NeoX/HF convention: lane i pairs with lane i + head_dim/2.

    Walks the first half with one index and the second with another, so each
    step loads both partners before it stores either (in place is safe)."""
    def step(lo, hi):
        x_lo, x_hi, result, table = YMMRegister(), YMMRegister(), YMMRegister(), YMMRegister()
        lo.load(x_lo, x_head)
        hi.load(x_hi, x_head)
        lo.load(table, cos_row)
        VMULPS(result, x_lo, table)
        lo.load(table, sin_row)
        VFMADD231PS(result, x_hi, table)
        lo.store(out_head, result)
        hi.load(table, cos_row)
        VMULPS(x_hi, x_hi, table)
        hi.load(table, sin_row)
        VFMADD231PS(x_hi, x_lo, table)
        hi.store(out_head, x_hi)

    stream_row(half, step, UNROLL_EXP, extra_offsets=(half_bytes,))


def emit_rope(isa, style):
    """out[t, h] = x[t, h] * cos[pos[t]] + partner(x[t, h]) * sin[pos[t]] for every token t, head h.

    The tables (runtime.ref.elementwise.rope_tables) carry the signs, so both
    styles are this one formula and differ only in ``partner``."""
    def body(*args):
        x_head, positions, cos_base, sin_base, out_head, m, n_heads, head_dim = load_arguments(args)
        head_bytes = GeneralPurposeRegister64()
        LEA(head_bytes, [head_dim * FLOAT_BYTES])

        with Loop() as token_loop:
            cos_row, sin_row = GeneralPurposeRegister64(), GeneralPurposeRegister64()
            MOV(cos_row.as_dword, [positions])                 # positions are >= 0 (validated)
            IMUL(cos_row, head_bytes)
            LEA(sin_row, [sin_base + cos_row * 1])
            ADD(cos_row, cos_base)
            heads_left = GeneralPurposeRegister64()
            MOV(heads_left, n_heads)
            with Loop() as head_loop:
                if style == "pairs":
                    rotate_pairs(x_head, out_head, cos_row, sin_row, head_dim)
                else:
                    half, half_bytes = GeneralPurposeRegister64(), GeneralPurposeRegister64()
                    MOV(half, head_dim)
                    SHR(half, 1)
                    LEA(half_bytes, [half * FLOAT_BYTES])
                    rotate_halves(x_head, out_head, cos_row, sin_row, half, half_bytes)
                ADD(x_head, head_bytes)
                ADD(out_head, head_bytes)
                SUB(heads_left, 1)
                JNZ(head_loop.begin)
            ADD(positions, 4)
            SUB(m, 1)
            JNZ(token_loop.begin)
    return f32_kernel(isa, "rope", ROPE_SIGNATURE, body, types=f"{style}_f32")


def emit(isa):
    return [emit_add(isa), emit_scale(isa), emit_exp(isa), emit_silu_mul(isa), emit_gelu_mul(isa),
            emit_add_bias(isa), emit_rmsnorm(isa), emit_softmax(isa), emit_rope(isa, "pairs"), emit_rope(isa, "halves")]
