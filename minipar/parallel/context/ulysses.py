"""Ulysses attention for context parallelism (--cp-impl ulysses; DeepSpeed-Ulysses, Jacobs et
al. 2023, arXiv:2309.14509): an all-to-all turns the sequence split into a head split, each
rank attends over the WHOLE sequence for H/C of the heads, and a second all-to-all turns it
back. Attention is then the single process's (ops.CausalSelfAttention), on fewer heads.

On rank r of C, with its t = T/C tokens at positions pos_r (ring_attention.positions):
    forward   all_to_all  q, k, v (B, t, heads)  ->  (B, T, heads / C)   rank j gets heads j
              attention of the whole sequence, causal, on those heads
              all_to_all  y (B, T, H/C hs)       ->  (B, t, H hs)        back to the tokens' owners
    backward  the same two all-to-alls on the gradients, in reverse order
Query heads: rank j holds [j H/C, (j + 1) H/C), so C must divide H (after tp: H/tp). Key and
value heads: when C divides Hkv, rank j holds [j Hkv/C, (j + 1) Hkv/C); when Hkv divides C
(fewer KV heads than ranks, grouped-query attention), rank j gets the one KV head its query
heads read, head j // (C/Hkv), so each is sent to C/Hkv ranks, as Megatron-LM replicates
them, and their gradients come home and are summed. Anything else is refused in one line.
The degree is thus capped by the heads: C <= H/tp, with KV heads copied when C > Hkv/tp.

Bytes per attention call and rank (ulysses_traffic): an all-to-all keeps 1/C of its message
and sends the rest, so with w = (H/C + 2 kv) hs the channels a rank attends with (kv its KV
heads) and o = H/C hs its output's, (C - 1) B t itemsize x [forwards (w + o) + (o + w)]:
constant as T and C grow together, where the ring's grows with T.
"""
from __future__ import annotations

import numpy as np

from minipar import comm
from minipar.autograd.attention import CausalSelfAttention, head_counts
from minipar.autograd.dtypes import compute, store
from minipar.autograd.tensor import Function
from minipar.parallel.context.packed import RingSelfAttention
from minipar.parallel.context.ring_attention import positions, waited


def head_split(H: int, Hkv: int, C: int) -> tuple[int, int]:
    """(query heads, KV heads) of a rank of C: (H/C, Hkv/C), or (H/C, 1) when Hkv divides C;
    a one-line ValueError for a layout Ulysses cannot run."""
    if H % C:
        raise ValueError(f"--cp-impl ulysses gives each of the cp {C} ranks whole query heads: "
                         f"{H} heads (after tp) are not divisible by {C}")
    if Hkv % C and C % Hkv:
        raise ValueError(f"--cp-impl ulysses gives each of the cp {C} ranks whole key/value heads: "
                         f"{Hkv} (after tp) neither divides nor is divided by {C}")
    return H // C, max(1, Hkv // C)


def kv_heads_of(j: int, Hkv: int, C: int) -> np.ndarray:
    """The KV heads rank j of C attends with: its Hkv/C, or the one its query heads read."""
    if Hkv % C == 0:
        return np.arange(j * (Hkv // C), (j + 1) * (Hkv // C))
    return np.array([j // (C // Hkv)])


class UlyssesAttention(Function):
    """Causal self-attention of the whole sequence on the packed projection qkv (B, t, (H +
    2 Hkv) hs) of this rank's tokens -> y (B, t, H hs), as ops.CausalSelfAttention takes and
    gives them. Keeps what the inner attention keeps: q, k, v of its heads over all T tokens
    (the softmax made again in backward).

    ring: None, or the ring group of --cp-impl hybrid (context_parallel.ContextSplit): `group` is then one of its
    ranks' Ulysses group, whose U ranks' tokens the all-to-all brings together, and the
    attention over them is ring attention with the other ring members' (their own Ulysses
    groups' tokens). A member's tokens are those of a zig-zag (or contiguous) split of the
    sequence into R = C/U parts: positions(m, R, T, layout)."""

    def forward(self, qkv, n_head, group, layout="zigzag", n_kv_head=None, ring=None):
        self.dtype, qkv = qkv.dtype, compute(qkv)
        B, t, width = qkv.shape
        H, Hkv, hs = head_counts(width, n_head, n_kv_head)
        U, R, m = group.size, 1 if ring is None else ring.size, 0 if ring is None else ring.rank
        Hq, kv = head_split(H, Hkv, U)
        T = t * U * R
        self.group, self.dims, self.where = group, (B, t, H, Hkv, hs, Hq, kv), (m, R, T, layout)
        q = qkv[..., :H * hs].reshape(B, t, U, Hq * hs)
        k = qkv[..., H * hs:(H + Hkv) * hs].reshape(B, t, Hkv, hs)
        v = qkv[..., (H + Hkv) * hs:].reshape(B, t, Hkv, hs)
        send = np.empty((U, B, t, (Hq + 2 * kv) * hs), dtype=qkv.dtype)
        for j in range(U):
            heads = kv_heads_of(j, Hkv, U)
            send[j] = np.concatenate([q[:, :, j], k[:, :, heads].reshape(B, t, -1),
                                      v[:, :, heads].reshape(B, t, -1)], axis=-1)
        gathered = self._to_sequence(waited("forward", comm.all_to_all, group, send))   # (B, U t, w)
        if ring is None:
            self.inner = CausalSelfAttention()
            y = self.inner.forward(gathered, Hq, True, kv)            # keeps q, k, v; P made again
        else:
            self.inner = RingSelfAttention()
            y = self.inner.forward(gathered, Hq, ring, layout, kv)
        self.saved, self.inner.saved = self.inner.saved, ()
        back = waited("forward", comm.all_to_all, group, self._to_owners(y))      # (U, B, t, Hq hs): heads j
        return store(np.moveaxis(back, 0, 2).reshape(B, t, H * hs), self.dtype)

    def backward(self, g):
        B, t, H, Hkv, hs, Hq, kv = self.dims
        U, g = self.group.size, compute(g)
        dy = np.ascontiguousarray(np.moveaxis(g.reshape(B, t, U, Hq * hs), 2, 0))
        dy = self._to_sequence(waited("backward", comm.all_to_all, self.group, dy))   # (B, U t, Hq hs)
        self.inner.saved = self.saved
        dmine = self.inner.backward(dy)[0]                             # (B, U t, (Hq + 2 kv) hs)
        self.inner.saved = ()
        got = waited("backward", comm.all_to_all, self.group, self._to_owners(dmine))   # (U, B, t, w)
        dq = np.moveaxis(got[..., :Hq * hs], 0, 2).reshape(B, t, H * hs)
        dk = np.zeros((B, t, Hkv, hs), dtype=got.dtype)
        dv = np.zeros_like(dk)
        for j in range(U):                                             # a replicated head: summed
            heads = kv_heads_of(j, Hkv, U)
            dk[:, :, heads] += got[j][..., Hq * hs:(Hq + kv) * hs].reshape(B, t, kv, hs)
            dv[:, :, heads] += got[j][..., (Hq + kv) * hs:].reshape(B, t, kv, hs)
        dqkv = np.concatenate([dq, dk.reshape(B, t, -1), dv.reshape(B, t, -1)], axis=-1)
        return store(dqkv, self.dtype), None, None, None, None, None

    @property
    def order(self) -> np.ndarray:
        """Where the tokens of my Ulysses group's ranks (cp ranks m U + i) go among its U t, in
        position order; made when needed, not kept (U t int64 a layer)."""
        (m, R, T, layout), U = self.where, self.group.size
        mine = positions(m, R, T, layout)                             # sorted
        return np.searchsorted(mine, np.concatenate([positions(m * U + i, U * R, T, layout) for i in range(U)]))

    def _to_sequence(self, got):
        """(U, B, t, w) received, rank i's tokens at got[i] -> (B, U t, w) in position order."""
        U, B, t, w = got.shape
        out = np.empty((B, U * t, w), dtype=got.dtype)
        out[:, self.order] = np.moveaxis(got, 0, 1).reshape(B, U * t, w)
        return out

    def _to_owners(self, a):
        """(B, U t, w) in position order -> (U, B, t, w), rank i's tokens at [i]: to send home."""
        U = self.group.size
        B, n, w = a.shape
        return np.ascontiguousarray(np.moveaxis(a[:, self.order].reshape(B, U, n // U, w), 1, 0))


def ulysses_traffic(rows_t: int, Hq: int, kv: int, hs: int, C: int, itemsize: int, forwards: int = 1) -> int:
    """Bytes one rank sends for one attention call and its backward: rows_t = B t tokens it
    holds, Hq its query heads and kv its KV heads in attention (head_split). Four all-to-alls,
    each sending C - 1 of its C pieces: forward the q, k, v pieces (w = (Hq + 2 kv) hs) and the
    output (Hq hs) back, backward the output's gradient and the q, k, v gradients home. No
    headers: every piece's size is known on both sides. forwards = 2 with --recompute full."""
    if C == 1:
        return 0
    w, o = (Hq + 2 * kv) * hs, Hq * hs
    return (C - 1) * rows_t * itemsize * (forwards * (w + o) + (o + w))
