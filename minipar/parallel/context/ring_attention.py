"""Ring attention for context parallelism (Liu et al. 2023, arXiv:2310.01889): causal
attention over a sequence split across the C ranks of a cp group, on minipar's own
point-to-point messages: the attention of context parallelism (context_parallel.py, --cp).
tests/mpi/test_ring_attention.py holds it to the single-process attention.

The split. The sequence of T tokens is cut into 2C chunks of T/(2C); rank i keeps chunks i and
2C-1-i ("zig-zag", or head and tail), so that under the causal mask every rank has the same
number of (query, key) pairs to compute: a rank holding an early chunk also holds a late one.
The contiguous split (rank i keeps tokens [2i, 2i+2) chunks) is here too, to show the imbalance.
The work is done in c x c sub-blocks, c = T/2C (a rank's two chunks against the two chunks
of the K, V block in hand); a sub-block whose keys all come after its queries is skipped, so
a rank computes blocks() of them per pass: 2C + 1 under zig-zag on every rank (2C - 1 below
the diagonal, 2 on it), 4r + 3 on rank r under the contiguous split.

Forward, on rank r with its queries q (B, H, t, hs), t = T/C, and its own keys and values:
C steps; at step j it holds the K, V block of rank r - j (mod C) and, while it computes with it,
already passes it on to rank r + 1 (non-blocking send and receive: the transfer overlaps the
compute). Each block's scores S = q K^T / sqrt(hs), masked where the key's position is after
the query's, are merged into the running output with the log-sum-exp rescaling of an online
softmax:
    m' = max(m, rowmax S);  l' = l e^(m - m') + rowsum e^(S - m');  acc' = acc e^(m - m') + e^(S - m') V
    o = acc / l,  lse = m + log l          (the softmax over all T keys, without ever holding them)
Backward passes K and V round the ring again, with dK and dV travelling beside them: at step j
the rank adds its queries' share to the block's dK, dV (P = e^(S - lse), dS = P (dO V^T - D),
D = rowsum(dO o); dV += P^T dO, dK += dS^T q / sqrt(hs), dQ += dS K / sqrt(hs)), and after C
passes each block's dK, dV arrive back at their owner. Passing them round again costs C - 1
more K, V transfers and C of dK, dV, and these do not overlap the compute (the block a rank
passes on is the one it has just added to); keeping every received block instead would hold
the whole sequence's K and V on each rank, the memory context parallelism exists to avoid.

Messages per attention call and rank, n = B H t hs elements: forward C - 1, each K and V as
one array (2n); backward C, C - 1 of them K, V, dK, dV together (4n), then dK, dV home (2n).
In all 2n(C-1) forward and 2n(C-1) + 2nC backward, as the ledger counts them.
"""
from __future__ import annotations

import math
import time

import numpy as np

from minipar import comm
from minipar.comm.protocol import HEADER_BYTES
from minipar.autograd.tensor import Function

LAYOUTS = ("zigzag", "contiguous")


def positions(rank: int, n_ranks: int, T: int, layout: str = "zigzag") -> np.ndarray:
    """The global positions of rank `rank`'s T/C tokens, in the order it holds them."""
    C = n_ranks
    if T % (2 * C):
        raise ValueError(f"context parallelism cuts the sequence into 2 x cp = {2 * C} chunks: "
                         f"length {T} is not divisible by {2 * C}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    c = T // (2 * C)
    if layout == "contiguous":
        return np.arange(2 * rank * c, 2 * (rank + 1) * c)
    return np.concatenate([np.arange(rank * c, (rank + 1) * c),
                           np.arange((2 * C - 1 - rank) * c, (2 * C - rank) * c)])


def pairs(rank: int, n_ranks: int, T: int, layout: str = "zigzag") -> int:
    """(query, key) pairs rank `rank` computes under the causal mask: its work."""
    mine = positions(rank, n_ranks, T, layout)
    return int(sum(int(p) + 1 for p in mine))


def ring_traffic(n: int, C: int, itemsize: int, forwards: int = 1) -> tuple[int, int]:
    """(messages, bytes) one rank sends for one attention call and its backward, n = B H t hs
    elements of its q (of K, and of V): forward C - 1 messages of 2n, backward C - 1 of 4n and
    one of 2n, each with its header (comm.HEADER_BYTES). forwards = 2 when the forward runs
    again in backward (--recompute full)."""
    if C == 1:
        return 0, 0
    messages = forwards * (C - 1) + C
    elements = forwards * 2 * n * (C - 1) + 2 * n * (C - 1) + 2 * n * C
    return messages, elements * itemsize + messages * HEADER_BYTES


def sub_blocks(pos_q, pos_k):
    """The c x c sub-blocks worth computing when queries at pos_q meet keys at pos_k (each two
    chunks of c = t/2): -> [(query slice, key slice, mask)]. A sub-block whose keys all come
    after its queries is skipped (fully masked); mask is the causal mask (True: masked) where
    some do (a chunk against itself), None where none do."""
    c = len(pos_q) // 2
    halves = (slice(0, c), slice(c, 2 * c))
    out = []
    for a in halves:
        for b in halves:
            pq, pk = pos_q[a], pos_k[b]
            if pk[0] > pq[-1]:
                continue
            out.append((a, b, pk[None, :] > pq[:, None] if pk[-1] > pq[0] else None))
    return out


def blocks(rank: int, n_ranks: int, T: int, layout: str = "zigzag") -> int:
    """c x c sub-blocks of scores rank `rank` computes in one pass (forward, or backward),
    c = T/2C: zig-zag 2C + 1 on every rank, contiguous 4 rank + 3. Its attention time."""
    mine = positions(rank, n_ranks, T, layout)
    return sum(len(sub_blocks(mine, positions(o, n_ranks, T, layout))) for o in range(n_ranks))


def _scores(q, k, mask, scale):
    """q K^T * scale, -inf where mask (a key after its query)."""
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    return s if mask is None else np.where(mask, -np.inf, s)


# The plain math of the merge the forward does, as two functions on normalised results:
# attention over a piece of the keys gives (o, lse), and two pieces merge into the attention
# over their union. RingAttention.forward does the same with unnormalised accumulators (acc, l,
# m: o = acc / l, lse = m + log l), which saves a division per block; tests/test_ring_merge.py
# holds the two to each other and to one softmax.

def partial_attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(hs)) v over the keys k, v only -> (o, lse): q (..., tq, hs), k, v
    (..., tk, hs), mask (tq, tk) True where a key is hidden (after its query), or None; lse
    (..., tq) the log of the softmax's denominator, log sum_j e^(s_j). A row that sees no key
    has o = 0 and lse = -inf: the neutral element of merge."""
    s = (q @ np.swapaxes(k, -1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if mask is not None:
        s = np.where(mask, -np.inf, s)
    m = s.max(-1) if s.shape[-1] else np.full(s.shape[:-1], -np.inf, s.dtype)
    shift = np.where(np.isfinite(m), m, 0).astype(s.dtype)
    p = np.exp(s - shift[..., None])
    total = p.sum(-1)
    with np.errstate(divide="ignore"):
        lse = shift + np.log(total)                                   # log 0 = -inf: no key
    o = (p @ v) / np.where(total > 0, total, 1)[..., None]
    return o, lse


def merge(o1, lse1, o2, lse2):
    """Two attention results over disjoint sets of keys -> the one over their union:
    lse = log(e^lse1 + e^lse2) (computed from the larger), o = e^(lse1 - lse) o1 + e^(lse2 - lse) o2.
    (o, -inf) is neutral; two -inf give (0, -inf)."""
    lse = np.logaddexp(lse1, lse2)
    ref = np.where(np.isfinite(lse), lse, 0).astype(lse.dtype)
    w1, w2 = np.exp(lse1 - ref), np.exp(lse2 - ref)
    return w1[..., None] * o1 + w2[..., None] * o2, lse


# The c x c sub-blocks of scores this process has computed, by pass (blocks()). The seconds
# it has spent waiting for ring messages, by pass, the communication the compute did not
# hide (the "exposed" time; scripts/bench_ring.py, the trainer's row), are counted in the
# comm ledger: comm.counts("ring") -> {"forward": {"waited": s}, "backward": {...}}.
BLOCKS = {"forward": 0, "backward": 0}


def _ring_step(group, outgoing):
    """Start passing `outgoing` to the next rank and receiving from the previous one."""
    nxt, prev = (group.rank + 1) % group.size, (group.rank - 1) % group.size
    return comm.send_async(group, outgoing, nxt), comm.recv_async(group, prev)


def _finish(handles, which: str):
    """Wait for a ring step: the receive first (waiting on it moves both messages along;
    waiting on the send first can deadlock the ring), then the send. -> the received array."""
    t0 = time.perf_counter()
    got = handles[1].wait()
    handles[0].wait()
    comm.count("ring", which, waited=time.perf_counter() - t0)
    return got


def waited(which: str, call, *args):
    """call(*args): a blocking collective of another cp implementation (Ulysses' all-to-alls,
    the KV all-gather and reduce-scatter), all of whose time is waited, counted as the ring's
    waits are (comm.counts("ring")[which]["waited"]: the trainer's cp_wait_s)."""
    t0 = time.perf_counter()
    out = call(*args)
    comm.count("ring", which, waited=time.perf_counter() - t0)
    return out


def _progress(handles):
    """Let the messages in flight advance (minipar's handles move only when tested)."""
    if handles is not None:
        handles[1].test()
        handles[0].test()


def _fold(grad, like):
    """A key head's gradient from its query heads' (grouped-query attention, heads (B, Hkv, g,
    t, hs) against keys (B, Hkv, 1, t, hs)): summed over the g query heads that read it."""
    return grad if grad.shape[-3] == like.shape[-3] else grad.sum(-3, keepdims=True)


class RingAttention(Function):
    """o = causal softmax(q K^T / sqrt(hs)) V over the whole sequence, q (..., t, hs) and k, v
    this rank's tokens at `layout` positions of a sequence of t * C (see the module): (B, H, t,
    hs) each, or grouped-query q (B, Hkv, g, t, hs) against k, v (B, Hkv, 1, t, hs)."""

    def forward(self, q, k, v, group, layout="zigzag", overlap=True):
        C, r = group.size, group.rank
        T = q.shape[-2] * C
        self.group, self.layout, self.T = group, layout, T
        self.scale = 1.0 / math.sqrt(q.shape[-1])                    # a Python float: float32 stays float32
        pos_q = positions(r, C, T, layout)
        m = np.full(q.shape[:-1], -np.inf, dtype=q.dtype)
        l = np.zeros(q.shape[:-1], dtype=q.dtype)
        acc = np.zeros_like(q)
        kv = np.stack([k, v])                                         # (2, B, H, t, hs): one message
        for j in range(C):
            owner = (r - j) % C
            handles = _ring_step(group, kv) if j < C - 1 else None
            # overlap=False, the benchmark's baseline: the whole transfer, then the compute
            ready = _finish(handles, "forward") if handles is not None and not overlap else None
            for a, b, mask in sub_blocks(pos_q, positions(owner, C, T, layout)):
                s = _scores(q[..., a, :], kv[0][..., b, :], mask, self.scale)
                m_new = np.maximum(m[..., a], s.max(-1))
                p = np.exp(s - m_new[..., None])                      # masked: exp(-inf) = 0
                fix = np.exp(m[..., a] - m_new)                       # 0 on a row's first block
                l[..., a] = l[..., a] * fix + p.sum(-1)
                acc[..., a, :] = acc[..., a, :] * fix[..., None] + p @ kv[1][..., b, :]
                m[..., a] = m_new
                BLOCKS["forward"] += 1
                _progress(handles)
            if handles is not None:
                kv = _finish(handles, "forward") if overlap else ready
        o = acc / l[..., None]
        self.save(q, k, v, o, m + np.log(l))
        return o

    def backward(self, do):
        q, k, v, o, lse = self.saved
        group, C, r, T = self.group, self.group.size, self.group.rank, self.T
        pos_q = positions(r, C, T, self.layout)
        D = (do * o).sum(-1)                                          # (B, H, t)
        dq = np.zeros_like(q)
        block = np.stack([k, v, np.zeros_like(k), np.zeros_like(v)])  # K, V, dK, dV travel together
        for j in range(C):
            owner = (r - j) % C
            kb, vb, dk, dv = block
            for a, b, mask in sub_blocks(pos_q, positions(owner, C, T, self.layout)):
                qa, da = q[..., a, :], do[..., a, :]
                p = np.exp(_scores(qa, kb[..., b, :], mask, self.scale) - lse[..., a, None])  # P again
                dv[..., b, :] += _fold(np.swapaxes(p, -1, -2) @ da, dv)
                ds = p * (da @ np.swapaxes(vb[..., b, :], -1, -2) - D[..., a, None])
                dq[..., a, :] += (ds @ kb[..., b, :]) * self.scale
                dk[..., b, :] += _fold(np.swapaxes(ds, -1, -2) @ qa, dk) * self.scale
                BLOCKS["backward"] += 1
            outgoing = block if j < C - 1 else block[2:]              # the last pass: dK, dV home
            if C > 1:
                got = _finish(_ring_step(group, np.ascontiguousarray(outgoing)), "backward")
                block = got if j < C - 1 else np.concatenate([block[:2], got])
        return dq, block[2], block[3], None, None, None


def ring_attention(q, k, v, group, layout: str = "zigzag", overlap: bool = True):
    """overlap=False waits for each K, V block before computing with the one in hand: the
    baseline that shows what overlapping hides (scripts/bench_ring.py)."""
    return RingAttention.apply(q, k, v, group, layout, overlap)
