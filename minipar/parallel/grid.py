"""The process grid: world = dp x cp x tp x pp ranks, and one communicator per axis.

Rank order (docs/design.md §6): tp varies fastest, then cp, then dp, then pp,

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so tensor-parallel partners, which talk on every layer, are neighbouring ranks (on one
node in a real cluster), context-parallel partners (K and V round a ring on every layer)
next to them, inside the host too where it is big enough, and pipeline stages, which talk
least, are farthest apart. With cp = 1 this is the dp x tp x pp order of before.
Example, dp=2 tp=2 pp=2 (8 ranks):

    pp stage 0:  dp 0 -> ranks 0 1 (tp)   dp 1 -> ranks 2 3
    pp stage 1:  dp 0 -> ranks 4 5        dp 1 -> ranks 6 7
    dp groups: {0,2} {1,3} {4,6} {5,7}     pp groups: {0,4} {1,5} {2,6} {3,7}

and dp=2 cp=2 (4 ranks): cp groups {0,1} {2,3}, dp groups {0,2} {1,3}.

Every rank of a cp group holds the same parameters and computes a partial gradient over its
own tokens, so gradients are summed over dp x cp: grad_group, the dp group itself when
cp = 1 (ZeRO shards over it too).

Expert parallelism (ep, which divides dp) cuts each dp group into dp/ep ep groups of ep
consecutive dp ranks: ep_group (axis "ep"), between whose ranks a MoE layer's experts are
split and its tokens travel (all-to-all). An expert's weights are held by the dp ranks of the
same ep rank, dp/ep of them: expert_group (axis "dp"), over which its gradients are summed;
the other parameters' gradients are summed over the whole dp group. ep = 1: no ep_group,
expert_group = grad_group.

The sizes come from the run's Layout (minipar/parallel/layout.py, `grid.layout`), whose
`check` validates them without any communication, so that every rank can reject a bad one
before the first message. `ProcessGrid` then builds the groups with Comm.Split (creating
communicators is not a collective *operation* on data), each tagged with its axis ("tp",
"cp", "dp", "pp"; the whole world "world"; grad_group "dp") so that minipar.comm's ledger
counts each axis's bytes where they are sent (comm.traffic_by_axis()).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar.comm import Group
from minipar.comm.ledger import human_bytes
from minipar.parallel.layout import Layout


@dataclass(frozen=True)
class Coords:
    dp: int
    tp: int
    pp: int
    cp: int = 0


class ProcessGrid:
    """This rank's place in the dp x cp x tp x pp grid, and its groups: tp_group, cp_group,
    dp_group, pp_group, grad_group (dp x cp) and world, tagged with their axis for the
    traffic ledger."""

    def __init__(self, comm, layout: Layout):
        world = comm.Get_size()
        layout.check(world)
        self.comm, self.rank, self.world_size, self.layout = comm, comm.Get_rank(), world, layout
        dp, tp, cp, ep = layout.dp, layout.tp, layout.cp, layout.ep
        r = self.rank
        self.tp_rank = r % tp
        self.cp_rank = (r // tp) % cp
        self.dp_rank = (r // (tp * cp)) % dp
        self.pp_rank = r // (dp * cp * tp)
        t, c, d, p = self.tp_rank, self.cp_rank, self.dp_rank, self.pp_rank
        # Split: same color -> same group; key orders ranks inside it
        self.tp_group = Group.split(comm, (p * dp + d) * cp + c, t, axis="tp")
        self.dp_group = Group.split(comm, (p * cp + c) * tp + t, d, axis="dp")
        self.pp_group = Group.split(comm, (d * cp + c) * tp + t, p, axis="pp")
        self.cp_group, self.grad_group = None, self.dp_group      # cp = 1: no ring, grads over dp
        if cp > 1:
            self.cp_group = Group.split(comm, (p * dp + d) * tp + t, c, axis="cp")
            self.grad_group = Group.split(comm, p * tp + t, d * cp + c, axis="dp")
        self.world = Group(comm, axis="world")
        # expert parallelism: the dp group cut into dp/ep groups of ep consecutive dp ranks, each
        # holding all experts between them; an expert's replicas: the dp ranks of the same ep rank
        self.ep_rank = d % ep
        self.ep_group, self.expert_group = None, self.grad_group
        if ep > 1:
            self.ep_group = Group.split(comm, ((p * (dp // ep) + d // ep) * cp + c) * tp + t, d % ep, axis="ep")
            self.expert_group = Group.split(comm, ((p * ep + d % ep) * cp + c) * tp + t, d // ep, axis="dp")

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def pp_size(self) -> int:
        return self.layout.pp

    @property
    def cp_size(self) -> int:
        return self.layout.cp

    @property
    def ep_size(self) -> int:
        return self.layout.ep

    def rank_of(self, dp_rank: int, tp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp_size + dp_rank) * self.cp_size + cp_rank) * self.tp_size + tp_rank

    @property
    def coords(self) -> Coords:
        return Coords(self.dp_rank, self.tp_rank, self.pp_rank, self.cp_rank)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def describe(self) -> str:
        cp = f" cp={self.cp_size}" if self.cp_size > 1 else ""
        ep = f" ep={self.ep_size}" if self.ep_size > 1 else ""
        return f"dp={self.dp_size}{ep}{cp} tp={self.tp_size} pp={self.pp_size}"

    def __repr__(self):
        cp = f" cp={self.cp_rank}" if self.cp_size > 1 else ""
        return (f"ProcessGrid(rank {self.rank}/{self.world_size}, {self.describe()}, "
                f"coords dp={self.dp_rank}{cp} tp={self.tp_rank} pp={self.pp_rank})")


def hosts_summary(hosts: list, rank_host: list, rows_log: list, tp_spans_hosts: bool) -> tuple[dict, list[str]]:
    """A job across hosts: where the ranks are (hosts, the host of each rank), and the bytes
    per step this rank sent by axis, in all and across hosts (the rows' bytes_by_axis and
    inter_host_bytes_by_axis, from the ledger's bytes_sent_inter)."""
    axes = sorted({a for r in rows_log for a in r["bytes_by_axis"]})
    h = {"hosts": list(hosts), "rank_host": rank_host,
         "bytes_per_step": {a: float(np.mean([r["bytes_by_axis"].get(a, 0) for r in rows_log])) for a in axes},
         "inter_host_bytes_per_step": {a: float(np.mean([r["inter_host_bytes_by_axis"].get(a, 0)
                                                         for r in rows_log])) for a in axes},
         "tp_spans_hosts": tp_spans_hosts}
    per = ", ".join(f"{a} {human_bytes(h['inter_host_bytes_per_step'][a])} of {human_bytes(n)}"
                    for a, n in h["bytes_per_step"].items())
    return h, [f"  across {len(h['hosts'])} hosts: sent per step to other hosts (of all sent), by axis: {per}"]
