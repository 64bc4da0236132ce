"""Hierarchical reduce-scatter, all-gather and all-reduce, for a group that spans hosts.

Inside a host, ranks talk through shared memory; between hosts, through one network link
per host, which is far slower. A flat algorithm pays the link for every piece that happens
to cross it; these pay it once per piece and host. The group's ranks sit on N hosts (Group
learns which when it is made: g.nodes), host h holding k_h of them, its local ranks
0..k_h-1 in group order. Piece q is np.array_split's piece of group rank q, as for every
reduce-scatter; rank q = (host h, local rank j) owns it. On every other host h' one rank
stands in for it: its deputy, local rank j mod k_h'. Hosts may hold different numbers of
ranks (2 + 1 works: the single rank of a host deputises for every piece).

What is sent, and when:
reduce-scatter, 2 rounds
    1. inside each host: each rank sends every other local rank its own x on the pieces that
       rank deputises for (its own piece among them) and sums, in local-rank order, what
       it receives on its own: the host's partial sum of each piece it deputises for;
    2. across hosts: the deputy of piece q on each other host sends that host's partial sum
       to q's owner, who sums the N host sums in host order.
all-gather, 2 rounds: the same paths backwards
    1. across hosts: each owner sends its piece to its deputy on every other host;
    2. inside each host: each rank sends every other local rank the pieces it holds (its own
       and those it received for the pieces it deputises for).
all-reduce = reduce-scatter, then all-gather of the reduced pieces: 4 rounds; each piece is
summed once, by its owner, so every rank gets the same bits.

How many bytes, for n bytes, N hosts of k ranks each (p = Nk), per rank:
                      inside a host          across hosts
    reduce-scatter    (k-1)/k * n            (N-1)/N * n/k
    all-gather        (k-1)/k * n            (N-1)/N * n/k
    all-reduce        2(k-1)/k * n           2(N-1)/N * n/k
against, for the flat ring with each host's ranks next to each other, 2(p-1)/p * n across the
link from each of the N ranks at a host's boundary: at N = k = 2, 3n/2 against n/2, so the
link carries 1.5x fewer bytes. The ledger counts the bytes that cross hosts apart
(bytes_sent_inter, bytes_recv_inter), and tests/mpi/test_hierarchical.py holds both columns
to this table.
"""
import functools

import numpy as np

from minipar.comm.calls import run
from minipar.comm.helpers import array, describe, reduce_op, result, split_offsets
from minipar.comm.algorithms.ring import begin_reduce_scatter, describe_gather, gather_layout

ALGORITHM = "hierarchical"


@functools.lru_cache(maxsize=64)
def layout(nodes: tuple) -> tuple:
    """(local ranks of each host, deputy[h][q]: the group rank on host h that stands in for
    piece q (its owner when q is on h)) for the group whose rank q is on host nodes[q]."""
    hosts = [[q for q, n in enumerate(nodes) if n == h] for h in range(max(nodes) + 1)]
    local = {q: hosts[n].index(q) for q, n in enumerate(nodes)}
    deputy = tuple(tuple(members[local[q] % len(members)] for q in range(len(nodes))) for members in hosts)
    return tuple(tuple(m) for m in hosts), deputy


def pieces_of(g, rank):
    """The pieces group rank `rank` deputises for (its own among them), in piece order."""
    _, deputy = layout(g.nodes)
    return [q for q in range(g.size) if deputy[g.nodes[rank]][q] == rank]


def _reduce_scatter(c, x, op, res, off):
    """Generator: the two rounds of the reduce-scatter; this rank's piece summed into res."""
    g = c.g
    r, me, hosts = g.rank, g.node, layout(g.nodes)[0]
    mine_of = {q: pieces_of(g, q) for q in hosts[me]}          # what each local rank deputises for
    mine = mine_of[r]
    peers = [q for q in hosts[me] if q != r]
    size = sum(off[q + 1] - off[q] for q in mine)
    got = c.buffer(0, (len(peers), size), x.dtype)
    reqs = []
    for i, q in enumerate(peers):                              # round 1: inside the host
        reqs += c.irecv(1, got[i], q)
        reqs += c.isend(1, np.concatenate([x[off[a]:off[a + 1]] for a in mine_of[q]]), q)
    yield reqs
    acc = np.concatenate([x[off[a]:off[a + 1]] for a in mine])
    for i in range(len(peers)):                                # local-rank order
        op(acc, got[i], out=acc)
    at, start = {}, 0
    for a in mine:
        at[a] = acc[start:start + off[a + 1] - off[a]]
        start += off[a + 1] - off[a]
    _, deputy = layout(g.nodes)
    others = [h for h in range(g.n_nodes) if h != me]
    theirs = c.buffer(1, (len(others), off[r + 1] - off[r]), x.dtype)
    reqs = []
    for i, h in enumerate(others):                             # round 2: across hosts
        reqs += c.irecv(2, theirs[i], deputy[h][r])
    for a in mine:
        if a != r:
            reqs += c.isend(2, at[a], a)
    yield reqs
    parts = [at[r] if h == me else theirs[others.index(h)] for h in range(g.n_nodes)]
    res[...] = parts[0]
    for part in parts[1:]:                                     # host order
        op(res, part, out=res)
    return res


def _all_gather(c, out, off, mine=None, step=1):
    """Generator: the two rounds (numbered step, step + 1) of the all-gather into out (this
    rank's piece: mine, or already in out[off[r]:off[r+1]])."""
    g = c.g
    r, me = g.rank, g.node
    hosts, deputy = layout(g.nodes)
    if mine is not None:
        out[off[r]:off[r + 1]] = mine
    reqs = []
    held = pieces_of(g, r)
    for a in held:                                             # round 1: owners to deputies
        if a != r:
            reqs += c.irecv(step, out[off[a]:off[a + 1]], a)
    for h in range(g.n_nodes):
        if h != me:
            reqs += c.isend(step, out[off[r]:off[r + 1]], deputy[h][r])
    yield reqs
    peers = [q for q in hosts[me] if q != r]
    bufs = {q: np.empty(sum(off[a + 1] - off[a] for a in pieces_of(g, q)), out.dtype) for q in peers}
    send = np.concatenate([out[off[a]:off[a + 1]] for a in held])
    reqs = []
    for q in peers:                                            # round 2: inside the host
        reqs += c.irecv(step + 1, bufs[q], q)
        reqs += c.isend(step + 1, send, q)
    yield reqs
    for q in peers:
        start = 0
        for a in pieces_of(g, q):
            n = off[a + 1] - off[a]
            out[off[a]:off[a + 1]] = bufs[q][start:start + n]
            start += n
    return out


def _all_reduce(c, x, op, res):
    out = res if res.ndim == 1 else res.reshape(-1)
    p, r = c.g.size, c.g.rank
    if p == 1 or x.size == 0:
        out[...] = x
        return res
    off = split_offsets(x.size, p)
    piece = np.empty(off[r + 1] - off[r], x.dtype)             # x may be out: keep it whole
    yield from _reduce_scatter(c, x, op, piece, off)
    yield from _all_gather(c, out, off, mine=piece, step=3)
    return res


def start_reduce_scatter(g, x, op, out=None):
    c, f, flat, res, off = begin_reduce_scatter(g, x, op, out, 2, ALGORITHM)
    return c, _reduce_scatter(c, flat, f, res, off)


def reduce_scatter(g, x, op="sum", *, out=None):
    """Hierarchical reduce-scatter: rank r gets piece r of the sum, as every reduce-scatter."""
    return run(*start_reduce_scatter(g, x, op, out))


def start_all_gather(g, x, sizes, out=None):
    x = array(x)
    off = gather_layout(g, x.size, sizes)
    res = result(out, (off[-1],), x.dtype, "all_gather")
    c = g.begin("all_gather", 2, describe_gather(x, sizes) if g.debug else None, ALGORITHM)
    return c, _all_gather(c, res, off, mine=x.ravel())


def all_gather(g, x, sizes=None, *, out=None):
    """Hierarchical all-gather: the concatenation of every rank's x.ravel(), in rank order."""
    return run(*start_all_gather(g, x, sizes, out))


def start_all_reduce(g, x, op, out=None):
    f = reduce_op(op)
    x = array(x)
    res = result(out, x.shape, x.dtype, "all_reduce")
    c = g.begin("all_reduce", 4, describe(x, op=op) if g.debug else None, ALGORITHM)
    return c, _all_reduce(c, x.ravel(), f, res)


def all_reduce(g, x, op="sum", *, out=None):
    """Hierarchical all-reduce: reduce-scatter, then all-gather, each inside and across hosts."""
    return run(*start_all_reduce(g, x, op, out))
