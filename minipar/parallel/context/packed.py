"""The context-parallel attentions that work on heads (ring_attention.RingAttention,
allgather_attention.AllGatherAttention) on the packed projection the model gives attention,
qkv (B, t, (H + 2 Hkv) hs) = [q | k | v] -> y (B, t, H hs), as ops.CausalSelfAttention takes
and gives them. Ulysses (ulysses.py) works on the packed projection itself, and its hybrid
form runs RingSelfAttention inside."""
from __future__ import annotations

import numpy as np

from minipar.autograd.attention import head_counts
from minipar.autograd.dtypes import compute, store
from minipar.autograd.tensor import Function
from minipar.parallel.context.allgather_attention import AllGatherAttention
from minipar.parallel.context.ring_attention import RingAttention


class PackedSelfAttention(Function):
    """A context-parallel attention (`core`, on heads) on the packed projection qkv (B, t,
    (H + 2 Hkv) hs) = [q | k | v] -> y (B, t, H hs), as ops.CausalSelfAttention takes and
    gives them (H = n_head/tp with tensor parallelism). Grouped-query attention (Hkv < H): the
    heads are arranged (B, Hkv, g, t, hs), g = H/Hkv, so only the Hkv key and value heads
    travel and the g query heads of a group meet theirs by broadcasting. fp16/bf16 attend in
    fp32, like every op. It keeps what the core keeps (never the t x T softmax)."""

    core = None                                                       # a Function on heads

    def forward(self, qkv, n_head, group, layout, n_kv_head=None):
        self.dtype, qkv = qkv.dtype, compute(qkv)
        B, t, width = qkv.shape
        H, Hkv, hs = head_counts(width, n_head, n_kv_head)
        self.dims = (B, t, H, Hkv, hs)

        def heads(a, n, g):                                           # (B, t, n g hs) -> (B, n, g, t, hs)
            return np.ascontiguousarray(a.reshape(B, t, n, g, hs).transpose(0, 2, 3, 1, 4))

        q = heads(qkv[..., :H * hs], Hkv, H // Hkv)
        k = heads(qkv[..., H * hs:(H + Hkv) * hs], Hkv, 1)
        v = heads(qkv[..., (H + Hkv) * hs:], Hkv, 1)
        self.inner = self.core()
        o = self.inner.forward(q, k, v, group, layout)                # (B, Hkv, g, t, hs)
        self.saved, self.inner.saved = self.inner.saved, ()           # counted here (saved_bytes)
        return store(o.transpose(0, 3, 1, 2, 4).reshape(B, t, H * hs), self.dtype)

    def backward(self, g):
        B, t, H, Hkv, hs = self.dims
        do = np.ascontiguousarray(compute(g).reshape(B, t, Hkv, H // Hkv, hs).transpose(0, 2, 3, 1, 4))
        self.inner.saved = self.saved
        dq, dk, dv = self.inner.backward(do)[:3]
        self.inner.saved = ()

        def merge(a):                                                 # (B, n, g, t, hs) -> (B, t, n g hs)
            return a.transpose(0, 3, 1, 2, 4).reshape(B, t, -1)

        dqkv = np.concatenate([merge(dq), merge(dk), merge(dv)], axis=-1)
        return store(dqkv, self.dtype), None, None, None, None


class RingSelfAttention(PackedSelfAttention):
    """Ring attention (ring_attention.RingAttention) on the packed projection."""
    core = RingAttention


class AllGatherSelfAttention(PackedSelfAttention):
    """All-gather KV attention (allgather_attention.AllGatherAttention) on the packed projection."""
    core = AllGatherAttention
