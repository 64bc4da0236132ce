"""What a layout (minipar/parallel/layout.py: Layout) puts on a device: the bytes per
element and per parameter its flags imply, and what a device of each stage holds: its tensors
(pipeline.local_tensors, with --ep its ep rank's experts), its blocks, the ranks its
gradients are summed over, ZeRO's units and the ranks they are sharded over (--shard-group).
"""
from __future__ import annotations

import math
from collections import Counter
from types import SimpleNamespace

from minipar.config import flags as config
from minipar.model.gpt import GPTConfig, param_specs
from minipar.optim import mixed_precision
from minipar.parallel.expert import expert_parallel
from minipar.parallel.layout import Layout
from minipar.parallel.pipeline import stage as pipeline, schedules
from minipar.parallel.zero import hybrid, units as zero


def placed(lay) -> Layout:
    """The layout as plan_hosts places it (dp x tp x pp): the grid's rank
    ((pp*dp + d)*cp + c)*tp + t is that of dp*cp replicas, d*cp + c the replica."""
    return lay.but(dp=lay.grad_ranks, cp=1)


def itemsizes(lay) -> tuple[int, int, int]:
    """(itemsize, compute_itemsize, K): storage and compute bytes per element, optimizer
    bytes per parameter."""
    if lay.precision != "fp32":
        return 2, 4, mixed_precision.optimizer_bytes_per_param(True, 2)
    itemsize = 8 if lay.dtype == "float64" else 4
    return itemsize, itemsize, mixed_precision.optimizer_bytes_per_param(False, itemsize)


# --- what a device holds ----------------------------------------------------------------------

def device_tensors(cfg: GPTConfig, lay, stage: int) -> list:
    """[(name, elements)] a device of `stage` holds (dp rank 0): pipeline.local_tensors, and
    with --ep P only its ep rank's experts of each MoE block, E/P of them (ep rank 0 holds
    experts 0 .. E/P - 1: expert_parallel.ExpertPlacement)."""
    tensors = pipeline.local_tensors(cfg, stage, lay.pp, lay.tp, chunks(lay))
    per_rank = cfg.moe_experts // lay.ep if lay.ep > 1 else None
    return [(n, k) for n, k in tensors
            if per_rank is None or expert_parallel.expert_of(n) is None or expert_parallel.expert_of(n) < per_rank]


def active_params(cfg: GPTConfig) -> int:
    """Parameters a token goes through: all but the experts it is not routed to, i.e. in each
    MoE block the router and K expert MLPs (experts 0 .. K-1 stand for any K: all have the
    same shapes) instead of E."""
    def active(name):
        e = expert_parallel.expert_of(name)
        return e is None or e < cfg.moe_top_k
    return sum(math.prod(shape) for name, shape, _ in param_specs(cfg) if active(name))


def sync_groups(tensors: list, lay) -> list:
    """[(tensors, layout)]: the device's tensors and the ranks their gradients are summed (and
    ZeRO-sharded) over, the layout's grad_ranks. With --ep two sets: the non-expert tensors
    over dp (x cp), and the experts' over their dp/ep replicas (grid.expert_group: the
    layout with dp = dp/ep)."""
    if lay.ep == 1:
        return [(tensors, lay)]
    experts = [(n, k) for n, k in tensors if expert_parallel.expert_of(n) is not None]
    others = [(n, k) for n, k in tensors if expert_parallel.expert_of(n) is None]
    return [(others, lay), (experts, lay.but(dp=lay.dp // lay.ep))]


def zero_split(lay, gl=None) -> tuple[int, int]:
    """(S, R) of the ZeRO units of a sync_groups set gl (default: lay's own, the dp x cp
    ranks): the ranks each unit is sharded over and the replicas of each shard (its units
    padded for S*R, zero_units). Flat ZeRO, no --shard-group (or "host" not yet resolved, as
    memory.check_fits gets it): (all of gl's ranks, 1). Hybrid: the gradient group cut into
    blocks of S consecutive ranks (zero.hybrid.blocks); of gl's ranks (with --ep the experts'
    dp/ep replicas, ep apart) those in the device's block and the blocks they fall in;
    ConfigError when the blocks hold unequal numbers (what zero.hybrid.split refuses)."""
    gl = gl or lay
    n, S = gl.grad_ranks, lay.shard_group
    if not lay.zero or not isinstance(S, int):
        return n, 1
    stride = lay.grad_ranks // n
    block = hybrid.blocks(SimpleNamespace(world_ranks=range(lay.grad_ranks)), S)
    counts = Counter(block[i * stride] for i in range(n))
    if len(set(counts.values())) != 1:
        raise config.ConfigError(f"--shard-group {S}: the shard groups hold unequal numbers {sorted(counts.values())} "
                                 f"of the {n} ranks each expert is summed over ({stride} apart)")
    return counts[block[0]], len(counts)


def zero_units(tensors: list, N: int, family=None) -> list:
    """Element count of each ZeRO unit (zero.unit_names: the names of `family`, default GPT-2's)
    of the device, padded for N ranks."""
    size = dict(tensors)
    return [zero.padded(sum(size[n] for n in unit), N) for unit in zero.unit_names([n for n, _ in tensors], family)]


def chunks(lay) -> int:
    """Model chunks per pipeline rank: --virtual-stages with a pipeline, else 1."""
    return lay.virtual_stages if lay.pp > 1 else 1


def rank_layer_count(cfg: GPTConfig, stage: int, pp: int, n_chunks: int = 1) -> int:
    """Transformer blocks a rank of `stage` holds: all its chunks' (schedules.rank_layers)."""
    return sum(len(r) for r in schedules.rank_layers(cfg.n_layer, stage, pp, n_chunks))


def rank_moe_count(cfg: GPTConfig, stage: int, pp: int, n_chunks: int = 1) -> int:
    """The MoE blocks among them."""
    return sum(cfg.is_moe(i) for r in schedules.rank_layers(cfg.n_layer, stage, pp, n_chunks) for i in r)
