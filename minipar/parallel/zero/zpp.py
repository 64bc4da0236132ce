"""ZeRO++ (Wang et al. 2023; DeepSpeed): ZeRO-3's messages made smaller and kept on the host.

    qwZ   --qwz B    the all-gathers of the weights carry int8 codes and a float32 scale per
                     block of B (quantize.py): wire_bytes(shard, B) a rank instead of
                     shard x itemsize. Every rank decodes every piece, its own too, so all
                     ranks compute with the same weights.
    hpZ   --hpz      after forward's all-gather (over all the unit's ranks, across hosts) each
                     rank keeps a secondary shard: its host-local piece of the gathered
                     weights, n_pad/k of them (k ranks of the unit's group on a host).
                     Backward's all-gathers gather the secondary shards inside the host:
                     (k-1)/k x n_pad bytes, none across; the price, n_pad/k more bytes held
                     per unit from its forward to its backward.
    qgZ   --qgz B    the reduce-scatter of the gradients becomes a quantized hierarchical
                     all-to-all: (1) inside the host, each rank sends every local rank, packed,
                     the pieces of the owners with that rank's local index (one per host), and
                     sums what it receives, decoded, in local-rank order: the host's partial
                     sum of those H pieces; (2) across hosts, among the ranks of one local
                     index, each sends each host, packed, its partial sum of the piece that
                     host's rank owns, and sums the H partial sums, decoded, in host order.
                     Bytes: (k-1) H wire(shard) inside, (H-1) wire(shard) across, against the
                     reduce-scatter's (N-1) shard x itemsize.

The numbers change: the weights a step computes with are the decoded ones (each within half
its block's scale of the exact one), the gradients the sums of decoded pieces. The optimizer's
shards stay exact. --verify therefore holds the losses to the codes' resolution (verify.py),
not to the rounding of float64.
"""
from __future__ import annotations

import numpy as np

from minipar import comm
from minipar.comm import Group
from minipar.comm.calls import Done
from minipar.parallel.zero import quantize


class HostLayoutError(ValueError):
    """The hosts hold unequal numbers of a ZeRO group's ranks: no host groups."""


def host_groups(g) -> tuple:
    """(the ranks of g on this rank's host, the ranks of g with this rank's local index, one a
    host, in host order; None when there is one host): hosts must hold equal numbers."""
    counts = [g.nodes.count(h) for h in range(g.n_nodes)]
    if len(set(counts)) != 1:
        raise HostLayoutError(f"ZeRO++'s host groups need as many ranks of each ZeRO group on every host; the "
                         f"hosts hold {counts}")
    if g.n_nodes == 1:
        return g, None
    local = Group.split(g.comm, g.node, g.rank, axis="zero", host=g.host)
    cross = Group.split(g.comm, g.local_rank, g.node, axis="zero", host=g.host)
    return local, cross


class Wire:
    """How stage 3's units travel: plain (all defaults), or with ZeRO++'s qwZ, hpZ and qgZ.
    qwz, qgz: the block size B, 0 when off; hpz: the secondary shards."""

    def __init__(self, qwz: int = 0, hpz: bool = False, qgz: int = 0):
        self.qwz, self.hpz, self.qgz = qwz, hpz, qgz

    @property
    def on(self) -> bool:
        return bool(self.qwz or self.hpz or self.qgz)

    def bind(self, units: list):
        """Each unit's host groups (set-up: Comm.Split, in unit order on every rank)."""
        made = {}
        for u in units:
            u.secondary, u.wire_recv = None, None
            if not (self.hpz or self.qgz):
                u.local, u.cross = u.group, None
                continue
            if id(u.group) not in made:
                made[id(u.group)] = host_groups(u.group)
            u.local, u.cross = made[id(u.group)]
            piece = u.n_pad // u.local.size                  # the secondary shard (n_pad is a multiple of N)
            u.host_lo, u.host_hi = u.local.rank * piece, (u.local.rank + 1) * piece

    # --- the weights ---------------------------------------------------------------------------
    def start_gather(self, u, again: bool):
        """Start the unit's all-gather into u.param_gathered (hpZ in backward: the secondary
        shards, inside the host; qwZ: packed codes into u.wire_recv)."""
        if again and self.hpz and u.secondary is not None:
            return comm.all_gather_async(u.local, u.secondary, out=u.param_gathered)
        if self.qwz:
            msg = quantize.pack(u.param_shard, self.qwz)
            u.wire_recv = np.empty(u.group.size * msg.size, dtype=np.uint8)
            return comm.all_gather_async(u.group, msg, out=u.wire_recv)
        return comm.all_gather_async(u.group, u.param_shard, out=u.param_gathered)

    def landed(self, u):
        """The gather is in: decode qwZ's pieces; hpZ keeps the host-local piece (forward's)."""
        if u.wire_recv is not None:
            w, n = u.wire_recv.size // u.group.size, u.shard_size
            for j in range(u.group.size):
                quantize.unpack(u.wire_recv[j * w:(j + 1) * w], n, self.qwz, u.param_gathered.dtype,
                                out=u.param_gathered[j * n:(j + 1) * n])
            u.wire_recv = None
        if self.hpz and u.secondary is None:
            u.secondary = u.param_gathered[u.host_lo:u.host_hi].copy()

    def secondary_bytes(self, units) -> int:
        return sum(u.secondary.nbytes for u in units if u.secondary is not None)

    # --- the gradients --------------------------------------------------------------------------
    def reduce_scatter(self, u, x: np.ndarray):
        """qgZ's two all-to-alls (the module docstring) -> a Done handle of this rank's summed piece."""
        B, n, g, local = self.qgz, u.shard_size, u.group, u.local
        hosts = _hosts(g)
        H, k = len(hosts), local.size
        w = quantize.wire_bytes(n, B)
        send = np.empty((k, H * w), dtype=np.uint8)
        for l in range(k):                                   # to local rank l: its owners' pieces, by host
            for h, members in enumerate(hosts):
                q = members[l]
                quantize.pack(x[q * n:(q + 1) * n], B, out=send[l, h * w:(h + 1) * w])
        got = comm.all_to_all(local, send)                   # (k, H w): each local rank's pieces for my index
        partial = np.zeros((H, n), dtype=x.dtype)
        for j in range(k):                                   # local-rank order
            for h in range(H):
                partial[h] += quantize.unpack(got[j, h * w:(h + 1) * w], n, B, x.dtype)
        if u.cross is None:
            return Done(partial[0])
        out = np.stack([quantize.pack(partial[h], B) for h in range(H)])     # to host h: its owner's sum
        back = comm.all_to_all(u.cross, out)                 # (H, w): each host's partial sum of my piece
        piece = np.zeros(n, dtype=x.dtype)
        for h in range(H):                                   # host order
            piece += quantize.unpack(back[h], n, B, x.dtype)
        return Done(piece)


def _hosts(g) -> list:
    """The group ranks of each host, hosts in order, each host's in group order."""
    return [[q for q, node in enumerate(g.nodes) if node == h] for h in range(g.n_nodes)]
