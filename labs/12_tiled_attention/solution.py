"""Lab 12 solved by hand: FlashAttention-2's tiled forward and backward in NumPy."""
import math

import numpy as np


def _blocks(n, size):
    """[(start, stop), ...] cutting range(n) into pieces of `size`; the last may be shorter."""
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _block_scores(q_rows, k_rows, scale, causal, row0, col0):
    """The scaled scores of one tile, with -inf where the key comes after the query."""
    s = q_rows @ np.swapaxes(k_rows, -1, -2) * scale
    if causal:
        rows = row0 + np.arange(s.shape[-2])
        cols = col0 + np.arange(s.shape[-1])
        s = np.where(cols[None, :] > rows[:, None], -np.inf, s)
    return s


def forward(q, k, v, causal, block_q, block_k, scale=None):
    T, d = q.shape[-2], q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    o = np.zeros_like(q)
    lse = np.zeros(q.shape[:-1], dtype=q.dtype)
    for row0, row1 in _blocks(T, block_q):
        qi = q[..., row0:row1, :]
        m = np.full(qi.shape[:-1], -np.inf, dtype=q.dtype)
        l = np.zeros(qi.shape[:-1], dtype=q.dtype)
        acc = np.zeros(qi.shape, dtype=q.dtype)
        for col0, col1 in _blocks(T, block_k):
            if causal and col0 > row1 - 1:          # this key block and all after it are masked
                break
            s = _block_scores(qi, k[..., col0:col1, :], scale, causal, row0, col0)
            m_new = np.maximum(m, s.max(axis=-1))
            correction = np.exp(m - m_new)
            p = np.exp(s - m_new[..., None])
            l = l * correction + p.sum(axis=-1)
            acc = acc * correction[..., None] + p @ v[..., col0:col1, :]
            m = m_new
        o[..., row0:row1, :] = acc / l[..., None]
        lse[..., row0:row1] = m + np.log(l)
    return o, lse


def backward(q, k, v, o, lse, do, causal, block_q, block_k, scale=None):
    T, d = q.shape[-2], q.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    D = np.sum(do * o, axis=-1)
    dq = np.zeros_like(q)
    dk = np.zeros_like(k)
    dv = np.zeros_like(v)
    for col0, col1 in _blocks(T, block_k):
        kj, vj = k[..., col0:col1, :], v[..., col0:col1, :]
        for row0, row1 in _blocks(T, block_q):
            if causal and col0 > row1 - 1:
                continue
            qi, doi = q[..., row0:row1, :], do[..., row0:row1, :]
            s = _block_scores(qi, kj, scale, causal, row0, col0)
            p = np.exp(s - lse[..., row0:row1, None])
            dv[..., col0:col1, :] += np.swapaxes(p, -1, -2) @ doi
            dp = doi @ np.swapaxes(vj, -1, -2)
            ds = p * (dp - D[..., row0:row1, None])
            dq[..., row0:row1, :] += ds @ kj * scale
            dk[..., col0:col1, :] += np.swapaxes(ds, -1, -2) @ qi * scale
    return dq, dk, dv
