"""Ulysses attention for context parallelism (--cp-impl ulysses; DeepSpeed-Ulysses, Jacobs et
al. 2023, arXiv:2309.14509): an all-to-all turns the sequence split into a head split, each
rank attends over the WHOLE sequence for H/C of the heads, and a second all-to-all turns it
back. Attention is then the single process's (ops.CausalSelfAttention), on fewer heads.

On rank r of C, with its t = T/C tokens at positions pos_r (ring_attention.positions):
    forward   to_heads    q, k, v (B, t, heads)  ->  (B, T, heads / C)   rank j gets heads j
              attention of the whole sequence, causal, on those heads
              to_tokens   y (B, T, H/C hs)       ->  (B, t, H hs)        back to the tokens' owners
    backward  to_heads on dy, to_tokens on dq, dk, dv (to_tokens is to_heads' adjoint)
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


def heads_of(j: int, H: int, Hkv: int, C: int) -> np.ndarray:
    """The heads of the packed projection, viewed as (B, t, H + 2 Hkv, hs) = [q | k | v], that
    rank j of C attends with: its query heads, then the keys and the values of its KV heads
    (kv_heads_of), as indices into those H + 2 Hkv."""
    Hq, _ = head_split(H, Hkv, C)
    kvs = kv_heads_of(j, Hkv, C)
    return np.concatenate([np.arange(j * Hq, (j + 1) * Hq), H + kvs, H + Hkv + kvs])


def _piece(heads) -> int:
    """m: how many heads each rank gets (the same for every rank: no sizes travel)."""
    m = {len(h) for h in heads}
    if len(m) != 1:
        raise ValueError(f"Ulysses' all-to-alls give every rank as many heads; got {[len(h) for h in heads]}")
    return m.pop()


def to_heads(group, x: np.ndarray, heads) -> np.ndarray:
    """The sequence-to-head all-to-all. x (B, t, n, hs): this rank's t tokens of n heads;
    heads[j] the m heads rank j gets (the same lists on every rank, as many for each). ->
    (B, C t, m, hs): my heads of rank 0's t tokens, then rank 1's, ... (rank order, not
    position order). One all-to-all of equal pieces: piece j is x[:, :, heads[j]].

        y[:, i t:(i + 1) t] = x_i[:, :, heads[me]]        x_i: rank i's x"""
    B, t, _, hs = x.shape
    m = _piece(heads)
    send = np.empty((group.size, B, t, m, hs), dtype=x.dtype)
    for j, h in enumerate(heads):
        send[j] = x[:, :, np.asarray(h, dtype=np.int64)]
    got = comm.all_to_all(group, send)                                 # (C, B, t, m, hs)
    return np.moveaxis(got, 0, 1).reshape(B, group.size * t, m, hs)


def to_tokens(group, y: np.ndarray, heads, n: int) -> np.ndarray:
    """The way back, to_heads' adjoint. y (B, C t, m, hs): my heads heads[me] of every rank's
    tokens, in rank order. -> (B, t, n, hs): my tokens of all n heads, head h the sum of the
    pieces of every rank that holds it (a KV head copied to C/Hkv ranks: their gradients
    summed; a query head: its one owner's output); a head no rank holds: zeros.

        out[:, :, heads[j]] += y_j[:, me t:(me + 1) t]     y_j: rank j's y"""
    B, Ct, m, hs = y.shape
    _piece(heads)
    C = group.size
    t = Ct // C
    got = comm.all_to_all(group, np.ascontiguousarray(np.moveaxis(y.reshape(B, C, t, m, hs), 1, 0)))
    out = np.zeros((B, t, n, hs), dtype=y.dtype)
    for j, h in enumerate(heads):
        out[:, :, np.asarray(h, dtype=np.int64)] += got[j]
    return out


class UlyssesAttention(Function):
    """Causal self-attention of the whole sequence on the packed projection qkv (B, t, (H +
    2 Hkv) hs) of this rank's tokens -> y (B, t, H hs), as ops.CausalSelfAttention takes and
    gives them. Keeps what the inner attention keeps: q, k, v of its heads over all T tokens
    (the softmax made again in backward). Its head lists are heads_of's and its four
    all-to-alls to_heads and to_tokens (labs/20_ulysses puts a student's there).

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
        self.heads = [heads_of(j, H, Hkv, U) for j in range(U)]
        self.queries = [h[:Hq] for h in self.heads]
        x = qkv.reshape(B, t, H + 2 * Hkv, hs)
        gathered = self._positions(waited("forward", to_heads, group, x, self.heads))   # (B, U t, w)
        if ring is None:
            self.inner = CausalSelfAttention()
            y = self.inner.forward(gathered, Hq, True, kv)            # keeps q, k, v; P made again
        else:
            self.inner = RingSelfAttention()
            y = self.inner.forward(gathered, Hq, ring, layout, kv)
        self.saved, self.inner.saved = self.inner.saved, ()
        back = waited("forward", to_tokens, group, self._ranks(y, Hq), self.queries, H)   # (B, t, H, hs)
        return store(back.reshape(B, t, H * hs), self.dtype)

    def backward(self, g):
        B, t, H, Hkv, hs, Hq, kv = self.dims
        g = compute(g).reshape(B, t, H, hs)
        dy = self._positions(waited("backward", to_heads, self.group, g, self.queries))  # (B, U t, Hq hs)
        self.inner.saved = self.saved
        dmine = self.inner.backward(dy)[0]                             # (B, U t, (Hq + 2 kv) hs)
        self.inner.saved = ()
        dqkv = waited("backward", to_tokens, self.group, self._ranks(dmine, Hq + 2 * kv), self.heads,
                      H + 2 * Hkv)                                     # a copied KV head: summed
        return store(dqkv.reshape(B, t, -1), self.dtype), None, None, None, None, None

    @property
    def order(self) -> np.ndarray:
        """Where the tokens of my Ulysses group's ranks (cp ranks m U + i) go among its U t, in
        position order; made when needed, not kept (U t int64 a layer)."""
        (m, R, T, layout), U = self.where, self.group.size
        mine = positions(m, R, T, layout)                             # sorted
        return np.searchsorted(mine, np.concatenate([positions(m * U + i, U * R, T, layout) for i in range(U)]))

    def _positions(self, got):
        """(B, U t, k, hs) in rank order (to_heads') -> (B, U t, k hs) in position order."""
        B, n, k, hs = got.shape
        out = np.empty((B, n, k * hs), dtype=got.dtype)
        out[:, self.order] = got.reshape(B, n, k * hs)
        return out

    def _ranks(self, a, k):
        """(B, U t, k hs) in position order -> (B, U t, k, hs) in rank order: for to_tokens."""
        B, n, w = a.shape
        return a[:, self.order].reshape(B, n, k, w // k)


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
