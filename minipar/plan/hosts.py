"""The planner across hosts: which of a device's bytes leave its host, and how long they take.

    python -m minipar.plan --dp 4 --ranks-per-host 2 --inter-node-gbps 10 --intra-node-gbps 100

What is placed: rank r on host r // K (K = --ranks-per-host; when K does not divide the
world the last host holds the rest, as `mpirun -ppn K` fills hosts), the ranks in the
grid's order (parallel/grid.py, docs/design.md §6: tp fastest, then cp, then dp, then pp).
So a tp group stays inside a host when K is a multiple of tp, a cp ring (ranks tp apart)
when K is a multiple of cp*tp, and dp and pp groups, whose ranks are cp*tp and dp*cp*tp
apart, are the first to cross; an ep group is P consecutive dp ranks.

What is sent: comm_bytes.py's axis functions (dp_bytes, tp_bytes, pp_bytes, other_parts) name
every collective and message a device makes in one step, on a group (comm_bytes.Flat on one
host). `Placed` answers the same calls message by message, on the device's real group:
the algorithm is the one comm's dispatcher picks for that group and size
(comm.all_reduce_algorithm & co., asked with the group stand-in itself), and each algorithm's
peers follow its code:
    recursive doubling   the whole message to r XOR 2^k; the fix-up pairs r, r + q
    direct exchange      piece j to rank j (reduce-scatter); its own piece to every rank
    ring                 p - 1 pieces, all to rank r + 1
    Bruck                min(2^k, p - 2^k) pieces to rank r - 2^k, step by step
    hierarchical         inside the host, then to the owners or deputies on other hosts
                         (hierarchical.layout: the same deputies; the all-to-all's messages:
                         hierarchical_alltoall.sends)
    pairwise all-to-all  a piece to every other rank (sizes=: a count, then the rows)
    ring attention       every message to the next rank of the cp ring
    binomial tree        the header, then the payload, to each child (tree._children)
    send, recv           a 128-byte header and the payload to the peer

How many bytes: a message crosses hosts when its peer's host differs from the device's.
For n bytes on N hosts of k ranks (hierarchical.py's table, per rank), an all-reduce sends
2(k-1)/k n inside and 2(N-1)/N n/k across; reduce-scatter and all-gather half of each. The
flat algorithms cross wherever their peers are: a direct exchange from rank r sends the
pieces of every rank on another host, the ring only from a host's last rank, recursive
doubling in the rounds whose partner r XOR 2^j sits on another host.

Time per step, per axis:
    intra bytes / intra-host bandwidth + inter bytes / inter-host bandwidth
        + messages across hosts * latency
each link a device's own, one message after another (nothing overlaps: the trainer hides
much of dp's traffic behind backward, so for dp this is an upper bound). A link without a
bandwidth flag is not timed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

from minipar import comm
from minipar.config import flags as config
from minipar.comm.algorithms import (alltoall, direct, doubling, hierarchical, hierarchical_alltoall, ring,
                                     tree)
from minipar.comm.helpers import split_offsets
from minipar.comm.protocol import HEADER_BYTES
from minipar.parallel.expert.expert_parallel import COUNT_BYTES

AXES = ("dp", "tp", "pp", "other")      # the planner's axes (comm_bytes.py's docstring)


@dataclass(frozen=True)
class Traffic:
    """What one device sends: bytes inside its host and across hosts, and how many messages
    cross (each pays the link's latency). An int added to it is bytes on one host (comm_bytes.Flat)."""
    intra: int = 0
    inter: int = 0
    inter_messages: int = 0

    @property
    def bytes(self) -> int:
        return self.intra + self.inter

    def __add__(self, other):
        o = other if isinstance(other, Traffic) else Traffic(intra=other)
        return Traffic(self.intra + o.intra, self.inter + o.inter, self.inter_messages + o.inter_messages)

    __radd__ = __add__

    def __mul__(self, k: int):
        return Traffic(k * self.intra, k * self.inter, k * self.inter_messages)

    __rmul__ = __mul__


def as_traffic(x) -> Traffic:
    return x if isinstance(x, Traffic) else Traffic(intra=x)


# --- the placement and the links --------------------------------------------------------------

@dataclass(frozen=True)
class Hosts:
    """Where the ranks run and how fast their links are: the planner's host flags."""
    ranks_per_host: int | None = None     # K: rank r on host r // K; None: every rank on one host
    inter_gbps: float | None = None       # the link between hosts, Gbit/s each way
    intra_gbps: float | None = None       # inside a host (shared memory, NVLink ...), Gbit/s
    latency_us: float = 0.0               # per message across hosts, microseconds

    @classmethod
    def from_args(cls, args) -> Hosts:
        """The planner's host flags (add_arguments), checked."""
        hosts = cls(args.ranks_per_host, args.inter_node_gbps, args.intra_node_gbps, args.inter_node_latency_us)
        hosts.check()
        return hosts

    def check(self):
        """ConfigError (one line, exit 2) for flags that describe no cluster."""
        K = self.ranks_per_host
        if K is not None and K < 1:
            raise config.ConfigError(f"--ranks-per-host must be >= 1, got {K}")
        for flag, v in (("--inter-node-gbps", self.inter_gbps), ("--intra-node-gbps", self.intra_gbps)):
            if v is not None and not (math.isfinite(v) and v > 0):
                raise config.ConfigError(f"{flag} must be > 0 (Gbit/s), got {v:g}")
        if not (math.isfinite(self.latency_us) and self.latency_us >= 0):
            raise config.ConfigError(f"--inter-node-latency-us must be >= 0, got {self.latency_us:g}")
        if self.latency_us and self.inter_gbps is None:
            raise config.ConfigError("--inter-node-latency-us needs --inter-node-gbps (the link it delays)")

    def per_host(self, world: int) -> int:
        return self.ranks_per_host or world

    def n_hosts(self, world: int) -> int:
        return -(-world // self.per_host(world))

    @property
    def timed(self) -> bool:
        return self.inter_gbps is not None or self.intra_gbps is not None

    def link_seconds(self, t: Traffic) -> float | None:
        """The across-host part of the time: bytes / bandwidth + messages * latency."""
        if self.inter_gbps is None:
            return None
        return t.inter * 8 / (self.inter_gbps * 1e9) + t.inter_messages * self.latency_us * 1e-6

    def seconds(self, t: Traffic) -> float | None:
        """Both links, one message after another; None without a bandwidth flag."""
        if not self.timed:
            return None
        inside = t.intra * 8 / (self.intra_gbps * 1e9) if self.intra_gbps is not None else 0.0
        return inside + (self.link_seconds(t) or 0.0)


def add_arguments(parser):
    hosts = parser.add_argument_group("hosts: where the ranks run (rank r on host r // K) and their links")
    hosts.add_argument("--ranks-per-host", type=int, metavar="K",
                       help="ranks on each host, in rank order (the last host may hold fewer) "
                            "[every rank on one host]")
    hosts.add_argument("--inter-node-gbps", type=float, metavar="X",
                       help="bandwidth of a host's link to the others, Gbit/s: times the bytes across hosts")
    hosts.add_argument("--intra-node-gbps", type=float, metavar="Y",
                       help="bandwidth inside a host, Gbit/s: times the bytes that stay inside")
    hosts.add_argument("--inter-node-latency-us", type=float, default=0.0, metavar="L",
                       help="latency of each message across hosts, microseconds [%(default)s]")


# --- who sends what to whom: (peer, bytes) of each message, per algorithm ----------------------
# g: the group (Placed) with g.rank, g.size, g.nodes; sizes: bytes of each np.array_split piece.

def recursive_doubling(g, nbytes: int) -> list:
    """doubling._all_reduce: the fix-up hand-over, log2(q) swaps, the result handed back."""
    p, r = g.size, g.rank
    q = 1 << (p.bit_length() - 1)
    if r >= q:                                            # hands x over, gets the result back
        return [(r - q, nbytes)]
    swaps = [(r ^ (1 << k), nbytes) for k in range(q.bit_length() - 1)]
    return swaps + ([(r + q, nbytes)] if r < p - q else [])


def direct_reduce_scatter(g, sizes: list) -> list:
    return [(j, sizes[j]) for j in range(g.size) if j != g.rank]


def direct_all_gather(g, sizes: list) -> list:
    return [(j, sizes[g.rank]) for j in range(g.size) if j != g.rank]


def ring_reduce_scatter(g, sizes: list) -> list:
    """ring._reduce_scatter: step s sends piece (r - s - 1) % p to the right."""
    p, r = g.size, g.rank
    return [((r + 1) % p, sizes[(r - s - 1) % p]) for s in range(p - 1)]


def ring_all_gather(g, sizes: list) -> list:
    """ring._all_gather: step s sends piece (r - s) % p to the right."""
    p, r = g.size, g.rank
    return [((r + 1) % p, sizes[(r - s) % p]) for s in range(p - 1)]


def bruck_all_gather(g, sizes: list) -> list:
    """doubling._all_gather: the first min(have, p - have) rotated pieces to rank r - have."""
    p, r = g.size, g.rank
    out, have = [], 1
    while have < p:
        count = min(have, p - have)
        out.append(((r - have) % p, sum(sizes[(r + i) % p] for i in range(count))))
        have += count
    return out


def hierarchical_reduce_scatter(g, sizes: list) -> list:
    """hierarchical._reduce_scatter: round 1, each local peer the pieces it deputises for;
    round 2, the host sums of the pieces this rank deputises for, to their owners."""
    mine = hierarchical.pieces_of(g, g.rank)
    local = [(q, sum(sizes[a] for a in hierarchical.pieces_of(g, q))) for q in _local_peers(g)]
    return local + [(a, sizes[a]) for a in mine if a != g.rank]


def hierarchical_all_gather(g, sizes: list) -> list:
    """hierarchical._all_gather: round 1, its piece to its deputy on every other host; round 2,
    the pieces it holds to each local peer."""
    _, deputy = hierarchical.layout(g.nodes)
    r = g.rank
    across = [(deputy[h][r], sizes[r]) for h in range(g.n_nodes) if h != g.nodes[r]]
    held = sum(sizes[a] for a in hierarchical.pieces_of(g, r))
    return across + [(q, held) for q in _local_peers(g)]


def _local_peers(g) -> list:
    return [q for q, n in enumerate(g.nodes) if n == g.nodes[g.rank] and q != g.rank]


def binomial_broadcast(g, nbytes: int, itemsize: int, root: int) -> list:
    """tree._bcast: the header down the binomial tree, then the payload down the same tree,
    or to the next rank in segments (the pipelined chain above tree.BROADCAST_TREE_MAX_BYTES)."""
    p = g.size
    v = (g.rank - root) % p
    kids = [(k + root) % p for k, _ in tree._children(v, p)]
    out = [(k, HEADER_BYTES) for k in kids]
    if nbytes > tree.BROADCAST_TREE_MAX_BYTES and p > 2:
        segments = tree._segments(nbytes // itemsize, itemsize)
        return out + ([((g.rank + 1) % p, (b - a) * itemsize) for a, b in segments] if v < p - 1 else [])
    return out + [(k, nbytes) for k in kids]


ALL_REDUCE = {direct: (direct_reduce_scatter, direct_all_gather), ring: (ring_reduce_scatter, ring_all_gather),
              hierarchical: (hierarchical_reduce_scatter, hierarchical_all_gather)}
ALL_GATHER = {doubling: bruck_all_gather, direct: direct_all_gather, ring: ring_all_gather,
              hierarchical: hierarchical_all_gather}


# --- a device's group, placed on hosts ---------------------------------------------------------

class Placed:
    """A group of world ranks, this device its rank `rank`, with the host of each
    (world rank w on host w // K): what each collective sends from the device, by the
    algorithm comm's dispatcher picks. It stands in for a comm.Group in the dispatcher
    (size, nodes numbered in order of first appearance as Group.set_nodes does, n_nodes).
    The same calls as comm_bytes.Flat; with every rank on one host they send the same bytes."""

    def __init__(self, world_ranks: list, rank: int, per_host: int):
        self.world_ranks, self.rank, self.size = list(world_ranks), rank, len(world_ranks)
        self.per_host = per_host
        first = {}
        self.nodes = tuple(first.setdefault(w // per_host, len(first)) for w in self.world_ranks)
        self.n_nodes = len(first)
        self._cache = {}

    def _traffic(self, messages) -> Traffic:
        me, intra, inter, n = self.nodes[self.rank], 0, 0, 0
        for peer, nbytes in messages:
            if nbytes == 0:                               # comm posts no empty message
                continue
            if self.nodes[peer] == me:
                intra += nbytes
            else:
                inter, n = inter + nbytes, n + 1
        return Traffic(intra, inter, n)

    def _pieces(self, n: int, itemsize: int) -> list:
        off = split_offsets(n, self.size)
        return [(off[i + 1] - off[i]) * itemsize for i in range(self.size)]

    def messages(self, op: str, n: int, itemsize: int, root: int = 0) -> list:
        """(peer, bytes) of every message the device sends in one call of `op` ("all_reduce",
        "reduce_scatter", "all_gather", "broadcast") of n elements (all_gather: each rank's)."""
        if self.size == 1 or n == 0:
            return []
        x = _array(n, itemsize)
        if op == "broadcast":
            return binomial_broadcast(self, n * itemsize, itemsize, root)
        if op == "all_gather":
            return ALL_GATHER[comm.all_gather_algorithm(self, x, None)](self, [n * itemsize] * self.size)
        sizes = self._pieces(n, itemsize)
        if op == "reduce_scatter":
            return ALL_REDUCE[comm.reduce_scatter_algorithm(self, x)][0](self, sizes)
        algorithm = comm.all_reduce_algorithm(self, x)
        if algorithm is doubling:
            return recursive_doubling(self, n * itemsize)
        reduce_scatter, all_gather = ALL_REDUCE[algorithm]
        return reduce_scatter(self, sizes) + all_gather(self, sizes)

    def _cost(self, op: str, n: int, itemsize: int, root: int = 0) -> Traffic:
        key = (op, n, itemsize, root)                     # the same buckets come back: walk once
        if key not in self._cache:
            self._cache[key] = self._traffic(self.messages(op, n, itemsize, root))
        return self._cache[key]

    def all_reduce(self, n: int, itemsize: int) -> Traffic:
        return self._cost("all_reduce", n, itemsize)

    def reduce_scatter(self, n: int, itemsize: int) -> Traffic:
        return self._cost("reduce_scatter", n, itemsize)

    def all_gather(self, n_each: int, itemsize: int) -> Traffic:
        return self._cost("all_gather", n_each, itemsize)

    def broadcast(self, n: int, itemsize: int, root: int) -> Traffic:
        return self._cost("broadcast", n, itemsize, root)

    def send(self, nbytes: int, peer: int) -> Traffic:
        """comm.send / send_async: the header, then the payload."""
        return self._traffic([(peer, HEADER_BYTES), (peer, nbytes)])

    def first(self, n: int) -> Placed:
        """The group of this group's first n ranks (tp rank 0's key/value head group)."""
        return Placed(self.world_ranks[:n], self.rank, self.per_host)

    def split(self, S: int) -> tuple:
        """(its block of S consecutive ranks, the ranks in the same place of every block),
        placed: a ZeRO shard group and its replicas (zero.hybrid), as comm_bytes.Flat.split."""
        b, place = divmod(self.rank, S)
        return (Placed(self.world_ranks[b * S:(b + 1) * S], place, self.per_host),
                Placed(self.world_ranks[place::S], b, self.per_host))

    def hosts(self) -> tuple:
        """(its ranks on the device's host, those of the device's place on every host, one a
        host), placed: ZeRO++'s two groups (zpp.host_groups); one host: (the group, None)."""
        if self.n_nodes == 1:
            return self, None
        mine = [q for q in range(self.size) if self.nodes[q] == self.nodes[self.rank]]
        place = mine.index(self.rank)
        across = [[q for q in range(self.size) if self.nodes[q] == h][place] for h in range(self.n_nodes)]
        return (Placed([self.world_ranks[q] for q in mine], place, self.per_host),
                Placed([self.world_ranks[q] for q in across], self.nodes[self.rank], self.per_host))

    def all_to_all(self, x) -> Traffic:
        """comm.all_to_all of x in p equal pieces (the dispatcher's algorithm for x here)."""
        p, r, piece = self.size, self.rank, x.nbytes // self.size
        algorithm = comm.all_to_all_algorithm(self, x)
        if algorithm == "hierarchical":
            return self._traffic(hierarchical_alltoall.sends(self.nodes, r, piece))
        if algorithm == "bruck":                          # round k: c_k(p) blocks to r + 2^k
            return self._traffic([((r + (1 << k)) % p, alltoall.bruck_round_blocks(p, k) * piece)
                                  for k in range((p - 1).bit_length())])
        return self._traffic([(q, piece) for q in range(p) if q != r])

    def all_to_all_rows(self, nbytes: float) -> Traffic:
        """A variable all-to-all (pairwise) sending nbytes of rows to the other ranks, spread
        evenly (the planner's balanced routing), after a row count to each."""
        others = [q for q in range(self.size) if q != self.rank]
        return self._traffic([(q, COUNT_BYTES) for q in others] + [(q, nbytes / len(others)) for q in others])

    def ring(self, messages: int, nbytes: int) -> Traffic:
        """Ring attention's sends of a step (context_parallel.step_traffic: `messages` sends of
        nbytes in all, headers included), every one to the next rank of the ring."""
        if self.size == 1 or not self.remote_next:
            return Traffic(intra=nbytes)
        return Traffic(inter=nbytes, inter_messages=2 * messages)      # header and payload each

    @property
    def remote_next(self) -> bool:
        return self.nodes[(self.rank + 1) % self.size] != self.nodes[self.rank]


def _array(n: int, itemsize: int):
    """What comm's dispatcher reads of an array: its element count, itemsize and bytes."""
    return SimpleNamespace(size=n, itemsize=itemsize, nbytes=n * itemsize)


def device_groups(lay, hosts: Hosts, stage: int, dp_rank: int = 0, tp_rank: int = 0) -> dict:
    """The groups of the device at (stage, dp_rank, tp_rank), placed: {"dp", "tp", "pp",
    "world"}, ranks in the grid's order (rank = pp*dp*tp + dp*tp + tp)."""
    dp, tp, pp = lay.dp, lay.tp, lay.pp
    K = hosts.per_host(dp * tp * pp)
    me = stage * dp * tp + dp_rank * tp + tp_rank
    return {"tp": Placed([me - tp_rank + t for t in range(tp)], tp_rank, K),
            "dp": Placed([me - dp_rank * tp + d * tp for d in range(dp)], dp_rank, K),
            "pp": Placed([s * dp * tp + dp_rank * tp + tp_rank for s in range(pp)], stage, K),
            "world": Placed(range(dp * tp * pp), me, K)}


def ring_and_expert_groups(lay, hosts: Hosts, stage: int) -> dict:
    """The cp ring and the ep group of the device at (stage, dp rank 0, cp rank 0, tp rank 0),
    placed: {"cp", "ep"}, on the grid dp x cp x tp x pp (rank ((pp*dp + d)*cp + c)*tp + t):
    the cp ring's ranks tp apart, the ep group's (P consecutive dp ranks) cp*tp apart."""
    dp, cp, tp = lay.dp, lay.cp, lay.tp
    K = hosts.per_host(dp * cp * tp * lay.pp)
    first = stage * dp * cp * tp
    return {"cp": Placed([first + c * tp for c in range(cp)], 0, K),
            "ep": Placed([first + d * cp * tp for d in range(lay.ep)], 0, K)}


def spanning_tp_groups(lay, hosts: Hosts) -> list:
    """(stage, dp_rank) of every tp group whose ranks sit on more than one host."""
    K = hosts.per_host(lay.dp * lay.tp * lay.pp)
    first = [(s, d, (s * lay.dp + d) * lay.tp) for s in range(lay.pp) for d in range(lay.dp)]
    return [(s, d) for s, d, w in first if w // K != (w + lay.tp - 1) // K]


# --- what the planner prints -------------------------------------------------------------------

def comm_row(stage: int, axes: dict, other: dict, zero: bool, hosts: Hosts) -> dict:
    """One device's row of comm_per_stage: bytes per step by the planner's axes (as before),
    the part that crosses hosts, the time, and the same bytes by the ledger's axes (the
    trainer's log rows: "bytes_by_axis", "inter_host_bytes_by_axis").
    axes: dp, tp, pp as Traffic (or ints, on one host); other: the 8-byte scalars by group."""
    t = {**{k: as_traffic(axes[k]) for k in ("dp", "tp", "pp")}, "other": sum(other.values(), Traffic())}
    total = sum(t.values(), Traffic())
    ledger = {"zero" if zero else "dp": t["dp"], "tp": t["tp"], "pp": t["pp"]}
    for axis, v in other.items():                          # the loss and norms: dp, pp, world
        ledger[axis] = ledger.get(axis, Traffic()) + v
    seconds = {k: hosts.seconds(v) for k, v in t.items()}
    return {"stage": stage, "bytes_per_step": total.bytes, **{k: v.bytes for k, v in t.items()},
            "inter_host": {**{k: v.inter for k, v in t.items()}, "bytes_per_step": total.inter},
            "inter_host_messages": {**{k: v.inter_messages for k, v in t.items()},
                                    "per_step": total.inter_messages},
            "seconds": None if not hosts.timed else {**seconds, "per_step": hosts.seconds(total)},
            "link_seconds": hosts.link_seconds(total),
            "bytes_by_axis": {k: v.bytes for k, v in ledger.items() if v.bytes},
            "inter_host_bytes_by_axis": {k: v.inter for k, v in ledger.items() if v.inter}}


def add_axis(row: dict, axis: str, sent, hosts: Hosts) -> dict:
    """comm_row's row with an axis of its own added ("cp": ring attention, "ep": the
    all-to-alls, as the trainer's ledger tags them): sent, bytes (one host) or Traffic."""
    t = as_traffic(sent)
    row[axis] = t.bytes
    row["bytes_per_step"] += t.bytes
    row["inter_host"][axis] = t.inter
    row["inter_host"]["bytes_per_step"] += t.inter
    row["inter_host_messages"][axis] = t.inter_messages
    row["inter_host_messages"]["per_step"] += t.inter_messages
    if row["seconds"] is not None:                        # the times add up: linear in the traffic
        row["seconds"][axis] = hosts.seconds(t)
        row["seconds"]["per_step"] += hosts.seconds(t)
    if row["link_seconds"] is not None:
        row["link_seconds"] += hosts.link_seconds(t)
    if t.bytes:
        row["bytes_by_axis"][axis] = t.bytes
    if t.inter:
        row["inter_host_bytes_by_axis"][axis] = t.inter
    return row


def summary(lay, hosts: Hosts, comm_st: list | None, tp_note: dict | None) -> dict:
    """The "hosts" object of --json: the placement, the links, and the device (dp rank 0,
    tp rank 0 of the stage) that sends most across hosts."""
    world = lay.dp * lay.tp * lay.pp
    K, n = hosts.per_host(world), hosts.n_hosts(world)
    out = {"ranks_per_host": hosts.ranks_per_host, "n_hosts": n,
           "ranks_on_each": [min(K, world - h * K) for h in range(n)],
           "inter_node_gbps": hosts.inter_gbps, "intra_node_gbps": hosts.intra_gbps,
           "inter_node_latency_us": hosts.latency_us, "tp_spans_hosts": tp_note, "stage": None,
           "inter_bytes_total": None, "intra_bytes_total": None, "link_seconds": None, "seconds": None}
    if comm_st:
        busiest = max(comm_st, key=lambda c: c["inter_host"]["bytes_per_step"])
        out.update(stage=busiest["stage"], inter_bytes_total=busiest["inter_host"]["bytes_per_step"],
                   intra_bytes_total=busiest["bytes_per_step"] - busiest["inter_host"]["bytes_per_step"],
                   link_seconds=busiest["link_seconds"],
                   seconds=busiest["seconds"]["per_step"] if busiest["seconds"] else None)
    return out


def placement_line(h: dict) -> str:
    first, last = h["ranks_on_each"][0], h["ranks_on_each"][-1]
    K = h["ranks_per_host"] or first
    line = (f"  hosts: {h['n_hosts']}, {first} rank{'s' if first > 1 else ''} each"
            + (f", the last {last}" if last != first else "") + f" (rank r on host r // {K})")
    links = [f"{h['inter_node_gbps']:g} Gbit/s across" if h["inter_node_gbps"] else "",
             f"{h['intra_node_gbps']:g} Gbit/s inside" if h["intra_node_gbps"] else "",
             f"{h['inter_node_latency_us']:g} us per message across" if h["inter_node_latency_us"] else ""]
    links = [s for s in links if s]
    return line + (f"; links: {', '.join(links)}" if links else "")


def human_seconds(s: float) -> str:
    if s == 0:
        return "0 s"
    if s < 1e-6:
        return f"{s * 1e9:.1f} ns"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3g} s"


def table_lines(r: dict, cols: list, row, human_bytes) -> list:
    """The across-host block of the table: bytes per axis that leave the host and, with a
    bandwidth flag, the time per axis (row: the table's row formatter)."""
    sent = [r["comm_per_stage"][stage] for stage in cols]
    heads = [f"stage {stage}" for stage in cols]
    out = ["", row("sent across hosts", heads)]
    axes = (*AXES, *(a for a in ("cp", "ep") if r["layout"][a] > 1))
    for key in (*axes, "bytes_per_step"):
        out.append(row("total" if key == "bytes_per_step" else key,
                       [human_bytes(st["inter_host"][key]) for st in sent]))
    if sent[0]["seconds"] is not None:
        out += ["", row("comm time per step", heads)]
        for key in (*axes, "per_step"):
            out.append(row("total" if key == "per_step" else key, [human_seconds(st["seconds"][key]) for st in sent]))
        h = r["hosts"]
        untimed = ["inside hosts (no --intra-node-gbps)" if h["intra_node_gbps"] is None else "",
                   "across hosts (no --inter-node-gbps)" if h["inter_node_gbps"] is None else ""]
        out.append("  (bytes / bandwidth + messages across hosts x latency; nothing overlapped"
                   + "".join(f"; bytes {u} not timed" for u in untimed if u) + ")")
    return out


def tp_note(lay, hosts: Hosts, tp_traffic) -> dict | None:
    """A layout whose tp groups cross hosts: how many, the first, and what its rank 0 sends
    across hosts per step (tp_traffic(stage, group): comm_bytes.tp_bytes on that tp group)."""
    spanning = spanning_tp_groups(lay, hosts) if lay.tp > 1 else []
    if not spanning:
        return None
    stage, d = spanning[0]
    groups = device_groups(lay, hosts, stage, dp_rank=d)
    K = hosts.per_host(lay.dp * lay.tp * lay.pp)
    ranks = groups["tp"].world_ranks
    return {"groups": len(spanning), "of": lay.pp * lay.dp, "ranks": ranks, "hosts": sorted({w // K for w in ranks}),
            "rank": ranks[0], "inter_host_tp_bytes": as_traffic(tp_traffic(stage, groups["tp"])).inter}


def tp_note_line(n: dict, human_bytes) -> str:
    return (f"the tp group spans hosts ({n['groups']} of {n['of']} tp groups; the first, ranks "
            f"{', '.join(map(str, n['ranks']))}, on hosts {', '.join(map(str, n['hosts']))}): every layer's "
            f"all-reduces cross the link, {human_bytes(n['inter_host_tp_bytes'])} per step across hosts from "
            f"rank {n['rank']}; --ranks-per-host a multiple of --tp keeps tp inside a host")
