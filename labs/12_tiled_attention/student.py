"""Lab 12: tiled attention, FlashAttention-2's forward and backward, in plain NumPy.

Write the two functions below (labs/12_tiled_attention/README.md has the picture and the
hints). Both compute exactly what the plain attention computes,

    S = q k^T * scale  (+ the causal mask: -inf where the key comes after the query)
    P = softmax(S) over the keys,   o = P v,   lse = log sum_j exp S[..., i, j]

but one tile of block_q queries x block_k keys at a time: no T x T array is ever made. Arrays
in, arrays out: no Tensor, no autograd, no minipar. The inputs are never modified; the results
are new arrays of the inputs' dtype (float64, or float32: the grader tries both).

The grader holds both against the plain attention at 1e-12 (float64), in float32, measures the
memory they hold on a long sequence, then puts them inside minipar's model
(tiled_attention.TiledAttention, `--attention tiled`) and trains a small GPT with them.

Check:  make lab L=12        (or: .venv/bin/python -m labs.grade 12 --student this_file.py)
"""
import math  # noqa: F401 - you will want them

import numpy as np  # noqa: F401


def forward(q, k, v, causal, block_q, block_k, scale=None):
    """Tiled attention forward -> (o, lse).

    q, k, v: arrays of one shape (..., T, d): any leading axes (none, or batch and heads),
    T tokens of d channels (T may be 1, or smaller than a block). causal: a bool; when True
    query i sees keys j <= i only. block_q, block_k: ints >= 1, the queries and keys of a
    tile; they need not divide T (the last block of each is shorter). scale: a float, or None
    for 1 / sqrt(d).

    For each block of queries, visit the key blocks in order with the online softmax: a running
    row maximum m, a running sum l of exp(S - m) and an accumulator of exp(S - m) v, both
    rescaled by exp(m_old - m_new) when a key block raises the maximum. With causal, skip the
    key blocks whose every key comes after every query of the block, and mask the diagonal
    inside the blocks it crosses.

    Returns o (..., T, d) = softmax(S) v and lse (..., T) = log sum_j exp S[..., i, j] (the
    scaled, masked scores), both new arrays of q's dtype. Never make a T x T array (nor a
    block_q x T strip). q, k and v are never modified."""
    raise NotImplementedError("lab 12: forward, see labs/12_tiled_attention/README.md")


def backward(q, k, v, o, lse, do, causal, block_q, block_k, scale=None):
    """Tiled attention backward -> (dq, dk, dv).

    q, k, v, causal, block_q, block_k, scale: as the forward was called; o (..., T, d) and
    lse (..., T): what the forward returned; do (..., T, d): dL/do. First D = rowsum(do * o)
    (..., T). Then for every (query block, key block) pair that the causal skip keeps, make the
    tile's scores S again (scaled and masked as in forward), P = exp(S - lse) for its rows, and
    add the tile's part:

        dv[keys]    += P^T do[queries]
        dP           = do[queries] v[keys]^T
        dS           = P * (dP - D[queries])
        dq[queries] += dS k[keys] * scale
        dk[keys]    += dS^T q[queries] * scale

    Returns dq, dk, dv: new arrays like q, of q's dtype. Never make a T x T array. q, k, v, o,
    lse and do are never modified."""
    raise NotImplementedError("lab 12: backward, see labs/12_tiled_attention/README.md")
