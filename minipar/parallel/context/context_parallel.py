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
from minipar.parallel.context.ring_attention import LAYOUTS, RingAttention, positions
from minipar.autograd.dtypes import compute, store
from minipar.autograd.attention import head_counts

__all__ = ["ContextSplit", "RingSelfAttention", "LAYOUTS", "step_traffic", "summary"]


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
        return RingSelfAttention.apply(qkv, n_head, self.group, self.layout, n_kv_head)


class RingSelfAttention(RingAttention):
    """RingAttention on the packed projection qkv (B, t, (H + 2 Hkv) hs) = [q | k | v],
    -> y (B, t, H hs), as ops.CausalSelfAttention takes and gives them (H = n_head/tp with
    tensor parallelism). Grouped-query attention (Hkv < H): the heads are arranged
    (B, Hkv, g, t, hs), g = H/Hkv, so only the Hkv key and value heads go round the ring and
    the g query heads of a group meet theirs by broadcasting. fp16/bf16 attend in fp32, like
    every op. It keeps q, k, v, the output and the log-sum-exp (never the t x T softmax):
    selective recomputation built in."""

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
        o = super().forward(q, k, v, group, layout)                   # (B, Hkv, g, t, hs)
        return store(o.transpose(0, 3, 1, 2, 4).reshape(B, t, H * hs), self.dtype)

    def backward(self, g):
        B, t, H, Hkv, hs = self.dims
        do = np.ascontiguousarray(compute(g).reshape(B, t, Hkv, H // Hkv, hs).transpose(0, 2, 3, 1, 4))
        dq, dk, dv = super().backward(do)[:3]

        def merge(a):                                                 # (B, n, g, t, hs) -> (B, t, n g hs)
            return a.transpose(0, 3, 1, 2, 4).reshape(B, t, -1)

        dqkv = np.concatenate([merge(dq), merge(dk), merge(dv)], axis=-1)
        return store(dqkv, self.dtype), None, None, None, None


def kv_width(cfg, tp: int) -> int:
    """The channels of the key (or value) heads one tp rank holds: Hkv/tp heads of hs, at least
    one head (tp > Hkv: a shared one). GPT-2: C/tp."""
    return max(1, cfg.kv_heads // tp) * cfg.head_size


def step_traffic(layers: int, micro_batches: int, rows: int, T: int, width: int, C: int, itemsize: int,
                 recompute: str = "none") -> tuple[int, int]:
    """(messages, bytes) a rank sends round its cp ring in one training step: one attention
    call per layer it runs and micro-batch, each ring_attention.ring_traffic with
    n = rows (T/C) width elements (width = kv_width: the channels of its key heads, C/tp for
    GPT-2; grouped-query attention sends only its Hkv heads); with --recompute full each
    forward runs twice. itemsize: of the compute dtype (fp16/bf16 attend in float32)."""
    messages, nbytes = ring_attention.ring_traffic(rows * (T // C) * width, C, itemsize,
                                                   2 if recompute == "full" else 1)
    calls = layers * micro_batches
    return calls * messages, calls * nbytes


def summary(rows_log: list, cfg, *, cp: int, layout: str, rows: int, micro_batches: int, layers: int,
            tp: int, itemsize: int, recompute: str) -> tuple[dict, list[str]]:
    """The summary's context-parallel figures for this rank: the ring's bytes per step (the
    rows' "cp" axis) beside step_traffic, the seconds waited on it (cp_wait_s), and the
    sub-blocks of scores each cp rank computes per pass (the load balance of the layout).
    rows: sequences per micro-batch of this dp rank; layers: those this rank runs; itemsize:
    of the dtype attention computes in."""
    C, M, T = cp, micro_batches, cfg.block_size
    width = kv_width(cfg, tp)
    messages, want = step_traffic(layers, M, rows, T, width, C, itemsize, recompute)
    sent = float(np.mean([r["bytes_by_axis"].get("cp", 0) for r in rows_log]))
    wait = float(np.mean([r["cp_wait_s"] for r in rows_log]))
    work = [ring_attention.blocks(r, C, T, layout) for r in range(C)]
    other = "contiguous" if layout == "zigzag" else "zigzag"
    work_other = [ring_attention.blocks(r, C, T, other) for r in range(C)]
    out = {"cp": C, "layout": layout, "tokens_per_rank": T // C, "bytes_per_step": sent,
           "theory_bytes_per_step": want, "messages_per_step": messages, "wait_s_per_step": wait,
           "sub_blocks_per_rank": work, f"sub_blocks_per_rank_{other}": work_other}
    ratio = sent / want if want else float("nan")
    line = (f"  context parallel: cp={C} ({layout}), {T // C} of {T} tokens per rank; ring sent "
            f"{sent:,.0f} B/step per rank, theory {layers} layer(s) x {M} micro-batch(es) x "
            f"[2n(C-1) fwd{' x 2 (full recompute)' if recompute == 'full' else ''} + 2n(C-1) + 2nC bwd] "
            f"x {itemsize} B + {messages} headers, n = {rows}x{T // C}x{width} "
            f"= {want:,} B (ratio {ratio:.3f}); waited {wait * 1e3:.1f} ms/step for ring messages; "
            f"score sub-blocks per rank and pass {'/'.join(map(str, work))} "
            f"({other}: {'/'.join(map(str, work_other))})")
    return out, [line]
