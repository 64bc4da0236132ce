"""Hybrid sharding: ZeRO inside a shard group of S ranks, replicated across the R = N/S groups.

Flat ZeRO spreads each unit over all N ranks that sum its gradient (dp x cp). At scale that
puts every all-gather and reduce-scatter on the slow links between hosts. Hybrid sharding
(torchtitan's HSDP, dp_shard x dp_replicate; DeepSpeed's hpZ for the weights; Megatron-LM's
distributed-optimizer instances) cuts the N ranks into R shard groups of S consecutive ranks
(by default those of a host). Inside a shard group everything is flat ZeRO over S ranks;
across them, the ranks that hold the same shard (a replica group, one rank of each shard
group) are data-parallel replicas of it:

    ranks (N = 8, S = 4)        shard groups {0 1 2 3} {4 5 6 7}   replica groups {0 4} {1 5} {2 6} {3 7}

One step, per unit (n_pad elements, padded to a multiple of N so that both cuts are equal):
    gradients   reduce-scatter inside the shard group (every micro-batch from stage 2 on,
                the last one at stage 1), then once per step, after the last micro-batch's,
                an all-reduce of the summed n_pad/S shard across its R replicas
    parameters  all-gathered inside the shard group only (after the update at stages 1 and 2;
                around each piece of forward and backward at stage 3)
so a rank holds model states / S instead of / N, and only the shard's all-reduce crosses
between shard groups: 2(R-1)/R x n_pad/S per step instead of flat ZeRO's (N-1)/N x n_pad per
call. Every replica gets the same bits from the all-reduce, so the replicas' AdamW updates
stay identical without any further message.

`split` makes the two groups of a ZeRO unit group from the shard block of each of its ranks;
`blocks` says which block each rank of the gradient group is in.
"""
from __future__ import annotations

from minipar.comm import Group


class ShardLayoutError(ValueError):
    """A unit group that the shard blocks cut unevenly (experts' replicas, --ep)."""


def blocks(grad_group, S: int | None, by_host: bool = False) -> dict:
    """{world rank: its shard block} over the gradient group (dp x cp ranks, in their order):
    S consecutive ranks per block, or with by_host the ranks of each host (grad_group.nodes).
    S None (and not by_host): one block, flat ZeRO."""
    ranks = grad_group.world_ranks
    if by_host:
        return {w: grad_group.nodes[i] for i, w in enumerate(ranks)}
    S = S or len(ranks)
    return {w: i // S for i, w in enumerate(ranks)}


def host_shard_size(grad_group) -> int:
    """S for --shard-group host: the gradient group's ranks on a host, the same on every host
    (else ValueError naming the counts). Every rank knows every rank's host, so every rank
    reaches the same answer."""
    counts = [grad_group.nodes.count(h) for h in range(grad_group.n_nodes)]
    if len(set(counts)) != 1:
        raise ValueError(f"--shard-group host needs as many ranks of each gradient group (dp x cp) on every "
                         f"host; the hosts hold {counts}: give --shard-group S")
    return counts[0]


def split(group, block_of: dict, axis: str = "zero") -> tuple:
    """(shard group, replica group or None) of a ZeRO unit group: its ranks of this rank's
    block, and the ranks in the same place of every other block. One block: (group, None).
    Creating communicators is set-up (Comm.Split), not a collective on data."""
    mine = [block_of[w] for w in group.world_ranks]
    order = sorted(set(mine), key=mine.index)
    counts = [mine.count(b) for b in order]
    if len(set(counts)) != 1:
        raise ShardLayoutError(f"--shard-group cuts the ranks of a ZeRO group unevenly: {counts} of its ranks "
                               f"{list(group.world_ranks)} fall in each shard group (with --ep, the experts' "
                               f"replicas must split evenly too)")
    if len(order) == 1:
        return group, None
    b = mine[group.rank]
    place = [q for q in range(group.size) if mine[q] == b].index(group.rank)
    shard = Group.split(group.comm, order.index(b), group.rank, axis=axis, host=group.host)
    replicas = Group.split(group.comm, place, order.index(b), axis=axis, host=group.host)
    return shard, replicas
