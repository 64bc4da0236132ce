"""Ring reduce-scatter, all-gather and all-reduce: the bandwidth-optimal algorithms.

The p ranks sit in a circle; rank r only ever sends to its right neighbour r+1 and receives
from its left neighbour r-1 (mod p), both at once in every step (Isend + Irecv). The array,
n elements or b bytes, is cut into the p pieces of np.array_split(x.ravel(), p): piece i
belongs to rank i at the end of a reduce-scatter.

reduce-scatter, p-1 steps. At step s = 0, 1, ..., p-2 rank r sends piece (r-s-1) % p (its own
copy at s=0, afterwards the partial sum it just made) and receives piece (r-s-2) % p, to which
it adds its own copy. A partial sum thus travels p-1 hops collecting one term per rank, and
the last piece rank r receives, (r-p) % p = r, is complete.
    bytes sent per rank (p-1)/p * b        time (p-1) * (alpha + b/p * beta + b/p * gamma)

all-gather, p-1 steps. At step s rank r sends piece (r-s) % p and receives piece (r-s-1) % p,
straight into its place in the result: every piece goes once round the ring.
    bytes sent per rank (p-1)/p * b        time (p-1) * (alpha + b/p * beta)

all-reduce = reduce-scatter, then all-gather of the reduced pieces (2(p-1) steps):
    bytes sent per rank 2(p-1)/p * b       time 2(p-1) * alpha + 2(p-1)/p * b * beta
                                                    + (p-1)/p * b * gamma
(alpha: per-message latency, beta: seconds per byte on the wire, gamma: per byte reduced).
The volume term is optimal, which is why rings win for large messages; the 2(p-1) alpha
term is why they lose for small ones (see doubling.py). Each step waits for the previous one,
so on one machine the direct exchange of direct.py, same bytes in one round, is faster; the
ring is what scales to many ranks, talking only to two neighbours (minipar uses it above
direct.DIRECT_MAX_RANKS ranks).

No extra copies: the reduction writes op(received, own piece) straight into the result
(all_reduce) or into the buffer that is sent on next (reduce_scatter); all-gather receives
into slices of the result. The input is only read. All ranks get bit-identical results,
because every piece is reduced once, on one rank, and then copied.
"""
from minipar.comm.calls import run
from minipar.comm.helpers import array, describe, reduce_op, result, split_offsets


def _reduce_scatter(c, x, op, res):
    """Generator: ring reduce-scatter of flat x; this rank's reduced piece goes into res."""
    p, r = c.g.size, c.g.rank
    if p == 1:
        res[...] = x
        return res
    off = split_offsets(x.size, p)
    right, left = (r + 1) % p, (r - 1) % p
    longest = off[1] - off[0]
    bufs = c.buffer(0, (2, longest), x.dtype)                         # receive / send in turn
    j = (r - 1) % p
    send = x[off[j]:off[j + 1]]                                       # own copy of piece r-1
    for s in range(p - 1):
        i = (r - s - 2) % p                                           # piece received now
        recv = bufs[s % 2][:off[i + 1] - off[i]]
        yield c.sendrecv(s + 1, send, right, recv, left)
        last = s == p - 2                                             # then i == r
        op(recv, x[off[i]:off[i + 1]], out=res if last else recv)
        send = recv
    return res


def _all_gather(c, out, off, first_step=1):
    """Generator: ring all-gather in place; out[off[r]:off[r+1]] holds this rank's piece."""
    p, r = c.g.size, c.g.rank
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):
        i, j = (r - s) % p, (r - s - 1) % p                           # send piece i, get j
        yield c.sendrecv(first_step + s, out[off[i]:off[i + 1]], right,
                         out[off[j]:off[j + 1]], left)
    return out


def _all_reduce(c, x, op, res):
    """Generator: ring all-reduce of flat x into res (any shape; may be x itself)."""
    p, r = c.g.size, c.g.rank
    n = x.size
    if p == 1 or n == 0:
        res[...] = x.reshape(res.shape)
        return res
    out = res if res.ndim == 1 else res.reshape(-1)
    off = split_offsets(n, p)
    right, left = (r + 1) % p, (r - 1) % p
    tmp = c.buffer(0, (off[1] - off[0],), x.dtype)
    j = (r - 1) % p
    send = x[off[j]:off[j + 1]]                                       # own copy of piece r-1
    for s in range(p - 1):                                            # reduce-scatter
        i = (r - s - 2) % p
        piece = out[off[i]:off[i + 1]]
        recv = tmp[:piece.size]
        yield c.sendrecv(s + 1, send, right, recv, left)
        op(recv, x[off[i]:off[i + 1]], out=piece)
        send = piece
    yield from _all_gather(c, out, off, first_step=p)                 # all-gather
    return res


def gather_layout(g, n, sizes):
    """Element offsets of each rank's piece in an all-gather result (sizes None: all n)."""
    if sizes is None:
        return [i * n for i in range(g.size + 1)]
    sizes = [int(s) for s in sizes]
    if len(sizes) != g.size:
        raise ValueError(f"sizes has {len(sizes)} entries for a group of {g.size} ranks")
    if sizes[g.rank] != n:
        raise ValueError(f"rank {g.rank}: x has {n} elements but sizes[{g.rank}] = "
                         f"{sizes[g.rank]}")
    off = [0]
    for s in sizes:
        off.append(off[-1] + s)
    return off


def _all_gather_into(c, x, off, res):
    """Generator: ring all-gather of flat x into res, laid out by off."""
    r = c.g.rank
    res[off[r]:off[r + 1]] = x
    return (yield from _all_gather(c, res, off))


# Public functions: start the call (call number, debug agreement), then run the generator
# to the end (blocking) or hand it to a Handle (non-blocking). `out`, if given, receives the
# result (for all_reduce it may be x itself: in place).

def start_all_reduce(g, x, op, out=None):
    f = reduce_op(op)
    x = array(x)
    res = result(out, x.shape, x.dtype, "all_reduce")
    c = g.begin("all_reduce", 2 * (g.size - 1), describe(x, op=op) if g.debug else None, "ring")
    return c, _all_reduce(c, x.ravel(), f, res)


def all_reduce(g, x, op="sum", *, out=None):
    """Ring all-reduce: every rank gets op over all ranks' x (same shape as x)."""
    return run(*start_all_reduce(g, x, op, out))


def begin_reduce_scatter(g, x, op, out, nsteps, algorithm="ring"):
    """What every reduce-scatter starts with: the ufunc, the np.array_split offsets, this
    rank's result piece (out or new) and the Call. -> (c, f, flat x, res, off)"""
    f = reduce_op(op)
    x = array(x)
    off = split_offsets(x.size, g.size)
    res = result(out, (off[g.rank + 1] - off[g.rank],), x.dtype, "reduce_scatter")
    c = g.begin("reduce_scatter", nsteps, describe(x, op=op) if g.debug else None, algorithm)
    return c, f, x.ravel(), res, off


def start_reduce_scatter(g, x, op, out=None):
    c, f, flat, res, _ = begin_reduce_scatter(g, x, op, out, g.size - 1)
    return c, _reduce_scatter(c, flat, f, res)


def reduce_scatter(g, x, op="sum", *, out=None):
    """Ring reduce-scatter: rank r gets piece r of np.array_split(op over ranks of x, p)."""
    return run(*start_reduce_scatter(g, x, op, out))


def describe_gather(x, sizes):
    return describe(None, dtype=x.dtype, sizes=list(sizes) if sizes is not None else "equal",
                    **({} if sizes is not None else {"n": x.size}))


def start_all_gather(g, x, sizes, out=None):
    x = array(x)
    off = gather_layout(g, x.size, sizes)
    res = result(out, (off[-1],), x.dtype, "all_gather")
    c = g.begin("all_gather", g.size - 1, describe_gather(x, sizes) if g.debug else None, "ring")
    return c, _all_gather_into(c, x.ravel(), off, res)


def all_gather(g, x, sizes=None, *, out=None):
    """Ring all-gather: the concatenation of every rank's x.ravel(), in rank order.

    sizes: element count of each rank's x when they differ (for example the pieces a
    reduce_scatter returned); None means every rank's x has as many elements as this one's.
    """
    return run(*start_all_gather(g, x, sizes, out))
