"""Direct (pairwise) exchange: every rank sends each other rank the piece meant for it.

The ring (ring.py) moves the minimum number of bytes, but in p-1 steps that depend on each
other: a rank can forward a partial sum only after it arrived. Here the same bytes move in
one round: all p-1 sends and p-1 receives of a rank are posted at once and waited for
together, so on one machine (shared memory, several cores) they overlap, and the ranks are
scheduled far fewer times. MPICH's "pairwise" reduce-scatter is the same idea.

reduce-scatter, 1 round. Rank r sends piece j of its x (np.array_split pieces) to rank j, for
every j != r, and receives piece r from every other rank into p-1 buffers; then it reduces
them into its own piece in rank order (the same order every run).
    bytes sent per rank (p-1)/p * b      time ~ alpha + (p-1)/p * b * beta + (p-1)/p * b * gamma
                                         when the p-1 messages overlap; (p-1) * alpha if not
all-gather, 1 round. Rank r sends its piece to every other rank and receives theirs straight
into their places in the result.
    bytes sent per rank (p-1)/p * b      time ~ alpha + (p-1)/p * b * beta
all-reduce = reduce-scatter, then all-gather of the reduced pieces: 2 rounds,
    bytes sent per rank 2(p-1)/p * b (the ring's volume), every rank bit-identical results
    (each piece is reduced once, by its owner, then copied).

The price: each rank talks to all others at once. Across a network with one link per node
the p-1 flows share it (same bytes, no gain) and many small messages pay p-1 alphas; the
ring's two neighbours per rank scale to large p. minipar uses direct exchange for groups of
up to DIRECT_MAX_RANKS ranks (measured on one machine, p <= 4), the ring above.
"""
from minipar.comm.calls import run
from minipar.comm.helpers import array, describe, reduce_op, result, split_offsets
from minipar.comm.algorithms.ring import begin_reduce_scatter, describe_gather, gather_layout

DIRECT_MAX_RANKS = 8


def _reduce_scatter(c, x, op, res, off, step=1):
    """Generator: one round of pairwise exchange; op over every rank's piece r into res."""
    p, r = c.g.size, c.g.rank
    mine = x[off[r]:off[r + 1]]
    if p == 1:
        res[...] = mine
        return res
    got = c.buffer(0, (p, mine.size), x.dtype)  # got[j]: rank j's copy of piece r
    reqs = []
    for k in range(1, p):                       # receive from r-1, r-2, ...; send to r+1, ...
        src, dst = (r - k) % p, (r + k) % p
        reqs += c.irecv(step, got[src], src)
        reqs += c.isend(step, x[off[dst]:off[dst + 1]], dst)
    yield reqs
    for j in range(p):                          # reduce in rank order, starting from mine
        if j != r:
            op(mine, got[j], out=res)
            mine = res
    return res


def _all_gather(c, out, off, step=1, mine=None):
    """Generator: one round; this rank's piece (mine, or already in out[off[r]:off[r+1]])
    goes to every rank, and theirs into out."""
    p, r = c.g.size, c.g.rank
    send = out[off[r]:off[r + 1]] if mine is None else mine
    reqs = []
    for k in range(1, p):
        src, dst = (r - k) % p, (r + k) % p
        reqs += c.irecv(step, out[off[src]:off[src + 1]], src)
        reqs += c.isend(step, send, dst)
    if mine is not None:
        out[off[r]:off[r + 1]] = mine           # the local copy, while the messages travel
    yield reqs
    return out


def _all_reduce(c, x, op, res):
    p, r = c.g.size, c.g.rank
    out = res if res.ndim == 1 else res.reshape(-1)
    if p == 1 or x.size == 0:
        out[...] = x
        return res
    off = split_offsets(x.size, p)
    yield from _reduce_scatter(c, x, op, out[off[r]:off[r + 1]], off, step=1)
    yield from _all_gather(c, out, off, step=2)
    return res


def start_all_reduce(g, x, op, out=None):
    f = reduce_op(op)
    x = array(x)
    res = result(out, x.shape, x.dtype, "all_reduce")   # out may be x: piece r is written
    c = g.begin("all_reduce", 2, describe(x, op=op) if g.debug else None, "direct exchange")
    return c, _all_reduce(c, x.ravel(), f, res)         # only after every send completed


def all_reduce(g, x, op="sum", *, out=None):
    """Direct-exchange all-reduce: reduce-scatter and all-gather, one round each."""
    return run(*start_all_reduce(g, x, op, out))


def start_reduce_scatter(g, x, op, out=None):
    c, f, flat, res, off = begin_reduce_scatter(g, x, op, out, 1, "direct exchange")
    return c, _reduce_scatter(c, flat, f, res, off)


def reduce_scatter(g, x, op="sum", *, out=None):
    """Direct-exchange reduce-scatter: one round of p-1 messages each way."""
    return run(*start_reduce_scatter(g, x, op, out))


def _all_gather_into(c, x, off, res):
    return (yield from _all_gather(c, res, off, mine=x))


def start_all_gather(g, x, sizes, out=None):
    x = array(x)
    off = gather_layout(g, x.size, sizes)
    res = result(out, (off[-1],), x.dtype, "all_gather")
    c = g.begin("all_gather", 1, describe_gather(x, sizes) if g.debug else None, "direct exchange")
    return c, _all_gather_into(c, x.ravel(), off, res)


def all_gather(g, x, sizes=None, *, out=None):
    """Direct-exchange all-gather: one round of p-1 messages each way."""
    return run(*start_all_gather(g, x, sizes, out))
