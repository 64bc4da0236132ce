"""All-gather KV attention for context parallelism (--cp-impl allgather; the scheme the Llama 3
paper, arXiv:2407.21783 §3.3.2, uses for long contexts): every rank gathers the K and V of the
whole sequence over its cp group, then attends with its own queries only. Simple and balanced
(with the zig-zag split every rank has as many (query, key) pairs), but each rank holds the
whole sequence's K and V for backward: memory linear in T, where the ring's is T/C.

On rank r of C, its queries q at positions pos_r (t = T/C of them, ring_attention.positions):
    forward   K, V = all_gather(k, v) over cp                  (C, B, Hkv, 1, t, hs), rank order
              S = q K^T / sqrt(hs), -inf where a key's position is after the query's
              o = softmax(S) V                                  over all T keys
    backward  P made again from q, K and the log-sum-exp (the T-wide softmax is never kept)
              dq = dS K / sqrt(hs), and dK, dV of EVERY key from this rank's queries
              dK, dV = reduce_scatter(dK, dV) over cp          each rank gets its own keys'
Grouped-query attention: heads arranged (B, Hkv, g, t, hs), so only the Hkv key and value heads
are gathered and the g query heads of a group meet theirs by broadcasting.

Bytes per attention call and rank, n = B Hkv' t hs elements of its k (and of v), Hkv' the key
heads it holds (kv_width): the all-gather of 2n and the reduce-scatter of 2n C elements, each
with the bytes comm's algorithms send for them (allgather_traffic).
"""
from __future__ import annotations

import math

import numpy as np

from minipar import comm
from minipar.autograd.tensor import Function
from minipar.parallel.context.ring_attention import _fold, positions, waited


def _order(C: int, T: int, layout: str) -> np.ndarray:
    """The global positions of the gathered keys, in rank order (rank 0's t, rank 1's, ...)."""
    return np.concatenate([positions(o, C, T, layout) for o in range(C)])


class AllGatherAttention(Function):
    """o = causal softmax(q K^T / sqrt(hs)) V over the whole sequence, with K and V gathered
    from every rank of the cp group: q (B, Hkv, g, t, hs), k, v (B, Hkv, 1, t, hs) of this
    rank's tokens at `layout` positions -> o like q. Keeps q, the gathered K and V, o and the
    log-sum-exp."""

    def forward(self, q, k, v, group, layout="zigzag"):
        C = group.size
        self.group, self.shape = group, k.shape
        self.scale = 1.0 / math.sqrt(q.shape[-1])                    # a Python float: float32 stays float32
        kv = waited("forward", comm.all_gather, group, np.stack([k, v])).reshape(C, 2, *k.shape)
        K = np.concatenate(list(kv[:, 0]), axis=-2)                    # (B, Hkv, 1, T, hs), rank order
        V = np.concatenate(list(kv[:, 1]), axis=-2)
        self.layout = layout
        s = (q @ np.swapaxes(K, -1, -2)) * self.scale + self._mask(q.dtype)   # (B, Hkv, g, t, T)
        m = s.max(-1, keepdims=True)
        p = np.exp(s - m)
        l = p.sum(-1, keepdims=True)
        o = (p / l) @ V
        self.save(q, K, V, o, (m + np.log(l))[..., 0])
        return o

    def _mask(self, dtype):
        C = self.group.size
        return _causal_mask(self.group.rank, C, self.shape[-2] * C, self.layout, dtype)

    def backward(self, do):
        q, K, V, o, lse = self.saved
        C = self.group.size
        p = np.exp((q @ np.swapaxes(K, -1, -2)) * self.scale + self._mask(q.dtype) - lse[..., None])
        D = (do * o).sum(-1, keepdims=True)                            # (B, Hkv, g, t, 1)
        dV = _fold(np.swapaxes(p, -1, -2) @ do, V)                     # every key's, from my queries
        ds = p * (do @ np.swapaxes(V, -1, -2) - D)
        dq = (ds @ K) * self.scale
        dK = _fold(np.swapaxes(ds, -1, -2) @ q, K) * self.scale
        t = self.shape[-2]
        # rank o's keys are columns [o t, (o + 1) t): lay the two out rank-major, reduce-scatter
        both = np.stack([dK, dV]).reshape(2, *K.shape[:-2], C, t, K.shape[-1])
        both = np.ascontiguousarray(np.moveaxis(both, -3, 0))         # (C, 2, B, Hkv, 1, t, hs)
        mine = waited("backward", comm.reduce_scatter, self.group, both).reshape(2, *self.shape)
        return dq, mine[0], mine[1], None, None


def _causal_mask(rank: int, C: int, T: int, layout: str, dtype) -> np.ndarray:
    """(t, T): -inf where the gathered key's position is after this rank's query's, else 0.
    Made again in backward, not kept: t x T would outgrow the gathered K and V."""
    later = _order(C, T, layout)[None, :] > positions(rank, C, T, layout)[:, None]
    return np.where(later, -np.inf, 0.0).astype(dtype)


def allgather_traffic(n: int, C: int, itemsize: int, forwards: int = 1) -> int:
    """Bytes one rank sends for one attention call and its backward, n = B Hkv' t hs elements of
    its k (and of v): the all-gather of its 2n (C - 1 pieces of it leave: comm's algorithms,
    comm_bytes.all_gather_sent) per forward, and the reduce-scatter of 2n C (every piece but
    its own: reduce_scatter_sent). forwards = 2 when the forward runs again in backward
    (--recompute full). No headers: a collective's pieces have sizes both sides know."""
    if C == 1:
        return 0
    return (forwards + 1) * 2 * n * (C - 1) * itemsize
