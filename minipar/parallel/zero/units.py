"""ZeRO's layout: the units a rank's parameters are cut into, and its shard of each.

The layout. A rank's parameters (its tp slice, its pp stage) are cut into units
(`unit_names`): the token embedding alone, one unit per transformer block, and the rest. Each unit
is flattened in model order into n elements, padded with zeros to n_pad = ceil(n/N)*N, and
dp rank r owns elements [r*n_pad/N, (r+1)*n_pad/N) of it: its shard, the piece r of
np.array_split that comm.reduce_scatter hands it. The optimizer state (fp32 master weights
with --precision fp16/bf16, Adam's m and v) exists only for the owned shard. (PyTorch FSDP
shards each of its flat parameters the same way, unit by unit.)
"""
from __future__ import annotations

import numpy as np

from minipar.model.gpt import FAMILY as GPT2


def unit_names(names, family=None) -> list[list[str]]:
    """Cut a rank's parameters (canonical names of `family`, default GPT-2's, model order) into the units ZeRO
    flattens, shards and (stage 3) gathers together: the token embedding alone (a tied copy
    on the last pipeline stage must shard exactly like stage 0's), one unit per transformer
    block, and one for the rest (wpe, the final norm, lm_head). Empty units are dropped."""
    family = family or GPT2
    wte, blocks, rest = [], {}, []
    for n in names:
        i = family.block_of(n)
        if n == family.embedding:
            wte.append(n)
        elif i is not None:
            blocks.setdefault(i, []).append(n)
        else:
            rest.append(n)
    return [u for u in [wte, *blocks.values(), rest] if u]


def padded(n: int, N: int) -> int:
    """A unit of n elements padded so that N ranks get equal shards: ceil(n / N) * N."""
    return -(-n // N) * N


class Unit:
    """One flat, padded group of parameters and this rank's shard of it: the buffers a stage
    keeps (stage1.py, stage2.py, stage3.py) and the optimizer state of the shard."""

    def __init__(self, names, params, N: int, rank: int, group=None, *, m, v, master=None, grad_dtype=None,
                 params_sharded: bool = False, grads_sharded: bool = False, replicas=None):
        """N, rank, group: the shard group (all the unit's ranks in flat ZeRO); replicas: with
        hybrid sharding (hybrid.py) the group of the ranks that hold the same shard, else None.
        The unit is padded to a multiple of N x R, so that its shards (n_pad/N) cut into R
        equal pieces too. m, v, master: the full optimizer's per-parameter arrays (master None without mixed
        precision), of which the unit keeps its shard. params_sharded: keep only the shard of
        the parameters (stage 3), else the full flat buffer the parameters view; grads_sharded:
        keep a gradient shard (stages 2, 3), else a full flat gradient buffer (stage 1), both
        in grad_dtype (the storage dtype)."""
        self.names, self.params = names, params
        self.group, self.N = group, N           # the ranks its shards are spread over ("zero" axis)
        self.replicas = replicas                # hybrid: the R ranks holding the same shard, else None
        self.R = 1 if replicas is None else replicas.size
        self.sizes = [p.size for p in params]
        self.offsets = np.cumsum([0] + self.sizes)[:-1].tolist()
        self.n = sum(self.sizes)
        self.n_pad = padded(self.n, N * self.R)
        self.shard_size = self.n_pad // N
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size
        self.dtype = params[0].data.dtype
        # the owned range cut at parameter boundaries: (param, slice of the shard,
        # slice of the parameter's flat data)
        self.segments = []
        for p, off, size in zip(params, self.offsets, self.sizes):
            a, b = max(off, self.lo), min(off + size, self.hi)
            if a < b:
                self.segments.append((p, slice(a - self.lo, b - self.lo), slice(a - off, b - off)))
        self.pending = len(params)
        self.received = 0           # reduce-scatters finished this step
        self.handle = None          # the reduce-scatter in flight
        self.replica_handle = None  # hybrid: the shard's all-reduce across the replicas in flight
        own = slice(self.lo, self.hi)
        self.m = self.flatten(m)[own].copy()                            # (shard,) optimizer state
        self.v = self.flatten(v)[own].copy()
        self.master = None if master is None else self.flatten(master)[own].copy()
        flat = self.flatten([p.data for p in params])                   # (n_pad,) storage dtype
        self.param_flat = None if params_sharded else flat              # stages 1, 2: (n_pad,), p.data its views
        self.param_shard = flat[own].copy() if params_sharded else None  # stage 3: (shard,)
        self.param_gathered = None  # stage 3: the gathered parameters, between gather and release
        # stage 1: (n_pad,), p.grad its views, kept over the micro-batches
        self.grad_full = None if grads_sharded else np.zeros(self.n_pad, dtype=grad_dtype)
        self.grad_staging = None    # stages 2, 3: this micro-batch's full gradient, while ready-ing
        # stages 2, 3: (shard,), the sum of the micro-batches' pieces; stage 1: a view of grad_full
        self.grad_shard = np.zeros(self.shard_size, dtype=grad_dtype) if grads_sharded else None

    def flatten(self, arrays) -> np.ndarray:
        """The unit's (n_pad,) flat copy of per-parameter arrays (zeros in the padding)."""
        flat = np.zeros(self.n_pad, dtype=arrays[0].dtype)
        for a, off, size in zip(arrays, self.offsets, self.sizes):
            flat[off:off + size] = a.reshape(-1)
        return flat

    def point(self, flat):
        """Make every parameter's data a view of flat (n_pad,)."""
        for p, off, size in zip(self.params, self.offsets, self.sizes):
            p.data = flat[off:off + size].reshape(p.shape)

    def unflatten(self, flat) -> list:
        """Per-parameter views of flat (n_pad,), in the parameters' shapes."""
        return [flat[off:off + size].reshape(p.shape) for p, off, size in zip(self.params, self.offsets, self.sizes)]


def _placeholder(shape, dtype) -> np.ndarray:
    """A released parameter: the right shape and dtype, no memory, NaN if read."""
    return np.broadcast_to(np.array(np.nan, dtype=dtype), shape)
