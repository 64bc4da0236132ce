"""Context parallelism (--cp C): every sequence of T tokens is split across the C ranks of a
cp group, T/C tokens each, at the positions ring_attention.positions gives (zig-zag by
default: chunks i and 2C-1-i of 2C). docs/context-parallel.md; docs/design.md §6.

Only attention mixes tokens, so only attention talks: ring_attention.RingAttention passes
K and V round the cp group. Everything else runs on the rank's own tokens, unchanged:
    the embedding   wte[idx_local] + wpe[positions]        (its positions, not 0..T/C-1)
    LayerNorm, MLP, the projections, ln_f, the head        per token
    the loss        sum of its tokens' cross-entropies / (B T), the global token count
so the loss summed over the cp ranks (and dp) is the mean over the global batch, and every
parameter's gradient is a partial sum over this rank's tokens: the gradient synchroniser
sums it over dp x cp (ProcessGrid.grad_group), and ZeRO shards over the same ranks.

A model takes part through one attribute, model.context: None, or this rank's ContextSplit.
"""
from __future__ import annotations

import numpy as np

from minipar.parallel.ring_attention import LAYOUTS, RingAttention, positions
from minipar.precision import compute, store

__all__ = ["ContextSplit", "RingSelfAttention", "LAYOUTS"]


class ContextSplit:
    """This rank's share of every sequence: its cp group and the layout of the split."""

    def __init__(self, group, layout: str = "zigzag"):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.group, self.layout = group, layout

    @property
    def size(self) -> int:
        return self.group.size

    def positions(self, T: int) -> np.ndarray:
        """Global positions of this rank's T/C tokens of a sequence of T, in its order."""
        return positions(self.group.rank, self.group.size, T, self.layout)

    def local(self, a) -> np.ndarray:
        """This rank's tokens of a (..., T) array of ids or targets: (..., T/C)."""
        a = np.asarray(a)
        return a[..., self.positions(a.shape[-1])]

    def attention(self, qkv, n_head: int):
        """Causal self-attention of the whole sequence for this rank's queries."""
        return RingSelfAttention.apply(qkv, n_head, self.group, self.layout)


class RingSelfAttention(RingAttention):
    """RingAttention on the packed projection qkv (B, t, 3C') = [q | k | v] of n_head heads,
    -> y (B, t, C'), as ops.CausalSelfAttention takes and gives them (C' = C/tp with
    tensor parallelism). fp16/bf16 attend in fp32, like every op. It keeps q, k, v, the
    output and the log-sum-exp (never the t x T softmax): selective recomputation built in."""

    def forward(self, qkv, n_head, group, layout):
        self.dtype, qkv = qkv.dtype, compute(qkv)
        B, t, C3 = qkv.shape
        hs = C3 // 3 // n_head
        self.dims = (B, t, n_head, hs)
        q, k, v = qkv.reshape(B, t, 3, n_head, hs).transpose(2, 0, 3, 1, 4)   # (B, nh, t, hs) each
        o = super().forward(q, k, v, group, layout)
        return store(o.transpose(0, 2, 1, 3).reshape(B, t, n_head * hs), self.dtype)

    def backward(self, g):
        B, t, nh, hs = self.dims
        do = np.ascontiguousarray(compute(g).reshape(B, t, nh, hs).transpose(0, 2, 1, 3))
        dq, dk, dv = super().backward(do)[:3]
        dqkv = np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4)             # (B, t, 3, nh, hs)
        return store(dqkv.reshape(B, t, 3 * nh * hs), self.dtype), None, None, None
