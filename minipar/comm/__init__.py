"""minipar.comm: collectives written by hand on MPI point-to-point messages (docs/design.md §5).

This file is the API and the choice of algorithm; beside it: group.py (Group: a communicator
of minipar's own, its hosts, axis views, the MINIPAR_DEBUG check), calls.py (Call, the one
way a message moves: a polled Isend/Irecv, with its timeout; run and Handle, the blocking
and non-blocking drivers of an algorithm's generator), ledger.py (the traffic ledger),
p2p.py (send/recv and their async forms), protocol.py (tags, the dtype-and-shape header),
helpers.py (argument checks and array helpers shared by the algorithms), errors.py
(CommError and its kinds; ending the whole job on an uncaught error), algorithms/ (one
algorithm per file), static_check.py (no library file calls MPI's own collectives) and
sent.py (the bytes each collective sends from this rank to each peer, by the algorithm
chosen below, inside the host and across: the formulas of the mechanisms built on them).

    g = Group(MPI.COMM_WORLD)                 # or any sub-communicator, of any size
    g = Group(sub_comm, axis="dp")            # its messages counted under "dp" (default None)
    z = g.with_axis("zero")                   # same group and message order, counted as "zero"
    y = all_reduce(g, x, op="sum")            # op: sum, max, min; out=y to reuse a buffer
    piece = reduce_scatter(g, x)              # rank r: piece r of np.array_split(sum, p)
    whole = all_gather(g, piece, sizes=...)   # concatenation in rank order
    broadcast(g, x, root)  reduce(g, x, root, op)  scatter(g, x, root)  gather(g, x, root)
    send(g, x, dst)  recv(g, src)             # dtype and shape travel with the data
    h = send_async(g, x, dst); h.wait()       # non-blocking point-to-point (pipelines);
    h = recv_async(g, src); x = h.wait()      # ledger names "send" and "recv"
    h = all_reduce_async(g, x); ... h.test() ...; y = h.wait()
    traffic(); reset_traffic()                # bytes and seconds per operation, this process
    traffic_by_axis()                         # the same calls per group axis: {"dp": {...}, ...}
    with window() as w: ...                   # what a block sent: w.sent_by_axis, w.sent_until(mark)
    count(owner, kind, **n); counts(owner)    # a mechanism's own counts (tp's calls by kind, ...)

The ledger counts every call twice, under its operation and under its group's axis, so the
bytes of each parallelism axis are tagged where they are sent, not guessed from operation
names. ProcessGrid's groups are tagged "tp", "dp", "pp" and "world"; ZeRO, which talks on
the dp group's ranks, uses grid.dp_group.with_axis("zero"), a view that shares the group's
communicator and message order. For every field the per-axis totals equal the
per-operation totals. A call is counted under the axis of the group it was started on,
however late it completes (a Handle).

Which algorithm runs depends on the group size p and the message size; the constants below
were measured with scripts/bench_collectives.py --crossover (docs/collectives.md):

    all_reduce      recursive doubling (doubling.py)   up to ALL_REDUCE_DOUBLING_MAX_BYTES,
                    then direct exchange (direct.py)   p <= direct.DIRECT_MAX_RANKS, else ring
    reduce_scatter  direct exchange (one round)        p <= direct.DIRECT_MAX_RANKS, else ring
    all_gather      Bruck (doubling.py)                p >= 4, up to ALL_GATHER_BRUCK_MAX_BYTES,
                    then direct exchange or ring       as for all_reduce
    broadcast, reduce  binomial tree (tree.py) up to tree.BROADCAST_TREE_MAX_BYTES and
                       tree.REDUCE_TREE_MAX_BYTES, then a pipelined chain (p > 2)
    scatter, gather    binomial tree
    all_to_all      Bruck (alltoall.py)                p >= 7, up to ALL_TO_ALL_BRUCK_MAX_BYTES,
                    then the pairwise exchange         (sizes=: always pairwise)
A group whose ranks sit on several hosts, some of them on the same one (Group.nodes), takes
the hierarchical algorithms (hierarchical.py) for all_reduce, reduce_scatter and all_gather
above the small-message sizes: inside each host, then across hosts once per piece; and the
hierarchical all-to-all (hierarchical_alltoall.py) for equal pieces up to
ALL_TO_ALL_HIERARCHICAL_MAX_BYTES: the same bytes across hosts in k times fewer messages.
(Variable sizes stay pairwise: a forwarding rank's bytes depend on its peers' counts, which
it learns only during the call, so the trainer could not hold its ledger to a formula of
what it knows; hierarchical_alltoall's own all_to_all takes sizes= too.)
MINIPAR_HIERARCHICAL=0 turns that off (the flat algorithms everywhere: to compare).

Blocking calls run the same algorithms without the generator machinery (straight_line.py)
where that is simple: direct exchange (reduce-scatter, all-gather, all-reduce) at any size,
Bruck, and recursive doubling up to SMALL_MAX_BYTES. Every algorithm is also callable on its
own, whatever the size: ring.all_reduce, doubling.all_reduce, direct.all_reduce, ... (the
tests run each of them).
"""
import os

from minipar.comm.algorithms import (alltoall, direct, doubling, hierarchical, hierarchical_alltoall, ring,
                                     straight_line, tree)
from minipar.comm.calls import Handle, run
from minipar.comm.errors import CollectiveMismatch, CommError, CommTimeout, abort_on_error, abort_world
from minipar.comm.group import Group
from minipar.comm.helpers import array
from minipar.comm.ledger import (count, counts, reset_counts, reset_traffic, traffic, traffic_by_axis,
                                 untracked, window)
from minipar.comm.p2p import recv, recv_async, send, send_async
from minipar.comm.algorithms.tree import broadcast, gather, reduce, scatter

# Measured crossovers (bytes of x, or of the result for all_gather): up to and including
# them the latency-optimal algorithm runs. Measured: doubling beats direct exchange up to
# 64 KiB at p = 4, 128 KiB at p = 3, 256 KiB at p = 2; the smallest is kept for every p.
# Bruck beats direct exchange up to 8 KiB at p = 4 (for p <= 3 it has no fewer steps).
ALL_REDUCE_DOUBLING_MAX_BYTES = 64 * 1024
ALL_GATHER_BRUCK_MAX_BYTES = 8 * 1024           # p >= 4
# Blocking recursive-doubling all-reduces up to this size (bytes of x) take the
# generator-free path of straight_line.py: the same algorithm and messages, less Python.
# (Blocking direct reduce-scatters and all-gathers take it at every size: a single round,
# measured 2-8% faster than the generator at 1 MiB on p = 2.)
SMALL_MAX_BYTES = 64 * 1024
# all_to_all: Bruck's ceil(log2 p) rounds against the pairwise exchange's p-1 (alltoall.py).
# Measured (--crossover --ops all_to_all, p = 4..8 on 2 cores): Bruck won up to 8 KiB at
# p = 8 and up to 15 KiB at p = 7 (3 rounds against 6 and 7), never at p = 4, 5, 6: its
# rounds forward what the previous one brought, and pack and unpack blocks, where the
# pairwise exchange's small sends leave at once from x.
ALL_TO_ALL_BRUCK_MAX_BYTES = 8 * 1024
ALL_TO_ALL_BRUCK_MIN_RANKS = 7
# all_to_all across hosts: the hierarchical all-to-all (hierarchical_alltoall.py) sends the
# same bytes across hosts as the pairwise exchange in k times fewer, larger messages, after
# a round inside each host. Measured on the emulated cluster (scripts/bench_cluster.py
# --parts alltoall, a 1 Gbit/s link per host; docs/collectives.md), time against the
# pairwise exchange's: 2 hosts x 2 ranks 0.80 at 4 KiB, 0.96-0.98 from 64 KiB to 1 MiB, 1.16
# at 16 MiB; 4 hosts x 2 ranks 0.67 at 4 KiB, 0.91 at 64 KiB, 1.23 at 256 KiB, 1.33 at 1 MiB
# (the link is then the bottleneck for both, and the round inside the host comes first).
ALL_TO_ALL_HIERARCHICAL_MAX_BYTES = 64 * 1024

__all__ = [
    "Group", "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "scatter",
    "gather", "all_to_all", "send", "recv", "send_async", "recv_async", "traffic",
    "traffic_by_axis", "reset_traffic", "all_reduce_async", "reduce_scatter_async",
    "all_gather_async", "all_to_all_async", "Handle",
    "CommError", "CommTimeout", "CollectiveMismatch", "abort_on_error", "abort_world", "untracked",
    "window", "count", "counts", "reset_counts",
]


HIERARCHICAL = os.environ.get("MINIPAR_HIERARCHICAL", "1").strip().lower() not in ("0", "false", "no", "off")


def spans_hosts(g) -> bool:
    """Does g have ranks on several hosts, and several ranks on some host (and the
    hierarchical algorithms are on)?"""
    return HIERARCHICAL and 1 < g.n_nodes < g.size


def _large(g):
    """The bandwidth algorithm for this group: hierarchical across hosts; on one host, one
    round of direct exchange, or the ring."""
    if spans_hosts(g):
        return hierarchical
    return direct if g.size <= direct.DIRECT_MAX_RANKS else ring


def all_reduce_algorithm(g, x):
    """The module whose algorithm all_reduce runs for x on g (the crossovers above; the
    benchmark asks it too)."""
    return doubling if x.nbytes <= ALL_REDUCE_DOUBLING_MAX_BYTES else _large(g)


def all_reduce(g, x, op="sum", *, out=None):
    """Every rank gets op (sum, max, min) over all ranks' x: same shape and dtype as x.

    out: write the result there instead of into a new array (same shape and dtype, C-order;
    x itself is allowed: an in-place all-reduce)."""
    x = array(x)
    algorithm = all_reduce_algorithm(g, x)
    if algorithm is doubling and x.nbytes <= SMALL_MAX_BYTES:
        return straight_line.all_reduce_into(g, x, op, out)
    if algorithm is direct:                     # two rounds: straight-line at any size
        return straight_line.all_reduce_direct_into(g, x, op, out)
    return run(*algorithm.start_all_reduce(g, x, op, out))     # ring or hierarchical


def all_reduce_async(g, x, op="sum", *, out=None):
    """Start an all_reduce and return a Handle: handle.test() makes progress and says whether
    it is done, handle.wait() finishes it and returns the result. Leave x (and out) alone
    until then."""
    x = array(x)
    return Handle(*all_reduce_algorithm(g, x).start_all_reduce(g, x, op, out))


def reduce_scatter_algorithm(g, x):
    """The module whose algorithm reduce_scatter runs for x on g."""
    if spans_hosts(g) and x.nbytes <= ALL_REDUCE_DOUBLING_MAX_BYTES:
        return direct           # small: one round beats the hierarchy's two
    return _large(g)            # direct exchange is one round: no faster small-message path


def reduce_scatter(g, x, op="sum", *, out=None):
    """Rank r gets piece r of np.array_split(op over all ranks' x.ravel(), p) (1-D)."""
    x = array(x)
    algorithm = reduce_scatter_algorithm(g, x)
    if algorithm is direct:                     # one round: straight-line at any size
        return straight_line.reduce_scatter_into(g, x, op, out)     # (else ring or hierarchical)
    return run(*algorithm.start_reduce_scatter(g, x, op, out))


def reduce_scatter_async(g, x, op="sum", *, out=None):
    x = array(x)
    return Handle(*reduce_scatter_algorithm(g, x).start_reduce_scatter(g, x, op, out))


def _gathered_bytes(g, x, sizes):
    return (x.size * g.size if sizes is None else sum(int(s) for s in sizes)) * x.itemsize


def all_gather_algorithm(g, x, sizes):
    """The module whose algorithm all_gather runs for x (and the pieces' sizes) on g."""
    if g.size >= 4 and _gathered_bytes(g, x, sizes) <= ALL_GATHER_BRUCK_MAX_BYTES:
        return doubling
    if spans_hosts(g) and _gathered_bytes(g, x, sizes) <= ALL_REDUCE_DOUBLING_MAX_BYTES:
        return direct if g.size <= direct.DIRECT_MAX_RANKS else ring
    return _large(g)


def all_gather(g, x, sizes=None, *, out=None):
    """The concatenation of every rank's x.ravel(), in rank order (1-D).

    sizes: each rank's element count when they differ (e.g. reduce_scatter pieces);
    None means every rank's x has as many elements as this one's.
    """
    x = array(x)
    algorithm = all_gather_algorithm(g, x, sizes)
    if algorithm in (direct, doubling):         # direct (any size) or Bruck (small): straight-line
        return straight_line.all_gather_into(g, x, sizes, out, bruck=algorithm is doubling)
    return run(*algorithm.start_all_gather(g, x, sizes, out))


def all_gather_async(g, x, sizes=None, *, out=None):
    x = array(x)
    return Handle(*all_gather_algorithm(g, x, sizes).start_all_gather(g, x, sizes, out))


def all_to_all_algorithm(g, x, sizes=None):
    """What all_to_all runs for x on g: "hierarchical", "bruck" or "pairwise" (the crossovers
    above)."""
    if sizes is None and spans_hosts(g) and array(x).nbytes <= ALL_TO_ALL_HIERARCHICAL_MAX_BYTES:
        return "hierarchical"
    if sizes is None and g.size >= ALL_TO_ALL_BRUCK_MIN_RANKS and \
            array(x).nbytes <= ALL_TO_ALL_BRUCK_MAX_BYTES:
        return "bruck"
    return "pairwise"


def all_to_all_sent(g, x) -> int:
    """Bytes one rank sends in all_to_all of x in equal pieces on g: those of the algorithm
    all_to_all picks for that size (alltoall.bytes_sent: pairwise (p-1)/p n, or Bruck's; across
    hosts hierarchical_alltoall.bytes_sent, inside the host and across). x: an array, or
    helpers.shaped's stand-in."""
    algorithm = all_to_all_algorithm(g, x)
    if algorithm == "hierarchical":
        return sum(hierarchical_alltoall.bytes_sent(g.nodes, g.rank, x.nbytes // g.size))
    return alltoall.bytes_sent(g.size, x.nbytes, algorithm)


def _start_all_to_all(g, x, sizes, out, return_sizes):
    x = array(x)
    algorithm = all_to_all_algorithm(g, x, sizes)
    if algorithm == "hierarchical":
        return hierarchical_alltoall.start_all_to_all(g, x, sizes, out, return_sizes)
    if algorithm == "bruck":
        return alltoall.start_bruck(g, x, out, return_sizes)
    return alltoall.start_pairwise(g, x, sizes, out, return_sizes)


def all_to_all(g, x, *, sizes=None, out=None, return_sizes=False):
    """Rank r's piece j of x (along the first axis) goes to rank j; returns the pieces every
    rank sent to this one, concatenated in source-rank order (MPI_Alltoall).

    sizes=None: p equal pieces (x.shape[0] divisible by p); the result has x's shape.
    sizes: rows of x for each destination, in rank order (p counts adding up to x.shape[0]);
    the counts are exchanged first, so the result has as many rows as the others sent.
    return_sizes: also return the rows received from each rank (a list of p ints).
    out: the result's array (equal split only; not overlapping x).
    """
    return run(*_start_all_to_all(g, x, sizes, out, return_sizes))


def all_to_all_async(g, x, *, sizes=None, out=None, return_sizes=False):
    """Start an all_to_all; a Handle whose wait() returns what all_to_all would."""
    return Handle(*_start_all_to_all(g, x, sizes, out, return_sizes))
