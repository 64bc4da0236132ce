"""Tiled attention: FlashAttention-2's forward and backward (Dao 2023, arXiv:2307.08691) in NumPy.

The plain attention (attention.py) holds every score of a head at once, T x T:

    S = q k^T * scale                       (T, T)    scale = 1 / sqrt(d) unless given
    S[i, j] = -inf where j > i              (causal)
    P = softmax(S) over the keys            (T, T)
    o = P v                                 (T, d)
    lse[i] = log sum_j exp S[i, j]          (T,)      P = exp(S - lse)

    backward, given do = dL/do:
    dv = P^T do,   dP = do v^T,   dS = P * (dP - D),   D[i] = sum_j dP[i, j] P[i, j] = sum_c do[i, c] o[i, c]
    dq = dS k * scale,   dk = dS^T q * scale

Here the same numbers come block by block, and no T x T array is ever made: queries in blocks
of block_q rows, keys in blocks of block_k (the last block of each may be shorter: T need not
divide). For one query block the keys are visited in order with an online softmax: a running
row maximum m, a running sum l of exp(S - m) and an accumulator acc of exp(S - m) v; when a new
key block raises a row's maximum from m to m', what was summed so far is rescaled by
exp(m - m'). After the last key block o = acc / l and lse = m + log l. With causal, a key block
whose first key comes after the block's last query is skipped (all of it is masked), and the
diagonal is masked inside the blocks it crosses.

The backward keeps o and lse from the forward, not P: for every (query block, key block) pair
it makes the block's S again and P = exp(S - lse) exactly (no running max needed any more),
then adds that pair's part to dq, dk and dv (the formulas above, restricted to the block).

    tiled_forward(q, k, v, causal, block_q, block_k, scale=None) -> (o, lse)
    tiled_backward(q, k, v, o, lse, do, causal, block_q, block_k, scale=None) -> (dq, dk, dv)

on q, k, v of one shape (..., T, d) (any leading axes: batch, heads), in their dtype (float64
or float32). TiledAttention is the model's causal self-attention on the packed projection
(attention.py's contract: multi-head and grouped-query) through them: `--attention tiled
--attn-block B` (minipar/config/flags.py). It keeps q, k, v, o and lse for backward.
"""
from __future__ import annotations

import math

import numpy as np

from minipar.autograd.attention import head_counts
from minipar.autograd.dtypes import compute, store
from minipar.autograd.tensor import Function


def spans(n: int, block: int):
    """(start, stop) of the blocks of `block` that cut range(n): the last may be shorter."""
    if block < 1:
        raise ValueError(f"a block size must be >= 1, got {block}")
    return [(a, min(a + block, n)) for a in range(0, n, block)]


def _scores(q_blk, k_blk, scale, causal, r0, c0):
    """S of one block pair, (..., br, bc), masked to -inf above the diagonal when causal: query
    row r0 + a sees key c0 + b only when c0 + b <= r0 + a."""
    s = (q_blk @ np.swapaxes(k_blk, -1, -2)) * scale
    br, bc = s.shape[-2:]
    if causal and c0 + bc - 1 > r0:                        # the block crosses the diagonal
        above = (c0 + np.arange(bc))[None, :] > (r0 + np.arange(br))[:, None]
        s[..., above] = -np.inf
    return s


def tiled_forward(q, k, v, causal: bool, block_q: int, block_k: int, scale=None):
    """o = softmax(q k^T * scale [+ causal mask]) v and lse = log sum exp of the scores per
    row, one (block_q x block_k) tile at a time, with the online softmax. -> (o, lse):
    o like q, lse (..., T) of q's dtype."""
    T, d = q.shape[-2:]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    o = np.empty(q.shape, dtype=q.dtype)
    lse = np.empty(q.shape[:-1], dtype=q.dtype)
    for r0, r1 in spans(T, block_q):
        q_blk = q[..., r0:r1, :]
        m = np.full(q_blk.shape[:-1], -np.inf, dtype=q.dtype)          # running row max
        l = np.zeros(q_blk.shape[:-1], dtype=q.dtype)                   # running sum of exp(S - m)
        acc = np.zeros(q_blk.shape, dtype=q.dtype)                      # running exp(S - m) v
        for c0, c1 in spans(T, block_k):
            if causal and c0 > r1 - 1:                                  # every key after every query
                break
            s = _scores(q_blk, k[..., c0:c1, :], scale, causal, r0, c0)
            m_new = np.maximum(m, s.max(-1))
            p = np.exp(s - m_new[..., None])
            alpha = np.exp(m - m_new)                                   # what the old sums are worth now
            l = alpha * l + p.sum(-1)
            acc = alpha[..., None] * acc + p @ v[..., c0:c1, :]
            m = m_new
        o[..., r0:r1, :] = acc / l[..., None]
        lse[..., r0:r1] = m + np.log(l)
    return o, lse


def tiled_backward(q, k, v, o, lse, do, causal: bool, block_q: int, block_k: int, scale=None):
    """(dq, dk, dv) of the attention whose forward gave o and lse, for do = dL/do, one tile at a
    time: P made again from S and lse. Each like q."""
    T, d = q.shape[-2:]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    D = (do * o).sum(-1)                                                # (..., T) = rowsum(dP * P)
    dq, dk, dv = (np.zeros(q.shape, dtype=q.dtype) for _ in range(3))
    for c0, c1 in spans(T, block_k):
        k_blk, v_blk = k[..., c0:c1, :], v[..., c0:c1, :]
        for r0, r1 in spans(T, block_q):
            if causal and c0 > r1 - 1:                                  # masked whole: no gradient
                continue
            q_blk, do_blk = q[..., r0:r1, :], do[..., r0:r1, :]
            p = np.exp(_scores(q_blk, k_blk, scale, causal, r0, c0) - lse[..., r0:r1, None])
            dv[..., c0:c1, :] += np.swapaxes(p, -1, -2) @ do_blk
            dp = do_blk @ np.swapaxes(v_blk, -1, -2)
            ds = p * (dp - D[..., r0:r1, None])
            dq[..., r0:r1, :] += (ds @ k_blk) * scale
            dk[..., c0:c1, :] += (np.swapaxes(ds, -1, -2) @ q_blk) * scale
    return dq, dk, dv


class TiledAttention(Function):
    """Causal self-attention of the packed projection qkv (B, T, (H + 2 Hkv) hs) -> y (B, T, H hs),
    as attention.CausalSelfAttention, computed by tiled_forward / tiled_backward in blocks of
    `block` queries and keys. A key and value head serves g = H / Hkv query heads: it is
    repeated for them, and its gradient is the sum over them. fp16/bf16 attend in float32."""

    def forward(self, qkv, n_head, n_kv_head=None, block=32):
        self.dtype, qkv = qkv.dtype, compute(qkv)
        B, T, width = qkv.shape
        H, Hkv, hs = head_counts(width, n_head, n_kv_head)

        def heads(a, n):                                   # (B, T, n hs) -> (B, n, T, hs), repeated to H
            a = np.ascontiguousarray(a.reshape(B, T, n, hs).transpose(0, 2, 1, 3))
            return a if n == H else np.repeat(a, H // n, axis=1)

        q = heads(qkv[..., :H * hs], H)
        k = heads(qkv[..., H * hs:(H + Hkv) * hs], Hkv)
        v = heads(qkv[..., (H + Hkv) * hs:], Hkv)
        o, lse = tiled_forward(q, k, v, True, block, block)
        self.save(q, k, v, o, lse)
        self.dims, self.block = (B, T, H, Hkv, hs), block
        return store(o.transpose(0, 2, 1, 3).reshape(B, T, H * hs), self.dtype)

    def backward(self, g):
        q, k, v, o, lse = self.saved
        B, T, H, Hkv, hs = self.dims
        do = np.ascontiguousarray(compute(g).reshape(B, T, H, hs).transpose(0, 2, 1, 3))
        dq, dk, dv = tiled_backward(q, k, v, o, lse, do, True, self.block, self.block)
        if H > Hkv:                                        # a key head: the sum over its query heads
            dk, dv = (a.reshape(B, Hkv, H // Hkv, T, hs).sum(2) for a in (dk, dv))

        def merge(a):                                      # (B, n, T, hs) -> (B, T, n hs)
            return a.transpose(0, 2, 1, 3).reshape(B, T, -1)

        return store(np.concatenate([merge(dq), merge(dk), merge(dv)], axis=-1), self.dtype), None, None, None


def tiled_attention(qkv, n_head: int, n_kv_head: int | None = None, block: int = 32):
    """The model's attention part (model/contract.Parts.attention) with --attention tiled."""
    return TiledAttention.apply(qkv, n_head, n_kv_head, block)
