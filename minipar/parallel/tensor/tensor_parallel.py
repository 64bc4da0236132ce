"""Tensor parallelism as in Megatron-LM (Shoeybi et al., 2019): every layer split across the
tp ranks of a group, each rank holding 1/tp of the weights and doing 1/tp of the matmuls.

What is split (rank r of tp; C channels, H heads, V vocab padded up to Vp = tp*ceil(V/tp)):
    wte.weight, lm_head.weight   rows [r*Vp/tp, (r+1)*Vp/tp)          vocabulary-parallel
    attn.c_attn  (C, 3C)         the columns of heads [r*H/tp, (r+1)*H/tp) taken from EACH
                                 of q, k and v: [q_r | k_r | v_r]     column-parallel
    attn.c_proj  (C, C)          rows of the same heads               row-parallel
    mlp.c_fc     (C, 4C)         columns [r*4C/tp, (r+1)*4C/tp)      column-parallel
    mlp.c_proj   (4C, C)         the same rows                        row-parallel
Replicated on every tp rank: wpe, ln_1, ln_2, ln_f, and the biases of the row-parallel
layers (added once, after the sum). Activations between blocks (B, t, C) are replicated.

What is communicated, and when (all-reduces over the tp group, s bytes per element):
    Megatron's f: identity forward, all-reduce of the input gradient in backward
    Megatron's g: all-reduce forward, identity backward
    attention = f -> column(c_attn) -> heads -> row(c_proj) -> g;  MLP = f -> column(c_fc)
    -> GELU -> row(c_proj) -> g.  So per layer per micro-batch: 2 all-reduces of B*t*C
    elements forward (the g's) and 2 backward (the f's): Megatron's count.
    Once per micro-batch besides: the embedding's g (B*t*C, forward), the LM head's f
    (B*t*C, backward), and the vocabulary-parallel cross-entropy's three all-reduces of B*t
    elements (row max, target logit, sum of exp). Logits are never gathered.
    In all: 4L + 5 all-reduces, (4L + 2) B t C + 3 B t elements per micro-batch.

How many bytes: an all-reduce of n bytes on p ranks sends 2(p-1)/p * n per rank (ring or
direct exchange), or log2(p) * n with recursive doubling for messages up to 64 KiB
(docs/collectives.md); at tp = 2 both are n. traffic() below counts calls, elements and
bytes sent of this module's all-reduces, by kind (f, g, cross_entropy). With --precision
fp16/bf16 activations and their gradients are 2 bytes (s = 2); the cross-entropy's three
all-reduces of B*t stay fp32, as its arithmetic does.

Every all-reduce in minipar.comm gives bit-identical results on all ranks, so the
replicated activations, the loss and the gradients of the replicated parameters are
bit-identical across tp ranks by construction: f sits in front of every layer whose
output is split, so the gradient flowing into the replicated stream is always complete.
"""
from __future__ import annotations

import math

import numpy as np

from minipar import comm
from minipar.comm.ledger import human_bytes
from minipar.autograd import ops
from minipar.model.contract import Model, Parts, Whole
from minipar.model.gpt import FAMILY as GPT2_FAMILY
from minipar.model.gpt import GPTConfig, init_param, param_specs
from minipar.optim.adamw import clip_coef
from minipar.autograd.dtypes import compute, store
from minipar.autograd.tensor import Function, Tensor

# --- what tensor parallelism sent, by kind: its counts in the comm ledger (owner "tp") ----------

def traffic() -> dict:
    """{kind: {"calls", "elements", "bytes_sent"}} of tensor parallelism's collectives in this
    process (a copy of comm.counts("tp")). kind: f (in backward), g (in forward),
    cross_entropy (3 per loss), grad_norm (1 per grad_norm_sq)."""
    return comm.counts("tp")


def reset_traffic():
    comm.reset_counts("tp")


def tp_collective(kind: str, elements: int, run):
    """run() (one collective over the tp group), counted in the comm ledger under ("tp",
    `kind`) with `elements` and the bytes it sent: every message tensor parallelism (and
    sequence parallelism, sequence_parallel.py) sends goes through here."""
    with comm.window() as w:
        y = run()
    comm.count("tp", kind, calls=1, elements=elements, bytes_sent=w.sent)
    return y


def tp_all_reduce(group: comm.Group, x: np.ndarray, op: str, kind: str) -> np.ndarray:
    """comm.all_reduce over the tp group, counted under `kind` (traffic())."""
    if group.size == 1:                                   # no partner: nothing to send
        return x
    return tp_collective(kind, x.size, lambda: comm.all_reduce(group, x, op=op))


# --- Megatron's f and g ---------------------------------------------------------------------

class CopyToTP(Function):
    """Megatron's f: identity forward, all-reduce (sum) of the gradient in backward.
    Put in front of a column-parallel layer: each rank's x feeds only its columns, so each
    holds a partial dL/dx; the sum over ranks is the whole gradient."""

    def forward(self, x, group):
        self.group = group
        return x

    def backward(self, g):
        return tp_all_reduce(self.group, g, "sum", "f"), None


class ReduceFromTP(Function):
    """Megatron's g: all-reduce (sum) forward, identity backward. After a row-parallel
    layer: each rank holds a partial sum x_r @ W[rows_r, :]; every rank needs the total."""

    def forward(self, x, group):
        return tp_all_reduce(group, x, "sum", "g")

    def backward(self, g):
        return g, None


def copy_to_tp(x: Tensor, group: comm.Group) -> Tensor:
    return CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: comm.Group) -> Tensor:
    return ReduceFromTP.apply(x, group)


# --- column- and row-parallel linear layers -------------------------------------------------

class ColumnParallelLinear:
    """y_local = f(x) @ W[:, cols] + b[cols]: weight (Cin, Cout/tp), or the list of its column
    pieces (ops.linear), bias (Cout/tp,). Input replicated, output split by columns (no
    communication forward)."""

    def __init__(self, weight: Tensor, bias: Tensor, group: comm.Group):
        self.weight, self.bias, self.group = weight, bias, group

    def __call__(self, x: Tensor) -> Tensor:                  # (B, t, Cin) -> (B, t, Cout/tp)
        return ops.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear:
    """y = g(x_local @ W[rows, :]) + b: weight (Cin/tp, Cout), bias (Cout,) replicated and
    added after the all-reduce (adding it on every rank before would count it tp times), or
    None (Llama has no biases)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, group: comm.Group):
        self.weight, self.bias, self.group = weight, bias, group

    def __call__(self, x: Tensor) -> Tensor:                  # (B, t, Cin/tp) -> (B, t, Cout)
        y = reduce_from_tp(ops.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class SumGradOver(Function):
    """A parameter whose copies on several ranks each see part of its uses: identity forward
    (the same array: nothing copied or saved), backward all-reduces its gradient over `group`,
    counted under `kind`. Sequence parallelism's replicated parameters (sp_grads, over tp) and
    a key/value head held by several tp ranks (kv_grads, over the ranks that hold it)."""

    def forward(self, p, group, kind):
        self.group, self.kind = group, kind
        return p

    def backward(self, g):
        return tp_all_reduce(self.group, g, "sum", self.kind), None, None


# --- the vocabulary-parallel embedding, head and cross-entropy ------------------------------

class MaskedEmbedding(Function):
    """w_local[idx - start] for the ids this rank owns, zero rows for the others.
    idx (B, t) int, w (Vp/tp, C) -> (B, t, C). Backward scatters the owned rows only."""

    def forward(self, idx, w, start):
        local = idx - start
        own = (local >= 0) & (local < w.shape[0])                     # (B, t)
        local = np.where(own, local, 0)
        out = w[local]                                                # (B, t, C)
        out[~own] = 0.0
        self.save(local[own], own)
        self.w_shape = w.shape
        return out

    def backward(self, g):
        rows, own = self.saved
        g32 = compute(g)                                              # fp16/bf16: sum in fp32
        dw = np.zeros(self.w_shape, dtype=g32.dtype)
        np.add.at(dw, rows, g32[own])                                 # repeated ids sum up
        return None, store(dw, g.dtype), None


class VocabParallelEmbedding:
    """tok = g(masked lookup): exactly one rank contributes each row, the all-reduce sums it
    (Megatron's VocabParallelEmbedding)."""

    def __init__(self, weight: Tensor, vocab_start: int, group: comm.Group):
        self.weight, self.vocab_start, self.group = weight, vocab_start, group

    def __call__(self, idx) -> Tensor:                                # (B, t) -> (B, t, C)
        return reduce_from_tp(MaskedEmbedding.apply(idx, self.weight, self.vocab_start), self.group)


class MaskColumns(Function):
    """Logit columns >= n_valid (the vocabulary padding) set to -inf; their gradient is 0.
    Then softmax gives them probability exactly 0 and the loss is the unpadded model's."""

    def forward(self, logits, n_valid):
        self.n_valid = n_valid
        out = logits.copy()
        out[..., n_valid:] = -np.inf
        return out

    def backward(self, g):
        d = g.copy()
        d[..., self.n_valid:] = 0.0
        return d, None


def parallel_lm_logits(x: Tensor, w_local: Tensor, group: comm.Group, n_valid: int) -> Tensor:
    """(B, t, C) -> vocab-sharded logits (B, t, Vp/tp) = f(x) @ w_local.T: the head is a
    column-parallel layer over the vocabulary, so it needs f (its backward all-reduce)."""
    logits = ops.matmul(copy_to_tp(x, group), ops.transpose(w_local))    # (B, t, Vp/tp)
    return logits if n_valid == w_local.shape[0] else MaskColumns.apply(logits, n_valid)


class VocabParallelCrossEntropy(Function):
    """The sum over rows of -log softmax(logits)[target], divided by denom (as
    ops.cross_entropy), straight from vocab-sharded logits (N, Vp/tp), rank r holding the
    columns [start, start + Vp/tp). Three all-reduces of N numbers instead of gathering
    N*Vp: the row max (op max), the target logit (one rank owns it, the others add 0), and
    the sum of exp. Backward is local: (softmax_local - onehot_local) * g / denom.
    Padded vocabulary columns arrive as -inf (MaskColumns): exp gives them exactly 0.
    fp16/bf16 logits: computed (and the three all-reduces sent) in fp32; the loss is fp32."""

    def forward(self, logits, targets, group, start, denom=None):
        self.dtype, logits = logits.dtype, compute(logits)
        Vl = logits.shape[-1]
        z = logits.reshape(-1, Vl)                                    # (N, Vp/tp)
        t = targets.reshape(-1)                                       # (N,)
        n = t.shape[0]
        denom = float(n if denom is None else denom)
        m = tp_all_reduce(group, z.max(-1), "max", "cross_entropy")   # (N,) global row max
        e = np.exp(z - m[:, None])                                    # (N, Vp/tp); -inf -> 0
        local_t = t - start
        own = (local_t >= 0) & (local_t < Vl)                         # (N,) rows whose target is here
        rows = np.nonzero(own)[0]
        zt = np.zeros(n, dtype=z.dtype)
        zt[rows] = z[rows, local_t[rows]] - m[rows]
        zt = tp_all_reduce(group, zt, "sum", "cross_entropy")         # (N,) target logit - max
        s = tp_all_reduce(group, e.sum(-1), "sum", "cross_entropy")   # (N,) sum of exp
        loss = (np.log(s) - zt).sum() / denom
        e /= s[:, None]                                               # local softmax
        self.save(e, rows, local_t[rows])
        self.denom, self.shape = denom, logits.shape
        return np.asarray(loss, dtype=logits.dtype)

    def backward(self, g):
        p, rows, cols = self.saved
        d = p.copy()                                                  # (N, Vp/tp)
        d[rows, cols] -= 1.0
        d *= g * (1.0 / self.denom)
        return store(d.reshape(self.shape), self.dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, targets, group: comm.Group, vocab_start: int,
                                 denom=None) -> Tensor:
    return VocabParallelCrossEntropy.apply(logits, np.asarray(targets), group, vocab_start, denom)


# --- the layers of a tensor-parallel rank -----------------------------------------------------

def kv_share(cfg, tp: int) -> int:
    """Ranks that hold each key/value head: 1 when tp divides n_kv_head (each rank its own group
    of n_kv_head/tp heads); tp/n_kv_head when n_kv_head divides tp (each head copied on as many
    ranks, Megatron-LM's way when tp > query groups). Anything else: ValueError, one line."""
    H, Hkv = cfg.n_head, cfg.kv_heads
    if H % tp:
        raise ValueError(f"n_head {H} is not divisible by tp {tp}: tensor parallelism gives each rank "
                         f"n_head/tp whole heads")
    if cfg.hidden % tp:
        raise ValueError(f"the MLP's width {cfg.hidden} is not divisible by tp {tp}: each rank holds an equal "
                         f"share of its columns")
    if Hkv % tp == 0:
        return 1
    if tp % Hkv == 0:
        return tp // Hkv
    raise ValueError(f"n_kv_head {Hkv} and tp {tp}: tensor parallelism needs tp to divide n_kv_head (each "
                     f"rank its own key/value heads) or n_kv_head to divide tp (each head on tp/n_kv_head ranks)")


class TensorSplit(Whole):
    """Megatron's layers over the tp group, what a family's forward calls on a tp rank (the
    calls of model/contract.Whole): column- and row-parallel linears and the vocabulary-parallel
    embedding, each built from this module's classes the first time its parameter is used and
    kept (Megatron builds its layers once: state a layer keeps from its construction must stay
    right after an optimizer step), the vocabulary-parallel head and cross-entropy, and the head
    counts of this rank. kv_group: the tp ranks that hold this rank's key/value head when
    kv_share > 1, whose gradients are summed over it."""

    def __init__(self, group: comm.Group, vocab_start: int, vocab_valid: int, kv_group=None):
        self.group, self.vocab_start, self.vocab_valid, self.kv_group = group, vocab_start, vocab_valid, kv_group
        self.built = {}                     # (kind, parameter names) -> the layer

    def layer(self, kind: str, make, *tensors):
        """The layer of `kind` on these parameters (a weight may be a list of column pieces,
        Llama's [q | k | v]), made once by make(). A tensor made in the forward (no name: a
        key/value shard whose gradient is summed, kv) gets a layer at each call."""
        tensors = [t for x in tensors for t in (x if isinstance(x, (list, tuple)) else [x])]
        if any(t is not None and t.name is None for t in tensors):
            return make()
        key = (kind, *(None if t is None else t.name for t in tensors))
        if key not in self.built:
            self.built[key] = make()
        return self.built[key]

    def column(self, x, w, b=None):
        return self.layer("column", lambda: ColumnParallelLinear(w, b, self.group), w, b)(x)

    def row(self, x, w, b=None):
        return self.layer("row", lambda: RowParallelLinear(w, b, self.group), w, b)(x)

    def kv(self, p):
        return p if self.kv_group is None else SumGradOver.apply(p, self.kv_group, "kv_grads")

    def heads(self, n: int) -> int:
        return n // self.group.size

    def kv_heads(self, cfg) -> int:
        return max(1, cfg.kv_heads // self.group.size)

    def tokens(self, idx, w):
        return self.layer("tokens", lambda: VocabParallelEmbedding(w, self.vocab_start, self.group), w)(idx)

    def logits(self, x, w):
        """-> vocab-sharded logits (B, t, Vp/tp); padded columns are -inf."""
        return parallel_lm_logits(x, w, self.group, self.vocab_valid)

    def loss(self, logits, targets, denom=None):
        return vocab_parallel_cross_entropy(logits, targets, self.group, self.vocab_start, denom)


# --- the model --------------------------------------------------------------------------------

def layout_of(name: str, cfg=None) -> str:
    """How canonical parameter `name` of cfg's family (default GPT-2) is split: vocab, qkv,
    column, kv, row or replicated (Family.split_kind)."""
    return (cfg.family if cfg is not None else GPT2_FAMILY).split_kind(name)


class TensorParallelGPT(Model):
    """Either family (model.GPT's maths and canonical names) with every layer split across the
    tp group. Parameters are leaf Tensors holding this rank's shard, under canonical names;
    the forward is the family's, on TensorSplit's layers (SequenceSplit's with --sp)."""

    split_class = TensorSplit

    def __init__(self, cfg: GPTConfig, tp_group: comm.Group, seed: int = 0, dtype=np.float64,
                 parts: Parts = Parts()):
        self.cfg, self.parts = cfg.validate(), parts
        dtype = np.dtype(dtype)
        self.group, self.tp_size, self.tp_rank = tp_group, tp_group.size, tp_group.rank
        tp = self.tp_size
        self.kv_share = kv_share(cfg, tp)
        V = cfg.vocab_size
        self.vocab_padded = -(-V // tp) * tp                          # Vp
        self.vocab_per_rank = self.vocab_padded // tp                 # Vp/tp
        self.vocab_start = self.tp_rank * self.vocab_per_rank
        self.vocab_valid = min(max(V - self.vocab_start, 0), self.vocab_per_rank)   # real rows here
        kv_group = None
        if self.kv_share > 1:                                         # the ranks holding my KV head
            kv_group = comm.Group(tp_group.comm.Split(self.tp_rank // self.kv_share, self.tp_rank), axis="tp")
        self.split = self.split_class(tp_group, self.vocab_start, self.vocab_valid, kv_group)
        self.full_shapes = {name: tuple(shape) for name, shape, _ in param_specs(cfg)}
        # each rank draws the full tensor from its own generator and keeps its slice
        self.params = {
            name: Tensor(self.shard(name, init_param(name, shape, init, seed, dtype)),
                         requires_grad=True, name=name)
            for name, shape, init in param_specs(cfg) if parts.holds(name)
        }

    # --- where each slice lives -------------------------------------------------------------
    def is_replicated(self, name: str) -> bool:
        return layout_of(name, self.cfg) == "replicated"

    def is_copy(self, name: str) -> bool:
        """Does another tp rank hold the same values (a replicated tensor, a shared KV head)?"""
        kind = layout_of(name, self.cfg)
        return kind == "replicated" or (kind == "kv" and self.kv_share > 1)

    def shard(self, name: str, full: np.ndarray, rank: int | None = None) -> np.ndarray:
        """The slice of canonical tensor `name` that tp rank `rank` (default: this one) holds."""
        if name not in self.full_shapes:
            raise ValueError(f"{name!r} is not a parameter of this model")
        if self.full_shapes[name] != tuple(np.shape(full)):
            raise ValueError(f"{name}: shape {np.shape(full)} is not the canonical {self.full_shapes[name]}")
        r, tp, kind = self.tp_rank if rank is None else rank, self.tp_size, layout_of(name, self.cfg)
        full = np.asarray(full)
        if kind == "replicated":
            return full.copy()
        if kind == "vocab":                                           # (V, C) -> (Vp/tp, C)
            pad = np.zeros((self.vocab_padded, full.shape[1]), dtype=full.dtype)
            pad[:full.shape[0]] = full
            n = self.vocab_per_rank
            return pad[r * n:(r + 1) * n].copy()
        if kind == "row":                                             # (Cin, C) -> (Cin/tp, C)
            n = full.shape[0] // tp
            return full[r * n:(r + 1) * n].copy()
        if kind == "column":                                          # (..., F) -> (..., F/tp)
            n = full.shape[-1] // tp
            return full[..., r * n:(r + 1) * n].copy()
        if kind == "kv":                                              # (C, Hkv hs): my heads, or my shared one
            n = full.shape[-1] // (tp // self.kv_share)
            j = r // self.kv_share
            return full[..., j * n:(j + 1) * n].copy()
        # qkv: (..., 3C) = [q | k | v] -> (..., 3, tp, C/tp): take head group r of each
        C = full.shape[-1] // 3
        parts = full.reshape(*full.shape[:-1], 3, tp, C // tp)
        return np.ascontiguousarray(parts[..., r, :]).reshape(*full.shape[:-1], 3 * C // tp)

    def unshard(self, name: str, shards) -> np.ndarray:
        """The full canonical tensor from every tp rank's shard (in tp-rank order)."""
        kind = layout_of(name, self.cfg)
        if len(shards) != self.tp_size:
            raise ValueError(f"{name}: {len(shards)} shards for tp {self.tp_size}")
        if kind == "replicated":
            return np.array(shards[0], copy=True)
        if kind == "vocab":
            return np.concatenate(shards, axis=0)[:self.cfg.vocab_size]      # drop the padding
        if kind == "row":
            return np.concatenate(shards, axis=0)
        if kind == "column":
            return np.concatenate(shards, axis=-1)
        if kind == "kv":                                              # one copy of each head group
            return np.concatenate(shards[::self.kv_share], axis=-1)
        lead = shards[0].shape[:-1]                                   # qkv: undo shard()
        parts = np.stack([s.reshape(*lead, 3, -1) for s in shards], axis=-2)   # (..., 3, tp, C/tp)
        return parts.reshape(*lead, -1)

    # --- the Python API of docs/design.md §4, on shards (interfaces.Model) ------------------
    # named_parameters, parameters, num_params (the full canonical count), num_local_params
    # (elements this rank holds: (P - replicated)/tp + replicated, plus vocab padding),
    # zero_grad, load_state_dict (each tensor's shard()) and grad_norm_sq come from Model.

    def consolidate(self, local: dict) -> dict:
        """{name: local array} -> {name: full canonical array}, for parameters or any state
        shaped like them (Adam's m and v). Collective over the tp group: one all_gather
        per split tensor, in name order, on every rank; the result is identical on all."""
        out = {}
        for name in [n for n, _, _ in param_specs(self.cfg) if n in local]:    # (--ep: all experts)
            a = np.ascontiguousarray(local[name])
            if self.is_replicated(name) or self.tp_size == 1:
                out[name] = self.unshard(name, [a] * self.tp_size)
                continue
            flat = comm.all_gather(self.group, a)                     # (tp * a.size,)
            out[name] = self.unshard(name, list(flat.reshape(self.tp_size, *a.shape)))
        return out

    def counts_in_norm(self, name: str) -> bool:
        """Split parameters count on every rank (its slice), copies on the first rank that
        holds them (replicated: tp rank 0; a shared KV head: the first of its kv_share ranks)."""
        if layout_of(name, self.cfg) == "kv":
            return self.tp_rank % self.kv_share == 0
        return self.tp_rank == 0 or not self.is_replicated(name)

    def reduce_norm_sq(self, local: float) -> float:
        """One all-reduce over tp of each rank's counted sum of squares."""
        return float(tp_all_reduce(self.group, np.array([local]), "sum", "grad_norm")[0])


def clip_grad_norm(model: TensorParallelGPT, max_norm: float) -> float:
    """optim.clip_grad_norm for a tensor-parallel model: the global norm from
    grad_norm_sq() (each parameter once), the same clip factor on every rank. Returns the
    norm before clipping; max_norm 0 only measures."""
    total = math.sqrt(model.grad_norm_sq())
    c = clip_coef(total, max_norm)
    if c < 1.0:
        for p in model.parameters():
            if p.grad is not None:
                p.grad *= c
    return total


# --- the formulas: what a rank holds, what it sends (the planner and the summary use them) ----

def local_size(name: str, shape, tp: int, cfg=None) -> int:
    """Elements of canonical tensor `name` (of canonical `shape`, of cfg's family: default
    GPT-2) on one tp rank, as shard() cuts it: a vocabulary tensor Vp/tp = ceil(V/tp) rows of
    C, a split one 1/tp of it, a replicated one (wpe, the norms, row-parallel biases) whole, a
    key/value projection 1/min(tp, n_kv_head) of it (tp > n_kv_head: one head's columns)."""
    kind = layout_of(name, cfg)
    if kind == "vocab":
        return -(-shape[0] // tp) * shape[1]                     # (Vp/tp, C)
    n = math.prod(shape)
    if kind == "kv":
        return n // min(tp, cfg.kv_heads)
    return n if kind == "replicated" else n // tp


def local_param_count(cfg: GPTConfig, tp: int) -> int:
    """Parameters one tp rank holds, by formula (what num_local_params() must measure):
    (P - replicated)/tp + replicated, with the vocabulary tensors padded to Vp rows first;
    the sum of local_size over the canonical tensors."""
    return sum(local_size(name, shape, tp, cfg) for name, shape, _ in param_specs(cfg))


def megatron_calls(n_layers: int, first: bool = True, last: bool = True,
                   recompute: str = "none") -> tuple[int, int]:
    """Megatron's all-reduces of one micro-batch, forward and backward, on a tp rank holding
    `n_layers` blocks, the embedding if `first` and the head if `last` (a pipeline stage;
    the whole model by default), as (calls on a (rows, t, C) activation or its gradient,
    calls on rows*t numbers): 4 per block (attention's and the MLP's f and g), the
    embedding's g, the head's f; the vocabulary-parallel cross-entropy's 3. With full
    recomputation each block's forward, and so its two g's, runs again in backward."""
    again = 2 * n_layers if recompute == "full" else 0
    return 4 * n_layers + again + (1 if first else 0) + (1 if last else 0), 3 if last else 0


def kv_grad_count(cfg: GPTConfig, tp: int, n_layers: int | None = None) -> tuple[int, int]:
    """(all-reduces, elements) of the shared key/value heads' gradient sums of one micro-batch
    (kind kv_grads): when tp > n_kv_head, per block one for k_proj and one for v_proj, each of
    its (C, hs) copy, over the tp/n_kv_head ranks holding it; none otherwise."""
    if tp <= 1 or kv_share(cfg, tp) == 1:
        return 0, 0
    L = cfg.n_layer if n_layers is None else n_layers
    return 2 * L, 2 * L * cfg.n_embd * cfg.head_size


def megatron_count(cfg: GPTConfig, rows: int, t: int, n_layers: int | None = None,
                   first: bool = True, last: bool = True, recompute: str = "none", tp: int = 1,
                   moe_blocks: int | None = None) -> tuple[int, int]:
    """(all-reduces, elements) of one micro-batch of `rows` sequences of t tokens: for the
    whole model 4L + 5 calls and (4L + 2) * rows * t * C + 3 * rows * t elements (module
    docstring); for a pipeline stage, its n_layers blocks and ends (megatron_calls); with
    key/value heads shared by tp ranks, their gradient sums (kv_grad_count) besides. A MoE
    block (moe_blocks of them; default: the whole model's) has attention's f and g only: its
    experts are replicated over tp, so its MLP sends nothing."""
    L = cfg.n_layer if n_layers is None else n_layers
    n_moe = cfg.moe_layers if moe_blocks is None else moe_blocks
    act, per_row = megatron_calls(L - n_moe, first, last, recompute)
    act += megatron_calls(n_moe, False, False, recompute)[0] // 2
    kv_calls, kv_elems = kv_grad_count(cfg, tp, L)
    return act + per_row + kv_calls, act * rows * t * cfg.n_embd + per_row * rows * t + kv_elems


# --- the summary's tensor-parallel figures ----------------------------------------------------

def measured(tp_ledger: dict, rows_log: list) -> tuple[dict, float, float, float]:
    """What a run's tp collectives did per step: (traffic()'s kinds but grad_norm, calls and
    elements per step of those, the rows' mean tp_bytes). tp_ledger: traffic() after the
    training steps."""
    steps_run = len(rows_log)
    tp_bytes = float(np.mean([r["tp_bytes"] for r in rows_log]))
    kinds = {k: v for k, v in tp_ledger.items() if k != "grad_norm"}
    calls = sum(v["calls"] for v in kinds.values()) / steps_run
    elements = sum(v["elements"] for v in kinds.values()) / steps_run
    return kinds, calls, elements, tp_bytes


def summary(tp_ledger: dict, rows_log: list, cfg: GPTConfig, *, tp: int, rows: int, micro_batches: int,
            layers: int, pp_rank: int, pp: int, recompute: str, cp: int = 1,
            moe_blocks: int = 0) -> tuple[dict, list[str]]:
    """What tensor parallelism sent on this rank, per step, beside the formula: Megatron's
    4L + 5 all-reduces (megatron_count), of this rank's pipeline stage (`layers` blocks, the
    ends it holds), and the shared key/value heads' sums. rows: sequences per micro-batch of
    this dp rank, of T/cp tokens each with --cp. (--sp: sequence_parallel.summary.)"""
    M, T = micro_batches, cfg.block_size // cp
    _, calls, elements, tp_bytes = measured(tp_ledger, rows_log)
    out = {"tp": tp, "sequence_parallel": False, "all_reduces_per_step": calls,
           "elements_per_step": elements, "bytes_per_step": tp_bytes}
    want_calls, want_elems = megatron_count(cfg, rows, T, layers, pp_rank == 0, pp_rank == pp - 1, recompute, tp,
                                            moe_blocks)
    out.update(megatron_all_reduces_per_step=want_calls * M, megatron_elements_per_step=want_elems * M)
    return out, [f"  tensor parallel: {calls:.0f} all-reduces/step of {elements:,.0f} elements (Megatron: "
                 f"{'(4L+5)' if pp == 1 else 'stage ' + str(pp_rank) + ', 4 x its layers + ends'}"
                 f"{' + 2L again (full recompute)' if recompute == 'full' else ''}"
                 f"{' + 2L key/value head sums' if kv_grad_count(cfg, tp)[0] else ''}"
                 f"{f', MoE blocks 2 (their experts replicated)' if moe_blocks else ''} x {M} "
                 f"micro-batch(es) = {want_calls * M}, {want_elems * M:,} elements), "
                 f"{human_bytes(tp_bytes)}/step sent per rank, + 1 for the global grad norm"]
