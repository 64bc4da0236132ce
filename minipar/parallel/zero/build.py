"""ZeRO's one constructor: the stage's gradient synchroniser and the sharded optimizer,
built together over the same units.

Everything here is composable with --tp (each tp rank shards its own slices over its dp
group), --precision (2-byte parameters and gradients travel as 2 bytes; the fp32 master
weights are sharded with m and v), --micro-batches, and --pp for stages 1 and 2 (stage 3
would gather and release every stage's parameters around each of the M micro-batches'
forwards and backwards, interleaved by the schedule; DeepSpeed does not combine them
either, and minipar refuses it).
"""
from __future__ import annotations

import numpy as np

from minipar import comm
from minipar.optim.mixed_precision import MixedPrecisionAdamW
from minipar.parallel.zero import hybrid
from minipar.parallel.zero.optimizer import ShardedAdamW
from minipar.parallel.zero.stage1 import Stage1
from minipar.parallel.zero.stage2 import Stage2
from minipar.parallel.zero.stage3 import Stage3
from minipar.parallel.zero.units import Unit, unit_names

STAGES = {1: Stage1, 2: Stage2, 3: Stage3}


def build(model, opt, group: comm.Group, stage: int, expert_group: comm.Group | None = None,
          is_expert=None, blocks: dict | None = None, **gathers) -> tuple[Stage1, ShardedAdamW]:
    """ZeRO `stage` over the dp group: (the gradient synchroniser, the sharded optimizer).
    Built from a model and its plain optimizer (AdamW or MixedPrecisionAdamW) after any
    checkpoint has been loaded into them: each rank keeps its shard of their state and the
    full optimizer's is dropped. The messages go on the dp group's ranks, counted in the
    ledger under the axis "zero".

    expert_group, is_expert(name): with expert parallelism, each block's expert parameters
    form units of their own, sharded over expert_group (an expert's dp/ep replicas) instead
    of the whole dp group (docs/moe.md).

    blocks: hybrid sharding (hybrid.py), {world rank: shard block} over the group; each unit
    group is split into its ranks of this rank's block (the shards) and the ranks in the same
    place of the other blocks (the replicas). None: flat ZeRO. gathers: stage 3's prefetch
    and reshard_after_forward (stage3.py)."""
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
    cls = STAGES[stage]
    mixed = isinstance(opt, MixedPrecisionAdamW)                     # fp32 master weights
    dtype = np.dtype(opt.dtype if mixed else model.dtype)            # storage dtype
    named = dict(model.named_parameters())
    masters = dict(zip(named, opt.master)) if mixed else {}
    ms, vs = dict(zip(named, opt.m)), dict(zip(named, opt.v))
    pairs = {}                                                      # unit group -> (shards, replicas)
    units = []
    for names, g in _unit_groups(unit_names(named, model.family), group.with_axis("zero"), expert_group, is_expert):
        if id(g) not in pairs:
            pairs[id(g)] = hybrid.split(g, blocks) if blocks is not None else (g, None)
        shards, replicas = pairs[id(g)]
        units.append(Unit(names, [named[n] for n in names], shards.size, shards.rank, shards, m=[ms[n] for n in names],
                          v=[vs[n] for n in names], master=[masters[n] for n in names] if mixed else None,
                          grad_dtype=dtype, params_sharded=cls.params_sharded, grads_sharded=cls.grads_sharded,
                          replicas=replicas))
    sync = cls(model, units, group, dtype, **gathers)
    optimizer = ShardedAdamW(opt, units, sync)
    del opt.m, opt.v                                                # only the shards live on
    if mixed:
        del opt.master
    return sync, optimizer


def _unit_groups(units, group, expert_group, is_expert):
    """[(names, the unit's "zero" group)]: every unit over the dp group, or with experts
    each unit cut into its non-expert names (over dp) and its experts' (over expert_group)."""
    if expert_group is None:
        return [(u, group) for u in units]
    out, experts_zero = [], expert_group.with_axis("zero")
    for u in units:
        plain, experts = [n for n in u if not is_expert(n)], [n for n in u if is_expert(n)]
        out += [(plain, group)] if plain else []
        out += [(experts, experts_zero)] if experts else []
    return out
