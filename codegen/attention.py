"""The passes of grouped-query causal attention that codegen/paged/'s kernel shares.

For query row i (at position p) and query head h, over the keys the row sees:

    s_j      = scale * q[i, h] . k[kv(h), j]
    p        = softmax(s)                           (max-subtracted)
    out[i,h] = sum_j p_j v[kv(h), j]                kv(h) = h // group

Query heads that share a KV head are processed together, up to MAX_HEADS at a
time: each K and V row is then read once per query and KV head instead of once
per query head, and at long contexts decode is bound by reading the cache.

Three streaming passes per (query, heads sharing a KV head, key segment: codegen/paged/):

 1. scores: a block's keys at once from its key tile (codegen/contract.py), one
    vector of keys times one broadcast element of q per step of head_dim, summed in
    interleaved partials (codegen/paged/ ``tile_scores``: one fixed order per key);
 2. exp(s - max) in place on the score rows and their sum (codegen/paged/'s
    ``emit_exp_row``: a segment is not normalised, the combine divides);
 3. out = P V in key blocks of KEY_BLOCK keys (codegen/paged/).

In P V, a head_dim that is not a multiple of 8 ends in one masked chunk (VMASKMOVPS),
so nothing past a row is read. This module emits no kernel of its own (no ``emit``).
"""
from peachpy import Constant
from peachpy.x86_64 import GeneralPurposeRegister64, YMMRegister


LANES = 8
FLOAT = 4
CHUNK = LANES * FLOAT          # bytes of one ymm chunk of a row

MAX_HEADS = 3                  # query heads sharing a KV head done together
# Register tiles (16 ymm, PeachPy does not spill):
#   P V:     heads x head_dim-chunk accumulators + one broadcast p per head
PV_CHUNKS = {1: 8, 2: 4, 3: 4}        # 1x8+1, 2x4+2, 3x4+3 ymm
KEY_BLOCK = 64                 # keys per P V block: 16 KB of V at head_dim 64, L1-resident

NEG_INF = Constant.uint32x8(0xFF800000)

def gp():
    return GeneralPurposeRegister64()


def ymms(n):
    return [YMMRegister() for _ in range(n)]


def row(base, stride, r, disp=0):
    """Address of row ``r`` (0..2) of a block of rows ``stride`` bytes apart."""
    if r == 0:
        return [base + disp]
    return [base + stride * r + disp]
