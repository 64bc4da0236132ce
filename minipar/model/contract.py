"""The model's contract the trainer relies on (docs/design.md §4), and the parts a layout gives a model.

Parts       what a layout plugs into the model's forward, fixed when the model is built:
            attention, positions, how a block runs, the MoE settings, which parameters it holds
            (minipar/parallel/parallelize.py builds them; the defaults are one process's).

Model       what every layout of the GPT offers: the single-process model.GPT, its
            tensor-parallel shards (parallel/tensor/tensor_parallel.TensorParallelGPT) and one
            pipeline stage of either (parallel/pipeline/stage.PipelineStage). The base class holds
            the whole-model behaviour; a sharded model overrides the four sharding hooks:
                shard(name, full)      the canonical tensor -> this rank's slice of it
                consolidate(local)     this rank's slices -> the canonical tensors (collective)
                counts_in_norm(name)   does this rank count `name` in the global gradient norm?
                reduce_norm_sq(local)  this rank's counted sum of squares -> the whole model's
            and everything else (parameters, state_dict/load_state_dict, grad_norm_sq) follows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np

from minipar.model import moe
from minipar.autograd import ops
from minipar import trace
from minipar.optim.adamw import sum_of_squares


def whole_attention(qkv, n_head: int, n_kv_head: int | None = None):
    """Causal self-attention of the packed qkv (B, t, (H + 2 Hkv) hs) on this rank's whole sequence."""
    return ops.causal_self_attention(qkv, n_head, n_kv_head=n_kv_head)


def recomputed_attention(qkv, n_head: int, n_kv_head: int | None = None):
    """whole_attention keeping q, k and v only: the softmax made again in backward (--recompute selective)."""
    return ops.causal_self_attention(qkv, n_head, recompute=True, n_kv_head=n_kv_head)


def whole_positions(t: int, block_size: int) -> np.ndarray:
    """The positions of a sequence's t tokens when a rank holds all of them: 0..t-1."""
    if t > block_size:
        raise ValueError(f"sequence length {t} > block_size {block_size}")
    return np.arange(t)


def plain_block(block, i: int, x):
    """block(i, x) in a trace span of its own (trace.layer)."""
    with trace.layer(f"h.{i}"):
        return block(i, x)


def every_parameter(name: str) -> bool:
    return True


class Resident:
    """Parts.gathers when every parameter a rank holds stays in memory: each piece of the
    forward runs as it is. (ZeRO-3's gathers, minipar/parallel/zero/stage3.py, all-gather a
    piece's parameters before it and release them after.)"""

    def embed(self, run, idx):
        return run(idx)

    def block(self, run, i: int, x):
        return run(i, x)

    def head(self, run, x):
        return run(x)


class Whole:
    """The layers of one process, every one whole: what a model's family calls to compute its
    forward (model/family.py). Tensor and sequence parallelism give a model theirs instead
    (parallel/tensor/): the same calls, each rank's shard and the messages between them.

        column(x, w, b)     x @ w + b, a layer whose outputs tensor parallelism splits
        row(x, w, b)        x @ w + b, a layer whose inputs it splits (it sums the parts)
        replicated(p)       a parameter every rank holds whole, as used
        kv(p)               a key or value projection, as used (tp > n_kv_head: a shared copy)
        heads(n)            of n heads, those this rank computes
        kv_heads(cfg)       of the key/value heads, those this rank computes
        check_ids(idx, cfg) the token ids, checked
        tokens(idx, w)      the token embedding's rows
        positions(w, pos)   the position embedding's rows of positions pos (GPT-2)
        logits(x, w)        x @ w.T, the head
        loss(z, t, denom)   the cross-entropy of the logits z"""

    def column(self, x, w, b=None):
        return ops.linear(x, w, b)

    row = column

    def replicated(self, p):
        return p

    kv = replicated

    def heads(self, n: int) -> int:
        return n

    def kv_heads(self, cfg) -> int:
        return cfg.kv_heads

    def check_ids(self, idx, cfg) -> np.ndarray:
        idx = np.asarray(idx)
        if idx.shape[-1] > cfg.block_size:
            raise ValueError(f"sequence length {idx.shape[-1]} > block_size {cfg.block_size}")
        if idx.size and (idx.min() < 0 or idx.max() >= cfg.vocab_size):
            raise ValueError(f"token ids must be in [0, {cfg.vocab_size}), got [{idx.min()}, {idx.max()}]")
        return idx

    def tokens(self, idx, w):
        return ops.embedding(idx, w)                                  # (B, t, C)

    def positions(self, w, pos):
        return ops.embedding(pos[None, :], w)                         # (1, t, C)

    def logits(self, x, w):
        return ops.matmul(x, ops.transpose(w))                        # (B, t, V)

    def loss(self, logits, targets, denom=None):
        return ops.cross_entropy(logits, targets, denom)


@dataclass(frozen=True)
class Parts:
    """What a layout plugs into the model's forward: given to the model when it is built and
    never changed. The defaults are one process's; minipar/parallel/parallelize.py builds
    the others (ring attention, recomputation, expert placement, a pipeline stage's share).

        attention(qkv, n_head, n_kv_head)
                                    causal self-attention of the packed projection
                                    (B, t, (H' + 2 Hkv') hs) of this rank's heads
        positions(t, block_size)    the global positions of the t tokens of a sequence this rank holds
        run_block(block, i, x)      block(i, x) as the forward runs it: traced, maybe recomputed
        moe                         the MoE blocks' routing settings (moe.MoESettings), or None:
                                    the config's, no capacity limit, no auxiliary loss
        holds(name)                 does this rank hold canonical parameter `name`?
        gathers                     what runs around each piece (embed, block i, head) to have
                                    its parameters there: nothing (Resident), or ZeRO-3's gathers"""
    attention: Callable = whole_attention
    positions: Callable = whole_positions
    run_block: Callable = plain_block
    moe: object = None
    holds: Callable = every_parameter
    gathers: object = Resident()


class Model:
    """Base class of every model layout. A subclass sets, in its constructor:
        cfg          the model.GPTConfig of the whole model
        parts        the Parts its layout plugs into the forward
        params       {canonical name: Tensor} of the parameters this rank holds, model order
        full_shapes  {canonical name: shape} of every parameter of the whole model
    and, if its layers are not one process's, `split` (Whole's calls). The forward pieces
    embed(idx), block(i, x) and head(x) are the family's (model/family.py) on those layers."""

    cfg: object
    parts: Parts = Parts()
    params: dict
    full_shapes: dict
    tp_size: int = 1          # tensor-parallel ranks the model is split over
    tp_rank: int = 0          # and this rank's place among them
    split = Whole()           # the layers the family's forward calls (tensor parallelism: its own)

    @property
    def family(self):
        """The model family's description (model/family.py): names and the forward."""
        return self.cfg.family

    @property
    def dtype(self) -> np.dtype:
        """The parameters' storage dtype (2 bytes once a mixed-precision optimizer holds the
        fp32 master weights)."""
        return next(iter(self.params.values())).data.dtype

    @property
    def layers(self):
        """The blocks this rank runs: every one (a pipeline stage: its own)."""
        return range(self.cfg.n_layer)

    @property
    def moe(self):
        """The MoE blocks' routing settings (Parts.moe), or None."""
        return self.parts.moe

    # --- forward -----------------------------------------------------------------------------
    def __call__(self, idx, targets=None, loss_denom=None):
        """Logits (B, t, V) without targets (a tensor-parallel layout: its vocabulary shard);
        with targets, the scalar loss: the sum of per-position cross-entropies divided by
        loss_denom (default: B*t, the mean), the same on every rank of the layout."""
        if self.cfg.moe_experts:                                        # Mixtral's pool: this forward's
            (self.moe or self.default_moe).new_forward()
        with trace.layer("embed"):                                      # --trace: a span each
            x = self.run_embed(idx)
        for i in range(self.cfg.n_layer):
            x = self.run_block(i, x)
        with trace.layer("head"):
            logits = self.run_head(x)
            return logits if targets is None else self.loss(logits, targets, loss_denom)

    forward = __call__

    def embed(self, idx):
        return self.family.embed(self, idx)

    def block(self, i: int, x):
        return self.family.block(self, i, x)

    def head(self, x):
        return self.family.final(self, x)

    def loss(self, logits, targets, loss_denom=None):
        """The cross-entropy of the logits (the layout's: maybe from vocabulary shards)."""
        targets = np.asarray(targets)
        if targets.size and (targets.min() < 0 or targets.max() >= self.cfg.vocab_size):
            raise ValueError(f"targets must be in [0, {self.cfg.vocab_size}), got "
                             f"[{targets.min()}, {targets.max()}]")
        return self.split.loss(logits, targets, loss_denom)

    def run_embed(self, idx):
        """The embedding, its parameters there (Parts.gathers)."""
        return self.parts.gathers.embed(self.embed, idx)

    def run_block(self, i: int, x):
        """Block i on x, as the layout runs it (Parts.run_block: traced, maybe recomputed),
        its parameters there (Parts.gathers, inside any recomputation)."""
        return self.parts.run_block(self.gathered_block, i, x)

    def gathered_block(self, i: int, x):
        return self.parts.gathers.block(self.block, i, x)

    def run_head(self, x):
        """The head, its parameters there (Parts.gathers)."""
        return self.parts.gathers.head(self.head, x)

    def position_ids(self, t: int) -> np.ndarray:
        """The global positions of the t tokens of each sequence this rank holds (Parts.positions)."""
        return self.parts.positions(t, self.cfg.block_size)

    def attend(self, qkv, n_head: int, n_kv_head: int | None = None):
        """Causal self-attention of the packed qkv (B, t, (H' + 2 Hkv') hs) (Parts.attention)."""
        return self.parts.attention(qkv, n_head, n_kv_head)

    def moe_layer(self, i: int, x):
        """Block i's mixture of experts on x (B, t, C) (moe.py)."""
        return moe.moe_mlp(self.params, i, x, self.moe or self.default_moe, self.family)

    @cached_property
    def default_moe(self):
        """The config's routing settings (no capacity limit unless configured, no auxiliary loss):
        a model built without Parts.moe."""
        return moe.settings_of(self.cfg)

    # --- parameters -------------------------------------------------------------------------
    def named_parameters(self) -> list:
        return list(self.params.items())

    def parameters(self) -> list:
        return list(self.params.values())

    def num_params(self) -> int:
        """The whole model's canonical count, on every layout."""
        return sum(math.prod(shape) for shape in self.full_shapes.values())

    def num_local_params(self) -> int:
        """Elements this rank holds (tensor parallelism's vocabulary padding included)."""
        return sum(p.size for p in self.params.values())

    def zero_grad(self):
        for p in self.params.values():
            p.grad = None

    # --- the sharding hooks: a whole model holds every tensor whole -------------------------
    def shard(self, name: str, full: np.ndarray) -> np.ndarray:
        """This rank's slice of canonical tensor `name` (here: all of it)."""
        return full

    def consolidate(self, local: dict) -> dict:
        """{name: this rank's array} -> {name: full canonical array}, for the parameters or
        anything shaped like them (Adam's m and v). Collective on sharded layouts."""
        return {n: np.array(a, copy=True) for n, a in local.items()}

    def counts_in_norm(self, name: str) -> bool:
        """Does this rank count `name` in the global gradient norm? (A sharded layout skips
        the copies that another rank counts.)"""
        return True

    def reduce_norm_sq(self, local: float) -> float:
        """The whole model's sum of squares from this rank's counted part (here: itself)."""
        return local

    # --- what follows from them -------------------------------------------------------------
    def state_dict(self) -> dict:
        """{canonical name: full ndarray} (collective on sharded layouts)."""
        return self.consolidate({n: p.data for n, p in self.params.items()})

    def load_state_dict(self, state: dict):
        """Load this rank's slices from a full canonical state: every name, no other, each of
        its canonical shape (all checked before anything changes)."""
        placement = None if self.moe is None else self.moe.placement     # --ep: other ranks' experts are not here
        missing = sorted(set(self.params) - set(state))
        extra = sorted(n for n in set(state) - set(self.params) if placement is None or placement.owns(n))
        if missing or extra:
            raise ValueError(f"state_dict mismatch: missing {missing[:4]}, unexpected {extra[:4]}")
        self.check_shapes(state, self.params)
        for n, p in self.params.items():
            p.data[...] = self.shard(n, state[n])

    def check_shapes(self, state: dict, names):
        for n in names:
            if tuple(state[n].shape) != tuple(self.full_shapes[n]):
                raise ValueError(f"{n}: checkpoint shape {tuple(state[n].shape)} != model shape "
                                 f"{tuple(self.full_shapes[n])}")

    def grad_norm_sq(self) -> float:
        """Sum of squared gradient entries of the whole model, each parameter counted once
        (counts_in_norm), the same on every rank that holds part of it."""
        return self.reduce_norm_sq(sum(sum_of_squares(p.grad) for name, p in self.params.items()
                                       if p.grad is not None and self.counts_in_norm(name)))

    def evaluate(self, idx, targets) -> float:
        """The mean loss of (idx, targets), no graph kept (the caller holds no_grad)."""
        return self(idx, targets).item()
