"""Recursive doubling: the latency-optimal algorithms, for small messages.

all-reduce. With p a power of two, at step k = 0, 1, ... log2(p)-1 rank r swaps its whole
current partial result with partner r XOR 2^k and both reduce: after step k each rank holds
the reduction over a block of 2^(k+1) ranks, after log2(p) steps over all of them.
    bytes sent per rank log2(p) * b        time log2(p) * (alpha + b * beta + b * gamma)
Compare the ring's 2(p-1) * alpha + 2(p-1)/p * b * beta: fewer steps, more bytes. Small
messages are all alpha, so doubling wins below a crossover size and the ring above it
(measured by scripts/bench_collectives.py; the constant is in minipar/comm/__init__.py).

p not a power of two (fix-up step): let q be the largest power of two below p. The p - q
"extra" ranks r >= q first hand their x to rank r - q, which reduces it into its own; the q
remaining ranks do the doubling; at the end rank r - q sends the result back to rank r.
    steps log2(q) + 2, bytes sent per rank log2(q) * b (+ b for ranks in a fix-up pair)

Every rank ends with the bit-identical result: partners reduce the same two operands
(op is commutative), and the extra ranks receive a copy.

reduce-scatter (small): the doubling all-reduce, keeping piece r of np.array_split. It sends
more than the ring (log2(p) * b instead of (p-1)/p * b) in fewer steps.

all-gather (Bruck's algorithm, any p): in ceil(log2 p) steps, at step k rank r sends the
min(2^k, p - 2^k) pieces it has, (its own and those it received), to rank r - 2^k and
receives as many from rank r + 2^k. Pieces collect in rotated order (r, r+1, ...) and are
rotated into rank order at the end, one local copy.
    bytes sent per rank (p-1)/p * b (the same as the ring)   time ceil(log2 p) * alpha + ...
"""
from minipar.comm.calls import run
from minipar.comm.helpers import array, describe, reduce_op, result, split_offsets
from minipar.comm.algorithms.ring import describe_gather, gather_layout


def all_reduce_steps(p):
    q = 1 << (p.bit_length() - 1)
    return q.bit_length() - 1 + (2 if p > q else 0)


def _all_reduce(c, x, op, res):
    """Generator: recursive-doubling all-reduce of flat x into res (may be x itself)."""
    p, r = c.g.size, c.g.rank
    if p == 1 or x.size == 0:
        res[...] = x.reshape(res.shape)
        return res
    q = 1 << (p.bit_length() - 1)               # largest power of two <= p
    extra = p - q
    out = res if res.ndim == 1 else res.reshape(-1)
    if r >= q:                                  # extra rank: hand x over, get the result back
        yield c.isend(1, x, r - q)
        yield c.irecv(c.nsteps, out, r - q)
        return res
    tmp = c.buffer(1, (x.size,), x.dtype)
    mine = x                                    # my partial result so far (x itself: no copy)
    step = 1 if extra else 0                    # step 1 is the fix-up, on every rank's count
    if r < extra:                               # fix-up: fold in rank r + q's x
        yield c.irecv(step, tmp, r + q)
        op(mine, tmp, out=out)
        mine = out
    mask = 1
    while mask < q:                             # recursive doubling among the q ranks
        step += 1
        partner = r ^ mask
        yield c.sendrecv(step, mine, partner, tmp, partner)
        op(mine, tmp, out=out)
        mine = out
        mask <<= 1
    if r < extra:                               # fix-up: hand the result back
        yield c.isend(step + 1, out, r + q)
    return res


def start_all_reduce(g, x, op, out=None):
    f = reduce_op(op)
    x = array(x)
    res = result(out, x.shape, x.dtype, "all_reduce")
    c = g.begin("all_reduce", all_reduce_steps(g.size), describe(x, op=op) if g.debug else None,
                "recursive doubling")
    return c, _all_reduce(c, x.ravel(), f, res)


def all_reduce(g, x, op="sum", *, out=None):
    """Recursive-doubling all-reduce: every rank gets op over all ranks' x."""
    return run(*start_all_reduce(g, x, op, out))


def _reduce_scatter(c, x, op, res):
    off = split_offsets(x.size, c.g.size)
    r = c.g.rank
    full = yield from _all_reduce(c, x, op, c.buffer(0, (x.size,), x.dtype))
    res[...] = full[off[r]:off[r + 1]]
    return res


def start_reduce_scatter(g, x, op, out=None):
    f = reduce_op(op)
    x = array(x)
    off = split_offsets(x.size, g.size)
    res = result(out, (off[g.rank + 1] - off[g.rank],), x.dtype, "reduce_scatter")
    c = g.begin("reduce_scatter", all_reduce_steps(g.size),
                describe(x, op=op) if g.debug else None, "recursive doubling")
    return c, _reduce_scatter(c, x.ravel(), f, res)


def reduce_scatter(g, x, op="sum", *, out=None):
    """Reduce-scatter as a doubling all-reduce that keeps piece r (small messages)."""
    return run(*start_reduce_scatter(g, x, op, out))


def bruck_offsets(off, p, r):
    """Bruck's rotated layout: pieces r, r+1, ..., r+p-1 (mod p) back to back; entry k is
    where the k-th of them starts (off: where each rank's piece starts in the result)."""
    rot_off = [0]
    for k in range(p):
        i = (r + k) % p
        rot_off.append(rot_off[-1] + off[i + 1] - off[i])
    return rot_off


def _all_gather(c, x, off, res):
    """Generator: Bruck all-gather; piece i (rank i's x) goes to res[off[i]:off[i+1]]."""
    p, r = c.g.size, c.g.rank
    n = off[-1]
    rot_off = bruck_offsets(off, p, r)
    rot = c.buffer(0, (n,), x.dtype)
    rot[:x.size] = x
    have, step = 1, 0
    while have < p:
        step += 1
        count = min(have, p - have)             # pieces to pass on this step
        # send my first `count` pieces to rank r - have; rank r + have sends me its first
        # `count`, which are my rotated pieces have .. have + count - 1
        yield c.sendrecv(step, rot[:rot_off[count]], (r - have) % p,
                         rot[rot_off[have]:rot_off[have + count]], (r + have) % p)
        have += count
    head = n - off[r]                           # un-rotate: pieces r..p-1 come first in rot
    res[off[r]:] = rot[:head]
    res[:off[r]] = rot[head:]
    return res


def start_all_gather(g, x, sizes, out=None):
    x = array(x)
    off = gather_layout(g, x.size, sizes)
    res = result(out, (off[-1],), x.dtype, "all_gather")
    c = g.begin("all_gather", (g.size - 1).bit_length(),
                describe_gather(x, sizes) if g.debug else None, "Bruck")
    return c, _all_gather(c, x.ravel(), off, res)


def all_gather(g, x, sizes=None, *, out=None):
    """Bruck all-gather: the concatenation of every rank's x.ravel() (small messages)."""
    return run(*start_all_gather(g, x, sizes, out))
