"""Hierarchical all-to-all, for a group that spans hosts: fewer, larger messages on the link.

An all-to-all moves the same bytes across hosts whatever the algorithm: every piece whose
source and destination sit on different hosts must cross once. What the hierarchy changes is
how many messages carry them. The flat pairwise exchange sends every cross-host piece as a
message of its own, k_h (p - k_h) messages leaving host h (k_h ranks on it, p in the group);
here each host first gathers, inside the host, the pieces bound for each remote rank onto one
of its ranks, which sends them as one message: p - k_h messages leave host h, k_h times
fewer, each k_h times larger. A mixture-of-experts dispatch sends small pieces (a few tokens
per expert), where the link's per-message latency is what costs.

Who forwards what. The hosts, deputies and local ranks are hierarchical.py's (layout): on
host h the deputy of group rank q, deputy[h][q], is local rank (q's local rank mod k_h); a
rank deputises for the remote ranks whose deputy it is. Two rounds (equal pieces):
    1. inside the host: rank s sends each local peer f, as one message, its piece for f and
       its pieces for the remote ranks f deputises for (destination order);
    2. across hosts: each rank sends each remote rank q it deputises for, as one message, the
       pieces for q of every rank of its host (its own among them), in local-rank order.
Rank q then holds its own piece, one piece from each local peer (round 1) and, from each
other host, that host's pieces for it (round 2): it writes them in source-rank order, the
result of every all-to-all.

Bytes per rank, N hosts of k ranks each, n bytes of x (p = Nk pieces of n/p):
                     inside the host       across hosts       messages
    hierarchical     (k-1)/k * n           (N-1)/N * n        (k-1) + (N-1)
    flat pairwise    (k-1)/p * n           (N-1)/N * n        p - 1
the same bytes across hosts, (N-1)/N * n, in N-1 messages instead of k(N-1); inside the host
N times the pairwise's bytes, since each rank forwards its peers' pieces. `bytes_sent` below
is the home of these figures for any layout (hosts of different sizes included) and any
piece sizes, and tests/mpi/test_hierarchical_alltoall.py holds the ledger to it. With hosts
of different sizes the bytes across stay the flat exchange's host by host, not rank by rank
(on 2 + 1, the first host's rank 0 forwards both its pieces for the lone rank).

Variable sizes (sizes=): the counts go first, by the same two rounds on one int64 per piece
(what a rank forwards in round 2 is exactly what it learnt in round 1), then the rows, the
same two rounds again: 4 steps; an empty piece is no message, a message of empty pieces
neither.
"""
import functools

import numpy as np

from minipar.comm.algorithms.alltoall import _describe, _offsets, check_args
from minipar.comm.calls import run
from minipar.comm.helpers import array
from minipar.comm.algorithms.hierarchical import layout

ALGORITHM = "hierarchical"


def plan(nodes, r):
    """Rank r's routes in a group whose rank q sits on host nodes[q]:
    (peers: the other ranks on r's host, in local-rank order;
     carry[f]: for each local rank f (r too), the destinations whose pieces go to f in round 1:
               f itself, then the remote ranks f deputises for;
     hosts[h]: the ranks of host h, in order: the pieces for r from host h arrive together,
               from r's deputy there, in this order)."""
    hosts, deputy = layout(nodes)
    me = nodes[r]
    local = hosts[me]
    carry = {f: [f] + [q for q in range(len(nodes)) if nodes[q] != me and deputy[me][q] == f]
             for f in local}
    return [f for f in local if f != r], carry, hosts


def sends(nodes, r, piece_bytes):
    """(peer, bytes) of every message group rank r sends, round 1 then round 2 (an empty one
    included: comm posts none): piece_bytes is the bytes of every piece (equal split), or
    B[s][q], the bytes of rank s's piece for q. Round 1 carries r's pieces for each peer and
    the remote ranks that peer deputises for; round 2 every local rank's piece for each
    remote rank r deputises for."""
    peers, carry, hosts = plan(nodes, r)
    B = (lambda s, q: piece_bytes) if np.isscalar(piece_bytes) else (lambda s, q: int(piece_bytes[s][q]))
    return ([(f, sum(B(r, q) for q in carry[f])) for f in peers]
            + [(q, sum(B(s, q) for s in hosts[nodes[r]])) for q in carry[r][1:]])


def bytes_sent(nodes, r, piece_bytes):
    """(bytes inside the host, bytes across hosts) group rank r sends (sends' messages;
    variable sizes: this for the rows, plus this with 8-byte pieces for the counts)."""
    out = sends(nodes, r, piece_bytes)
    return (sum(n for q, n in out if nodes[q] == nodes[r]), sum(n for q, n in out if nodes[q] != nodes[r]))


def messages(nodes, r):
    """(messages inside the host, messages across hosts) group rank r sends, no piece empty."""
    out = sends(nodes, r, 1)
    return (sum(nodes[q] == nodes[r] for q, _ in out), sum(nodes[q] != nodes[r] for q, _ in out))


def _route(c, piece, size, out_piece, first_step):
    """Generator: the two rounds, piece by piece (the variable sizes; the equal split takes
    _equal, the same routes on index arrays). piece(q): my flat piece for q; size(s, q): elements of s's
    piece for q, asked where this rank can know it (s on my host, or q = me);
    out_piece(s): where s's piece for me goes. Returns held[(s, q)]: s's piece for each remote
    q I deputise for (round 1's cargo, what round 2 forwards)."""
    g = c.g
    r = g.rank
    peers, carry, hosts = plan(g.nodes, r)
    mine = carry[r]                                     # me, then those I deputise for
    got = {s: np.empty(sum(size(s, q) for q in mine), piece.dtype) for s in peers}
    reqs = []
    for s in peers:                                     # round 1: inside the host
        reqs += c.irecv(first_step, got[s], s)
        reqs += c.isend(first_step, _cat([piece(q) for q in carry[s]], piece), s)
    yield reqs
    held = {}
    for s in peers:
        start = 0
        for q in mine:
            n = size(s, q)
            held[s, q] = got[s][start:start + n]
            start += n
    out_piece(r)[...] = piece(r)
    for s in peers:
        out_piece(s)[...] = held.pop((s, r))
    local = hosts[g.node]
    remote_hosts = [h for h in range(g.n_nodes) if h != g.node]
    _, deputy = layout(g.nodes)
    bufs = {h: np.empty(sum(size(s, r) for s in hosts[h]), piece.dtype) for h in remote_hosts}
    reqs = []
    for h in remote_hosts:                              # round 2: across hosts
        reqs += c.irecv(first_step + 1, bufs[h], deputy[h][r])
    for q in mine[1:]:
        reqs += c.isend(first_step + 1,
                        _cat([piece(q) if s == r else held[s, q] for s in local], piece), q)
    yield reqs
    for h in remote_hosts:
        start = 0
        for s in hosts[h]:
            n = size(s, r)
            out_piece(s)[...] = bufs[h][start:start + n]
            start += n
    return held


def _cat(parts, piece):
    return np.concatenate(parts) if parts else np.empty(0, piece.dtype)


@functools.lru_cache(maxsize=256)
def equal_routes(nodes, r):
    """plan()'s routes as index arrays, for the equal split: (carry[s] for each peer s,
    my destinations (me first), the local rank index of each local rank, and for each other
    host: (its ranks, my deputy there, the slice of those ranks when they are consecutive))."""
    peers, carry, hosts = plan(nodes, r)
    local = hosts[nodes[r]]
    _, deputy = layout(nodes)
    remote = []
    for h, ranks in enumerate(hosts):
        if h != nodes[r]:
            run_ = slice(ranks[0], ranks[-1] + 1) if ranks == list(range(ranks[0], ranks[-1] + 1)) else None
            remote.append((np.array(ranks, np.intp), deputy[h][r], run_))
    return ({s: np.array(carry[s], np.intp) for s in peers}, np.array(carry[r], np.intp),
            {s: i for i, s in enumerate(local)}, np.array(local, np.intp), remote)


def _equal(c, x, res, return_sizes):
    """Generator: _route's two rounds for p equal pieces of w elements, on index arrays: round 1
    lands in G (local rank, my destination, w), whose column j is round 2's message for my
    j-th destination (G[:, 0]: every local rank's piece for me)."""
    g = c.g
    p, r = g.size, g.rank
    w = x.size // p
    X, D = x.reshape(p, w), res.reshape(p, w)
    carry, mine, at, local, remote = equal_routes(g.nodes, r)
    G = c.buffer(0, (len(local), len(mine), w), x.dtype)
    X.take(mine, 0, G[at[r]])
    reqs = []
    for s, dest in carry.items():                       # round 1: inside the host
        reqs += c.irecv(1, G[at[s]].reshape(-1), s)
        reqs += c.isend(1, X.take(dest, 0).reshape(-1), s)
    yield reqs
    D[local] = G[:, 0]
    reqs, bufs = [], []
    for ranks, deputy, run_ in remote:                  # round 2: across hosts
        buf = D[run_] if run_ is not None else np.empty((len(ranks), w), x.dtype)
        bufs.append((ranks, buf, run_))
        reqs += c.irecv(2, buf.reshape(-1), deputy)
    for j in range(1, len(mine)):
        reqs += c.isend(2, np.ascontiguousarray(G[:, j]).reshape(-1), mine[j])
    yield reqs
    for ranks, buf, run_ in bufs:
        if run_ is None:
            D[ranks] = buf
    return (res, [x.shape[0] // p] * p) if return_sizes else res


class _Pieces:
    """piece(q) -> row q of a (p, w) array, with the dtype the buffers need."""

    def __init__(self, rows, off=None):
        self.rows, self.off, self.dtype = rows, off, rows.dtype

    def __call__(self, q):
        if self.off is None:
            return self.rows[q]
        return self.rows[self.off[q]:self.off[q + 1]]


def _variable(c, x, counts, return_sizes):
    """Generator: the counts (the two rounds on one int64 per piece), then the rows."""
    p = c.g.size
    rest = x.shape[1:]
    row = int(np.prod(rest, dtype=np.int64))
    mine = np.array(counts, np.int64).reshape(p, 1)
    theirs = np.empty((p, 1), np.int64)                 # theirs[s]: rows s sends me
    held = yield from _route(c, _Pieces(mine), lambda s, q: 1, theirs.__getitem__, 1)
    r = c.g.rank
    got = [int(s) for s in theirs[:, 0]]

    def size(s, q):                                     # elements of s's piece for q
        if q == r:
            return got[s] * row
        if s == r:
            return counts[q] * row
        return int(held[s, q][0]) * row

    res = np.empty((sum(got),) + rest, x.dtype)
    roff = _offsets(got, row)
    flat = res.reshape(-1)
    yield from _route(c, _Pieces(x.ravel(), _offsets(counts, row)), size,
                      lambda s: flat[roff[s]:roff[s + 1]], 3)
    return (res, got) if return_sizes else res


def start_all_to_all(g, x, sizes=None, out=None, return_sizes=False):
    x = array(x)
    counts, res = check_args(g, x, sizes, out)
    if counts is not None:
        c = g.begin("all_to_all", 4, _describe(x, sizes) if g.debug else None, ALGORITHM)
        return c, _variable(c, np.ascontiguousarray(x), counts, return_sizes)
    c = g.begin("all_to_all", 2, _describe(x, None) if g.debug else None, ALGORITHM)
    return c, _equal(c, np.ascontiguousarray(x), res, return_sizes)


def all_to_all(g, x, sizes=None, *, out=None, return_sizes=False):
    """Hierarchical all-to-all (minipar.comm.all_to_all's semantics): inside each host, then
    one message per remote rank and host across."""
    return run(*start_all_to_all(g, x, sizes, out, return_sizes))
