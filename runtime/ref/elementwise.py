"""numpy references: elementwise and row-wise FP32 ops, computed in float64 from the math.

Row-wise ops (rmsnorm, softmax) work on the last axis; leading axes are rows.
"""
import numpy as np

from .. import buffers

__all__ = ["add", "scale", "exp", "silu_mul", "gelu_mul", "add_bias", "rmsnorm", "softmax", "rope", "rope_tables"]

ROPE_STYLES = ("pairs", "halves")


def add(a, b, out):
    np.add(a, b, out=out, dtype=np.float32)


def scale(x, s, out):
    """out = x * s; s is rounded to float32 first, as the kernel receives it."""
    np.multiply(x, np.float32(s), out=out, dtype=np.float32)


def exp(x, out):
    with np.errstate(over="ignore"):
        out[...] = np.exp(x.astype(np.float64))


def silu_mul(gate, up, out):
    """out = SiLU(gate) * up = gate / (1 + exp(-gate)) * up."""
    g = gate.astype(np.float64)
    with np.errstate(over="ignore"):
        out[...] = g / (1.0 + np.exp(-g)) * up


GELU_SQRT_2_OVER_PI = np.sqrt(2.0 / np.pi)
GELU_COEF_A = 0.044715


def gelu_tanh(x):
    """0.5 x (1 + tanh(y)), y = sqrt(2/pi) (x + 0.044715 x^3), in float64.

    Evaluated as x / (1 + exp(-2y)), the same function (0.5 (1 + tanh y) =
    1 / (1 + e^-2y)): 1 + tanh(y) cancels to 0 in float64 once x < ~-5, the
    logistic form keeps full relative precision there."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        minus_2y = -2.0 * GELU_SQRT_2_OVER_PI * (x + GELU_COEF_A * x * x * x)
        result = x / (1.0 + np.exp(minus_2y))
    return np.where(np.isneginf(x), -0.0, result)        # -inf / inf: the limit is -0


def gelu_mul(gate, up, out):
    """out = gelu_tanh(gate) * up (GeGLU)."""
    out[...] = gelu_tanh(gate) * up.astype(np.float64)


def add_bias(x, bias, out):
    """out[i] = x[i] + bias for every row i (last axis); out may be x."""
    np.add(x, bias, out=out, dtype=np.float32)


def rmsnorm(x, w, eps, out):
    """out[i] = x[i] / sqrt(mean(x[i]^2) + eps) * w for each row i."""
    x64 = x.astype(np.float64)
    mean_square = np.mean(x64 * x64, axis=-1, keepdims=True)
    out[...] = x64 / np.sqrt(mean_square + float(eps)) * w


def softmax(x, out):
    """Row-wise softmax, max-subtracted; out may be x."""
    x64 = x.astype(np.float64)
    e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
    out[...] = e / e.sum(axis=-1, keepdims=True)


def rope_tables(n_ctx, head_dim, base, style, *, n_rot=None, freq_scale=1.0, freq_factors=None,
                magnitude=1.0, yarn_orig_ctx=0, yarn_beta_fast=32.0, yarn_beta_slow=1.0):
    """cos, sin tables [n_ctx, head_dim] (f32, aligned) for ``rope`` in ``style``.

    Rotation i turns by theta_i = pos * freq_scale * base^(-2i/n_rot) / freq_factors[i]
    (n_rot defaults to head_dim; freq_scale is linear RoPE scaling; freq_factors,
    [n_rot/2], are Llama 3's per-frequency divisors). Rotated lanes are scaled by
    ``magnitude`` (RoPE scaling's attention factor).

    With ``yarn_orig_ctx`` > 0, YaRN: rotation i blends the scaled angle with the
    unscaled one, theta_i = scaled (1 - r_i) + unscaled r_i, where the ramp r_i is 1
    for the pairs that turn more than yarn_beta_fast times over yarn_orig_ctx
    positions, 0 for those turning fewer than yarn_beta_slow times, linear between
    (llama.cpp's corrected dimensions: the bounds floored/ceiled to whole pairs).
    YaRN's own magnitude (1 + 0.1 ln(1/freq_scale)) is left to the caller's
    ``magnitude``. The tables carry the signs
    so that rope is out = x*cos + partner(x)*sin in both styles:
      pairs  (llama.cpp / GGUF LLaMA): x[2i] with x[2i+1];
             cos = [c0, c0, c1, c1, ...], sin = [-s0, s0, -s1, s1, ...]
      halves (NeoX / Hugging Face): x[i] with x[i + head_dim/2];
             cos = [c, c], sin = [-s, s]
    Lanes from n_rot on (pairs only) have cos 1, sin 0: they pass through."""
    if style not in ROPE_STYLES:
        raise ValueError(f"style: expected one of {ROPE_STYLES}, got {style!r}")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim: expected an even number >= 2, got {head_dim}")
    n_rot = head_dim if n_rot is None else n_rot
    if n_rot < 2 or n_rot % 2 or n_rot > head_dim:
        raise ValueError(f"n_rot: expected an even number in [2, head_dim={head_dim}], got {n_rot}")
    if style == "halves" and n_rot != head_dim:
        raise ValueError("n_rot: partial rotation is supported in the 'pairs' style only")
    half = n_rot // 2
    inv_freq = float(base) ** (-2.0 * np.arange(half, dtype=np.float64) / n_rot)
    if freq_factors is not None:
        freq_factors = np.asarray(freq_factors, dtype=np.float64)
        if freq_factors.shape != (half,):
            raise ValueError(f"freq_factors: expected shape ({half},), got {freq_factors.shape}")
        inv_freq = inv_freq / freq_factors
    positions = np.arange(n_ctx, dtype=np.float64)[:, None]
    theta = positions * float(freq_scale) * inv_freq[None, :]
    if yarn_orig_ctx > 0:
        ramp = _yarn_ramp(n_rot, float(base), yarn_orig_ctx, yarn_beta_fast, yarn_beta_slow)
        theta = theta * (1.0 - ramp) + positions * inv_freq[None, :] * ramp
    c, s = np.cos(theta) * magnitude, np.sin(theta) * magnitude
    cos, sin = np.ones((n_ctx, head_dim)), np.zeros((n_ctx, head_dim))
    if style == "pairs":
        cos[:, :n_rot] = np.repeat(c, 2, axis=1)
        sin[:, :n_rot] = np.stack([-s, s], axis=-1).reshape(n_ctx, n_rot)
    else:
        cos[:] = np.concatenate([c, c], axis=1)
        sin[:] = np.concatenate([-s, s], axis=1)
    return buffers.aligned_copy(cos, np.float32), buffers.aligned_copy(sin, np.float32)


def _yarn_ramp(n_rot, base, orig_ctx, beta_fast, beta_slow):
    """Per rotation pair, 1 where YaRN keeps the unscaled angle, 0 where it interpolates."""
    def pair_turning(turns):      # the (fractional) pair whose wavelength fits `turns` times in orig_ctx
        return n_rot * np.log(orig_ctx / (turns * 2.0 * np.pi)) / (2.0 * np.log(base))
    low = max(0.0, np.floor(pair_turning(beta_fast)))
    high = min(n_rot - 1.0, np.ceil(pair_turning(beta_slow)))
    i = np.arange(n_rot // 2, dtype=np.float64)
    return 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)


def rope_partner(x, style):
    """The lane each lane rotates with: adjacent pairs swapped, or the two halves swapped."""
    if style == "pairs":
        return x.reshape(*x.shape[:-1], -1, 2)[..., ::-1].reshape(x.shape)
    half = x.shape[-1] // 2
    return np.concatenate([x[..., half:], x[..., :half]], axis=-1)


def rope(x, positions, cos, sin, style, out):
    """out[t, h] = x[t, h] * cos[positions[t]] + partner(x[t, h]) * sin[positions[t]].

    x is [m, n_heads, head_dim]; out may be x."""
    if style not in ROPE_STYLES:
        raise ValueError(f"style: expected one of {ROPE_STYLES}, got {style!r}")
    x64 = x.astype(np.float64)
    c = cos[positions][:, None, :].astype(np.float64)
    s = sin[positions][:, None, :].astype(np.float64)
    out[...] = x64 * c + rope_partner(x64, style) * s
