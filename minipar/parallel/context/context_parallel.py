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


def step_traffic(layers: int, micro_batches: int, rows: int, T: int, width: int, C: int, itemsize: int,
                 recompute: str = "none") -> tuple[int, int]:
    """(messages, bytes) a rank sends round its cp ring in one training step: one attention
    call per layer it runs and micro-batch, each ring_attention.ring_traffic with
    n = rows (T/C) width elements (width = C_model/tp, the channels of its heads); with
    --recompute full each forward runs twice. itemsize: of the compute dtype (fp16/bf16
    attend in float32)."""
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
    messages, want = step_traffic(layers, M, rows, T, cfg.n_embd // tp, C, itemsize, recompute)
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
            f"x {itemsize} B + {messages} headers, n = {rows}x{T // C}x{cfg.n_embd // tp} "
            f"= {want:,} B (ratio {ratio:.3f}); waited {wait * 1e3:.1f} ms/step for ring messages; "
            f"score sub-blocks per rank and pass {'/'.join(map(str, work))} "
            f"({other}: {'/'.join(map(str, work_other))})")
    return out, [line]
