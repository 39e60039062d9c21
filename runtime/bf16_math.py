"""Which arithmetic a BF16 GGUF's matrices get on this machine, decided when it is converted.

- ``"f32"``: kind ``bf16`` (runtime/layout_float.py). The float GEMM widens each weight
  exactly and multiplies the f32 activations: the bits of the weights widened to f32, the
  same on every CPU.
- ``"bf16"``: kind ``bf16_pairs`` (runtime/layout_bf16.py). The activations are rounded to
  bf16 once per input (``round_bf16``) and ``vdpbf16ps`` multiplies pairs, as llama.cpp's
  bf16 dot product does on every CPU. It needs AVX512_BF16.

Where both run, which is faster depends on the CPU: on Zen 4, whose 512-bit FMAs run at the
256-bit rate, ``vdpbf16ps`` does twice the float kernel's multiply-adds; on the Intel host
measured before it ran at about half of it (docs/perf-journal/2026-12-01-1413-float-models.md). So ``auto`` (the
default) times both kernels once per machine on one product of a typical shape and keeps
the answer in the cache directory. ``LLAMBDA_BF16_MATH=f32|bf16|auto`` chooses explicitly.

The choice is part of a conversion's cache key (llambda/model/convert.py), and only a GGUF with a
BF16 matrix asks for it, so the timing runs only for such a model.
"""
import functools
import json
import os
import time

import numpy as np

ENV = "LLAMBDA_BF16_MATH"
CHOICES = ("auto", "f32", "bf16")
KIND = {"f32": "bf16", "bf16": "bf16_pairs"}
# The timed product: a prefill chunk through a small model's square projection, on one core.
PROBE_SHAPE = (128, 576, 576)         # m, n, k
PROBE_REPEATS = 7
# vdpbf16ps must win by this much: it also pays the activations' rounding, and it gives up
# the exact f32 arithmetic, which a close race does not buy.
PROBE_MARGIN = 1.2


def setting():
    """LLAMBDA_BF16_MATH, checked: "auto" when unset or empty."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV}: expected one of {', '.join(CHOICES)}, got {os.environ[ENV]!r}")
    return value


def choice():
    """"f32" or "bf16": the arithmetic this machine gives BF16 matrices."""
    value = setting()
    from .native import gemm_bf16
    supported = gemm_bf16.bf16_supported()
    if value == "bf16" and not supported:
        raise ValueError(f"{ENV}=bf16: this CPU lacks {gemm_bf16.CPU_FLAG}")
    if value == "auto":
        return measured_choice() if supported else "f32"
    return value


def cache_token():
    """What a conversion's cache key needs of the choice, without timing anything: the
    setting, and whether this CPU could run kind "bf16_pairs" at all (so a cache shared with
    a CPU that cannot never hands it a file it cannot multiply)."""
    from .native.gemm_bf16 import cpu_runs_bf16
    return f"bf16 math {setting()} {'able' if cpu_runs_bf16() else 'unable'}"


def bf16_kind():
    """The packed kind BF16 matrices convert to here: "bf16" or "bf16_pairs"."""
    return KIND[choice()]


@functools.lru_cache(maxsize=None)
def measured_choice():
    """The faster arithmetic on this CPU, timed once and kept in <cache>/machine/."""
    from . import cpu, library, paths
    key = f"{cpu._proc_cpuinfo('model name')} | {library.locate().key}"
    memo = paths.cache_subdir("machine") / "bf16-math.json"
    try:
        kept = json.loads(memo.read_text())
        if kept.get("key") == key and kept.get("choice") in KIND:
            return kept["choice"]
    except (OSError, ValueError):
        pass
    rates = probe()
    found = "bf16" if rates["bf16"] > PROBE_MARGIN * rates["f32"] else "f32"
    temporary = memo.with_name(f"{memo.name}.{os.getpid()}.tmp")
    temporary.write_text(json.dumps({"key": key, "choice": found, "gflops": rates}))
    os.replace(temporary, memo)           # whole or not at all, whoever writes it at once
    return found


def probe():
    """GFLOP/s of both BF16 products on PROBE_SHAPE, best of PROBE_REPEATS calls each, the
    bf16 one with its activations' rounding counted."""
    from . import buffers, layout_bf16, layout_float
    from .native import gemm, gemm_bf16
    from .native._lib import kernel
    m, n, k = PROBE_SHAPE
    rng = np.random.default_rng(0)
    raw = (rng.standard_normal((n, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    raw = raw.view(np.uint8).reshape(n, 2 * k)
    x = buffers.aligned_copy(rng.standard_normal((m, k)).astype(np.float32))
    xb = buffers.zeros((m, 2 * layout_bf16.k_pairs(k)), np.uint16)
    out = buffers.zeros((m, n), np.float32)
    # The calls hold bare addresses: the packed weights must outlive them, so they get names.
    w_exact = layout_float.pack("BF16", raw, n, k)
    w_pairs = layout_bf16.pack("BF16", raw, n, k)
    exact = gemm.gemm_bf16_call(x, w_exact, out)
    pairs = gemm_bf16.gemm_bf16_pairs_call(xb, w_pairs, out)
    rounding = gemm_bf16.round_bf16_calls(x, xb, [(0, m)])[0]

    def best(calls):
        fns = [(kernel(symbol), args) for symbol, args in calls]
        times = []
        for _ in range(PROBE_REPEATS):
            t = time.perf_counter()
            for fn, args in fns:
                fn(*args)
            times.append(time.perf_counter() - t)
        return 2 * m * n * k / min(times) / 1e9

    rates = {"f32": round(best([exact]), 1), "bf16": round(best([rounding, pairs]), 1)}
    del w_exact, w_pairs                                    # only now may the panels go
    return rates
