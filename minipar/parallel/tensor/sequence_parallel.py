"""Sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198, section 4.2.2), on top of
tensor parallelism: python -m minipar.train --tp T --sp.

Tensor parallelism splits attention and the MLP across the tp ranks but leaves everything
between them replicated: the residual stream, the LayerNorms, the row-parallel biases, the
embeddings. Those work token by token, so sequence parallelism splits them along the
sequence instead: tp rank r holds tokens [r t/tp, (r+1) t/tp) of every sequence there,
(B, t/tp, C) instead of (B, t, C). Tensor parallelism's f and g become

    f  (before a column-parallel layer)  all-gather along the sequence    forward
                                         reduce-scatter along the sequence backward
    g  (after a row-parallel layer)      reduce-scatter along the sequence forward
                                         all-gather along the sequence     backward

    block(x), x (B, t/tp, C):
        x = x + [g(x_attn @ c_proj_r) + c_proj.b]     x_attn = attention(f(LN_1(x)) @ c_attn_r)
        x = x + [g(x_mlp @ c_proj_r) + c_proj.b]      x_mlp = GELU(f(LN_2(x)) @ c_fc_r)

An all-reduce is a reduce-scatter followed by an all-gather, and each of those sends
(tp-1)/tp n per rank for n elements, so f and g send per layer exactly the bytes of
tensor parallelism's two all-reduces each (2(tp-1)/tp n): tests/mpi/test_sequence_parallel.py
holds the ledger to it. (minipar's tensor parallelism all-reduces messages up to 64 KiB by
recursive doubling, log2(tp) n per rank: at tp = 2 that is the same n; at tp >= 4 sequence
parallelism sends less than it on small messages.)

What else changes:
  - the embedding's g becomes a reduce-scatter (forward) / all-gather (backward); each
    rank adds the position embeddings of its own tokens (PositionsOfShard);
  - ln_f runs on the rank's tokens, and the vocabulary-parallel head's f gathers them;
    the logits and the cross-entropy are tensor parallelism's;
  - Megatron's memory trick: a column-parallel layer keeps only its input's shard and
    all-gathers it again in backward for the weight gradient (GatherSequenceLinear), so
    the linear layers' inputs are saved 1/tp too. It costs one more all-gather per such
    layer in backward ("regather" in the ledger), which Megatron overlaps with the input
    gradient's matmul;
  - the trap: every replicated parameter used on the sequence shard (ln_1, ln_2, ln_f,
    the row-parallel biases) now sees only 1/tp of the tokens, so its gradient on a rank
    is a partial sum. SumGradOver all-reduces it over tp in backward (each use, each
    micro-batch; Megatron does one coalesced all-reduce per step), so every gradient
    synchroniser after it (dp buckets, ZeRO) sees whole gradients. wpe's rows are
    disjoint between ranks: an all-gather of them suffices.

The sequence length must be divisible by tp (a ValueError here, a one-line error from the
trainer's flags): minipar does not pad.

Layout: minipar's activations are batch-first (B, t, C), so a sequence piece is not
contiguous; gather_seq and scatter_seq move the tp axis to the front around each
collective (Megatron keeps (t, B, C) to avoid those copies).
"""
from __future__ import annotations

import math

import numpy as np

from minipar import comm
from minipar.comm.ledger import human_bytes
from minipar.autograd import ops
from minipar.model.gpt import param_specs
from minipar.parallel.tensor import tensor_parallel
from minipar.parallel.tensor.tensor_parallel import (MaskColumns, MaskedEmbedding, SumGradOver, TensorParallelGPT,
                                                     TensorSplit, tp_collective)
from minipar.autograd.tensor import Function

KINDS = ("f_gather", "f_scatter", "g_scatter", "g_gather", "regather", "sp_grads")


# --- the collectives along the sequence axis (axis 1) ---------------------------------------

def gather_seq(group: comm.Group, x: np.ndarray, kind: str) -> np.ndarray:
    """(B, t/tp, ...) on each rank -> (B, t, ...), rank r's piece at [r t/tp, (r+1) t/tp)."""
    tp = group.size
    if tp == 1:                                                   # no partner: nothing to send
        return x
    flat = tp_collective(kind, x.size * tp, lambda: comm.all_gather(group, np.ascontiguousarray(x)))
    parts = flat.reshape(tp, *x.shape)                            # (tp, B, t/tp, ...)
    return np.ascontiguousarray(np.moveaxis(parts, 0, 1)).reshape(x.shape[0], tp * x.shape[1], *x.shape[2:])


def scatter_seq(group: comm.Group, x: np.ndarray, kind: str) -> np.ndarray:
    """(B, t, ...) partial sums on each rank -> rank r's tokens of the sum, (B, t/tp, ...)."""
    tp, (B, t) = group.size, x.shape[:2]
    if tp == 1:
        return x
    parts = np.ascontiguousarray(np.moveaxis(x.reshape(B, tp, t // tp, *x.shape[2:]), 1, 0))
    piece = tp_collective(kind, x.size, lambda: comm.reduce_scatter(group, parts))
    return piece.reshape(B, t // tp, *x.shape[2:])


# --- f, g and the replicated parameters, as autograd nodes ------------------------------------

class ScatterToSequence(Function):
    """Sequence parallelism's g: reduce-scatter along the sequence forward (each rank keeps
    the sum for its tokens), all-gather of the gradient backward."""

    def forward(self, x, group):
        self.group = group
        return scatter_seq(group, x, "g_scatter")

    def backward(self, g):
        return gather_seq(self.group, g, "g_gather"), None


class GatherSequenceLinear(Function):
    """Sequence parallelism's f fused with the column-parallel linear after it:
    y = all_gather_seq(x) @ w + b, x (B, t/tp, Cin) -> y (B, t, Cout/tp). Keeps x's shard
    only (not the gathered (B, t, Cin)), and all-gathers it again in backward for dw;
    dx is the reduce-scatter of the gathered input's gradient. The matmuls are ops.Linear's,
    w in column pieces as there (Llama's [q | k | v]: `pieces` after the group)."""

    def forward(self, x, w, b, group, *pieces):
        self.group, self.has_bias = group, b is not None
        self.linear = ops.Linear()
        full = self.gather(x, "f_gather")                             # (B, t, Cin)
        y = self.linear.forward(full, w, b, *pieces)
        self.linear.saved = ()                                        # the gathered input is not kept
        self.save(x, w, *pieces)
        return y

    def backward(self, g):
        x, w, *pieces = self.saved
        needs = self.needs_input_grad            # backward_split may ask for dx or dw alone
        self.linear.needs_input_grad = (*needs[:3], *needs[4:])       # Linear's (x, w, b, *pieces)
        need_w = needs[1] or any(needs[4:])
        full = self.gather(x, "regather") if need_w else x            # again, for dw
        self.linear.saved = (full.reshape(-1, full.shape[-1]), w, *pieces)
        dx, dw, db, *dpieces = self.linear.backward(g)
        self.linear.saved = ()
        dx = None if dx is None else self.scatter(dx)
        return (dx, dw, db, None, *dpieces)

    def gather(self, x, kind):
        """f's all-gather along the sequence (kind: "f_gather" forward, "regather" backward)."""
        return gather_seq(self.group, x, kind)

    def scatter(self, dx):
        """f's backward: the reduce-scatter along the sequence of the gathered input's gradient."""
        return scatter_seq(self.group, dx, "f_scatter")


class PositionsOfShard(Function):
    """The wpe rows of this rank's shard of the sequence's positions pos (t of them: 0..t-1, or
    a cp rank's global positions), pos[r t/tp : (r+1) t/tp]. Each position's gradient is on one
    rank only, so backward all-gathers the (t/tp, C) pieces into the t rows of pos."""

    def forward(self, wpe, pos, group):
        n = len(pos) // group.size
        self.group, self.pos, self.shape = group, np.asarray(pos), wpe.shape
        return wpe[self.pos[group.rank * n:(group.rank + 1) * n]]

    def backward(self, g):
        t = len(self.pos)
        dw = np.zeros(self.shape, dtype=g.dtype)
        dw[self.pos] = g if self.group.size == 1 else tp_collective(
            "sp_grads", t * g.shape[-1],
            lambda: comm.all_gather(self.group, np.ascontiguousarray(g))).reshape(t, -1)
        return dw, None, None


# --- the layers of a sequence-parallel rank -------------------------------------------------------

class SequenceSplit(TensorSplit):
    """Tensor parallelism's layers with the residual stream split along the sequence between
    them (see the module): what a family's forward calls on a tp rank with --sp. Block i maps
    (B, t/tp, C) -> (B, t/tp, C); logits() returns tensor parallelism's vocabulary-sharded
    logits of all t tokens."""

    gather_linear = GatherSequenceLinear                              # f fused with a column-parallel linear

    def column(self, x, w, b=None):
        w = list(w) if isinstance(w, (list, tuple)) else [w]          # a weight, or its column pieces
        return self.gather_linear.apply(x, w[0], b, self.group, *w[1:])

    def row(self, x, w, b=None):
        y = ScatterToSequence.apply(ops.linear(x, w), self.group)
        return y if b is None else y + b

    def replicated(self, p):
        return SumGradOver.apply(p, self.group, "sp_grads")

    def check_ids(self, idx, cfg):
        idx = super().check_ids(idx, cfg)
        if idx.shape[-1] % self.group.size:
            raise ValueError(f"sequence parallelism splits each sequence over tp {self.group.size}: "
                             f"length {idx.shape[-1]} is not divisible by {self.group.size}")
        return idx

    def tokens(self, idx, w):
        tok = MaskedEmbedding.apply(idx, w, self.vocab_start)             # (B, t, C), partial
        return ScatterToSequence.apply(tok, self.group)                   # (B, t/tp, C), summed

    def positions(self, w, pos):
        return PositionsOfShard.apply(w, pos, self.group)

    def logits(self, x, w):
        """(B, t/tp, C) -> vocab-sharded logits (B, t, Vp/tp); padded columns are -inf."""
        logits = self.gather_linear.apply(x, ops.transpose(w), None, self.group)
        return logits if self.vocab_valid == w.shape[0] else MaskColumns.apply(logits, self.vocab_valid)


class SequenceParallelGPT(TensorParallelGPT):
    """TensorParallelGPT (the same shards, canonical names, checkpoints) on SequenceSplit's layers."""

    sequence_parallel = True
    split_class = SequenceSplit


# --- the formulas: what sequence parallelism sends ---------------------------------------------

def replicated_sums(cfg) -> tuple[tuple[int, int], tuple[int, int], int]:
    """What sequence parallelism sums over tp, from the family's names: ((calls, elements) per
    block: the parameters of a block that every rank holds whole, GPT-2's two LayerNorms' weight
    and bias and the two row-parallel biases (6, 6C), Llama's two RMSNorm weights (2, 2C);
    (calls, elements) of the final norm; elements of the position table's rows (GPT-2's wpe:
    t C, gathered; 0 for rotary positions))."""
    fam, h = cfg.family, cfg.family.block_prefix(0)
    specs = param_specs(cfg)
    block = [math.prod(s) for n, s, _ in specs if n.startswith(h) and fam.split_kind(n) == "replicated"]
    final = [math.prod(s) for n, s, _ in specs if n in fam.final_names]
    return (len(block), sum(block)), (len(final), sum(final)), (cfg.n_embd if fam.positions else 0)


def sp_count(cfg, rows: int, t: int, tp: int, n_layers: int | None = None, first: bool = True,
             last: bool = True, recompute: str = "none") -> dict:
    """{kind: (calls, elements)} of one micro-batch of `rows` sequences of t tokens on a tp
    rank holding n_layers blocks (default all), the embedding if first, the head if last.
    elements: of the whole (rows, t, C) tensor each gather/scatter assembles or splits (for
    sp_grads, the parameter gradient). Per block: f and g twice each way, the re-gather of
    both column-parallel inputs, the gradient sums of its replicated parameters
    (replicated_sums: GPT-2 six of C, Llama two); full recomputation runs each block's forward
    gathers and scatters once more. The embedding: one g (scatter forward, gather backward)
    and GPT-2's wpe all-gather of t*C; the head: one f, its re-gather, the final norm's sums,
    the cross-entropy's three all-reduces of rows*t; shared key/value heads their sums
    (tensor_parallel.kv_grad_count)."""
    L = cfg.n_layer if n_layers is None else n_layers
    n = rows * t * cfg.n_embd
    again = 2 if recompute == "full" else 1
    f_fwd = again * 2 * L + (1 if last else 0)            # column-parallel layers' gathers
    g_fwd = again * 2 * L + (1 if first else 0)           # row-parallel layers' (and the embedding's) scatters
    f_bwd, g_bwd = 2 * L + (1 if last else 0), 2 * L + (1 if first else 0)
    (bc, be), (fc, fe), pos = replicated_sums(cfg)
    grads = [(bc * L, be * L)] + ([(fc, fe)] if last else []) + ([(1, t * pos)] if first and pos else [])
    out = {"f_gather": (f_fwd, f_fwd * n), "f_scatter": (f_bwd, f_bwd * n),
           "g_scatter": (g_fwd, g_fwd * n), "g_gather": (g_bwd, g_bwd * n),
           "regather": (f_bwd, f_bwd * n),
           "sp_grads": (sum(c for c, _ in grads), sum(e for _, e in grads))}
    if last:
        out["cross_entropy"] = (3, 3 * rows * t)
    kv = tensor_parallel.kv_grad_count(cfg, tp, L)
    if kv[0]:
        out["kv_grads"] = kv
    return out


def summary(tp_ledger: dict, rows_log: list, cfg, *, tp: int, rows: int, micro_batches: int,
            layers: int, pp_rank: int, pp: int, recompute: str, cp: int = 1,
            moe_blocks: int = 0) -> tuple[dict, list[str]]:
    """What sequence (and tensor) parallelism sent on this rank, per step, beside sp_count's
    gathers, scatters and sums by kind, of this rank's pipeline stage; the arguments are
    tensor_parallel.summary's (moe_blocks is always 0: a mixture of experts does not run with --sp)."""
    M, T = micro_batches, cfg.block_size // cp
    steps_run = len(rows_log)
    kinds, calls, elements, tp_bytes = tensor_parallel.measured(tp_ledger, rows_log)
    out = {"tp": tp, "sequence_parallel": True, "collectives_per_step": calls,
           "elements_per_step": elements, "bytes_per_step": tp_bytes}
    want = sp_count(cfg, rows, T, tp, layers, pp_rank == 0, pp_rank == pp - 1, recompute)
    out["by_kind"] = {k: {"calls": v["calls"] / steps_run, "elements": v["elements"] / steps_run,
                          "formula_calls": M * want[k][0], "formula_elements": M * want[k][1]}
                      for k, v in kinds.items()}
    exact = all(v["calls"] == v["formula_calls"] and v["elements"] == v["formula_elements"]
                for v in out["by_kind"].values()) and set(kinds) == set(want)
    return out, [f"  sequence parallel: {calls:.0f} collectives/step of {elements:,.0f} elements "
                 f"({', '.join(f'{k} {v[0] * M}' for k, v in want.items())}: "
                 f"{'= sp_count' if exact else 'NOT sp_count'} x {M} micro-batch(es)), "
                 f"{human_bytes(tp_bytes)}/step sent per rank, + 1 for the global grad norm"]
