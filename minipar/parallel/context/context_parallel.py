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

A model takes part through its Parts (model/contract.py): ContextSplit.attention is its attention
and ContextSplit.global_positions its positions (minipar/parallel/parallelize.py).
"""
from __future__ import annotations

import numpy as np

from minipar.parallel.context import ring_attention
from minipar.parallel.context.allgather_attention import AllGatherAttention, allgather_traffic
from minipar.parallel.context.ring_attention import LAYOUTS, RingAttention, positions
from minipar.parallel.context.ulysses import UlyssesAttention, head_split, ulysses_traffic
from minipar.autograd.dtypes import compute, store
from minipar.autograd.attention import head_counts
from minipar.autograd.tensor import Function

__all__ = ["ContextSplit", "RingSelfAttention", "AllGatherSelfAttention", "IMPLS", "LAYOUTS", "step_traffic",
           "summary"]


IMPLS = ("ring", "ulysses", "allgather")


class ContextSplit:
    """This rank's share of every sequence: its cp group, the layout of the split and how its
    attention talks (impl: ring, ulysses or allgather)."""

    def __init__(self, group, layout: str = "zigzag", impl: str = "ring"):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if impl not in IMPLS:
            raise ValueError(f"--cp-impl must be one of {IMPLS}, got {impl!r}")
        self.group, self.layout, self.impl = group, layout, impl

    @property
    def size(self) -> int:
        return self.group.size

    def positions(self, T: int) -> np.ndarray:
        """Global positions of this rank's T/C tokens of a sequence of T, in its order."""
        return positions(self.group.rank, self.group.size, T, self.layout)

    def global_positions(self, t: int, block_size: int) -> np.ndarray:
        """Parts.positions with context parallelism: the global positions of this rank's t
        tokens of a sequence of t * C."""
        T = t * self.size
        if T > block_size:
            raise ValueError(f"sequence length {T} > block_size {block_size}")
        return self.positions(T)

    def local(self, a) -> np.ndarray:
        """This rank's tokens of a (..., T) array of ids or targets: (..., T/C)."""
        a = np.asarray(a)
        return a[..., self.positions(a.shape[-1])]

    def attention(self, qkv, n_head: int, n_kv_head: int | None = None):
        """Causal self-attention of the whole sequence for this rank's queries."""
        cls = {"ring": RingSelfAttention, "ulysses": UlyssesAttention, "allgather": AllGatherSelfAttention}[self.impl]
        return cls.apply(qkv, n_head, self.group, self.layout, n_kv_head)


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


def kv_width(cfg, tp: int) -> int:
    """The channels of the key (or value) heads one tp rank holds: Hkv/tp heads of hs, at least
    one head (tp > Hkv: a shared one). GPT-2: C/tp."""
    return max(1, cfg.kv_heads // tp) * cfg.head_size


def call_traffic(impl: str, rows: int, T: int, C: int, cfg, tp: int, itemsize: int,
                 forwards: int = 1) -> tuple[int, int]:
    """(messages, bytes) one rank sends for one attention call and its backward, `rows`
    sequences of T tokens split over C ranks: ring_attention.ring_traffic (n = rows (T/C)
    kv_width elements of its keys: only the key heads travel), allgather_traffic (the same n)
    or ulysses_traffic (its heads after tp, ulysses.head_split). messages: the ring's
    point-to-point messages, or the collectives called (2 per call: forward's, backward's)."""
    width, t = kv_width(cfg, tp), T // C
    if C == 1:
        return 0, 0
    if impl == "ring":
        return ring_attention.ring_traffic(rows * t * width, C, itemsize, forwards)
    if impl == "allgather":
        return forwards + 1, allgather_traffic(rows * t * width, C, itemsize, forwards)
    hs = cfg.head_size
    Hq, kv = head_split(cfg.n_head // tp, width // hs, C)
    return 2 * (forwards + 1), ulysses_traffic(rows * t, Hq, kv, hs, C, itemsize, forwards)


def step_traffic(layers: int, micro_batches: int, rows: int, T: int, C: int, cfg, tp: int, itemsize: int,
                 recompute: str = "none", impl: str = "ring") -> tuple[int, int]:
    """(messages, bytes) a rank sends over its cp group in one training step: one attention call
    per layer it runs and micro-batch (call_traffic); with --recompute full each forward runs
    twice. itemsize: of the compute dtype (fp16/bf16 attend in float32)."""
    messages, nbytes = call_traffic(impl, rows, T, C, cfg, tp, itemsize, 2 if recompute == "full" else 1)
    calls = layers * micro_batches
    return calls * messages, calls * nbytes


FORMULAS = {   # impl: the summary's words for call_traffic, per layer and micro-batch
    "ring": "[2n(C-1) fwd{full} + 2n(C-1) + 2nC bwd] x {s} B + {messages} headers, n = {n}",
    "allgather": "[all-gather 2n(C-1) fwd{full} + reduce-scatter 2n(C-1) bwd] x {s} B, n = {n}",
    "ulysses": "[(C-1)/C of q, k, v and of o fwd{full}, of do and dq, dk, dv bwd: all-to-alls] x {s} B, "
               "{heads} heads a rank, n = {n}",
}


def summary(rows_log: list, cfg, *, cp: int, layout: str, rows: int, micro_batches: int, layers: int,
            tp: int, itemsize: int, recompute: str, impl: str = "ring") -> tuple[dict, list[str]]:
    """The summary's context-parallel figures for this rank: the bytes its attention sent per
    step (the rows' "cp" axis) beside step_traffic, the seconds waited on the ring (cp_wait_s),
    and the sub-blocks of scores each cp rank computes per pass (the load balance of the
    layout). rows: sequences per micro-batch of this dp rank; layers: those this rank runs;
    itemsize: of the dtype attention computes in."""
    C, M, T = cp, micro_batches, cfg.block_size
    messages, want = step_traffic(layers, M, rows, T, C, cfg, tp, itemsize, recompute, impl)
    sent = float(np.mean([r["bytes_by_axis"].get("cp", 0) for r in rows_log]))
    wait = float(np.mean([r["cp_wait_s"] for r in rows_log]))
    work = [ring_attention.blocks(r, C, T, layout) for r in range(C)]
    other = "contiguous" if layout == "zigzag" else "zigzag"
    work_other = [ring_attention.blocks(r, C, T, other) for r in range(C)]
    out = {"cp": C, "impl": impl, "layout": layout, "tokens_per_rank": T // C, "bytes_per_step": sent,
           "theory_bytes_per_step": want, "messages_per_step": messages, "wait_s_per_step": wait,
           "sub_blocks_per_rank": work, f"sub_blocks_per_rank_{other}": work_other}
    ratio = sent / want if want else float("nan")
    pairs = "/".join(str(ring_attention.pairs(r, C, T, layout)) for r in range(C))
    balance = {"ring": f"score sub-blocks per rank and pass {'/'.join(map(str, work))} "
                       f"({other}: {'/'.join(map(str, work_other))})",
               "ulysses": "every rank attends over all T tokens for its H/C heads: the same work on each",
               "allgather": f"(query, key) pairs per rank {pairs}"}[impl]
    width = kv_width(cfg, tp)
    heads = "/".join(map(str, head_split(cfg.n_head // tp, width // cfg.head_size, C))) if impl == "ulysses" else ""
    formula = FORMULAS[impl].format(full=" x 2 (full recompute)" if recompute == "full" else "", s=itemsize,
                                    messages=messages, heads=heads,
                                    n=f"{rows}x{T // C}x{width}" if impl != "ulysses" else f"B t = {rows}x{T // C}")
    line = (f"  context parallel: cp={C} {impl} ({layout}), {T // C} of {T} tokens per rank; sent "
            f"{sent:,.0f} B/step per rank, theory {layers} layer(s) x {M} micro-batch(es) x {formula} "
            f"= {want:,} B (ratio {ratio:.3f}); waited {wait * 1e3:.1f} ms/step for its messages; "
            + balance)
    return out, [line]
