"""Straight-line fast paths: the blocking all_reduce, reduce_scatter and all_gather,
written as plain functions instead of generators. Read ring.py, doubling.py and direct.py
first: this file adds no algorithm, only a faster way to run three of theirs.

What it is. The general algorithms (doubling.py, direct.py, ring.py) are generators, so that
one piece of code runs either blocking (`run`) or a step at a time (`Handle`, for
all_reduce_async & co.). Each function here sends exactly the same messages as its general
twin (same peers, sizes, steps, tags, ledger entries and trace lines) but runs straight
through: post one step's Isend/Irecv, `c.wait` for them, reduce, next step. Nothing else
differs: timeouts, MINIPAR_TRACE and MINIPAR_DEBUG live in `Call` (calls.py) and work the
same; receive buffers are the group's reused scratch (Group.scratch).

    all_reduce_into          recursive doubling, as doubling.all_reduce (fix-up steps when p
                             is not a power of 2)
    all_reduce_direct_into   direct exchange, as direct.all_reduce: reduce-scatter round, then
                             all-gather round
    reduce_scatter_into      direct exchange, as direct.reduce_scatter: one round of p-1
                             messages each way
    all_gather_into          direct exchange, as direct.all_gather, or Bruck's algorithm, as
                             doubling.all_gather (bruck=True)

The ring has no straight-line version (above direct.DIRECT_MAX_RANKS ranks the blocking calls
run ring.py's generators), nor do the rooted collectives of tree.py.

Why it exists. For a message of a few KiB the wire time is a microsecond or two, and what a
call costs is the Python around it: resuming a generator, catching its StopIteration and
building request lists step by step cost a few microseconds per call, as much as MPICH's
whole collective at 4 KiB. With 4 ranks on 2 cores each microsecond of CPU is paid about
twice, since the rank we wait for needs our core.

When it runs: minipar/comm/__init__.py sends the blocking calls here whenever their
algorithm has a version here: recursive-doubling all-reduces up to SMALL_MAX_BYTES, Bruck
all-gathers, and direct exchange at any size (one or two rounds; measured faster than the
generator at 1 MiB too, see the comment on SMALL_MAX_BYTES). The non-blocking calls
(all_reduce_async, ...) always take the general path. tests/mpi/test_comm_features.py checks
that both paths give the same results, ledger and trace lines.
"""
from minipar.comm.helpers import describe, reduce_op, result, split_offsets
from minipar.comm.algorithms.doubling import all_reduce_steps, bruck_offsets
from minipar.comm.algorithms.ring import describe_gather, gather_layout


def all_reduce_into(g, x, op, out):
    """Recursive-doubling all-reduce (as doubling.all_reduce) into out, or a new array."""
    f = reduce_op(op)
    res = result(out, x.shape, x.dtype, "all_reduce")
    p, r = g.size, g.rank
    c = g.begin("all_reduce", all_reduce_steps(p), describe(x, op=op) if g.debug else None,
                "recursive doubling")
    xf = x.ravel()
    flat = res if res.ndim == 1 else res.reshape(-1)
    if p == 1 or xf.size == 0:
        flat[...] = xf
        c.done()
        return res
    q = 1 << (p.bit_length() - 1)               # largest power of two <= p
    extra = p - q
    wait = c.wait
    if r >= q:                                  # extra rank: hand x over, get the result back
        wait(c.isend(1, xf, r - q))
        wait(c.irecv(c.nsteps, flat, r - q))
        c.done()
        return res
    tmp = g.scratch(1, (xf.size,), xf.dtype)
    mine, step = xf, 1 if extra else 0          # step 1 is the fix-up, on every rank's count
    if r < extra:                               # fix-up: fold in rank r + q's x
        wait(c.irecv(step, tmp, r + q))
        f(mine, tmp, out=flat)
        mine = flat
    mask = 1
    while mask < q:                             # recursive doubling among the q ranks
        step += 1
        partner = r ^ mask
        wait(c.sendrecv(step, mine, partner, tmp, partner))
        f(mine, tmp, out=flat)
        mine = flat
        mask <<= 1
    if r < extra:                               # fix-up: hand the result back
        wait(c.isend(step + 1, flat, r + q))
    c.done()
    return res


def reduce_scatter_into(g, x, op, out):
    """Direct-exchange reduce-scatter (as direct.reduce_scatter): rank r sends piece j of x
    to rank j and reduces the p-1 copies of piece r it receives, in rank order."""
    f = reduce_op(op)
    p, r = g.size, g.rank
    xf = x.ravel()
    off = split_offsets(xf.size, p)
    res = result(out, (off[r + 1] - off[r],), x.dtype, "reduce_scatter")
    c = g.begin("reduce_scatter", 1, describe(x, op=op) if g.debug else None, "direct exchange")
    _reduce_scatter(c, xf, off, res, f, 1)
    c.done()
    return res


def all_reduce_direct_into(g, x, op, out):
    """Direct-exchange all-reduce (as direct.all_reduce): the reduce-scatter round into this
    rank's piece of the result, then the all-gather round of the pieces, in place."""
    f = reduce_op(op)
    res = result(out, x.shape, x.dtype, "all_reduce")      # out may be x: piece r is written
    p, r = g.size, g.rank                                   # only after every send completed
    c = g.begin("all_reduce", 2, describe(x, op=op) if g.debug else None, "direct exchange")
    xf, flat = x.ravel(), res.reshape(-1)
    if p == 1 or xf.size == 0:
        flat[...] = xf
    else:
        off = split_offsets(xf.size, p)
        _reduce_scatter(c, xf, off, flat[off[r]:off[r + 1]], f, 1)
        _all_gather(c, flat, off, None, 2)
    c.done()
    return res


def _reduce_scatter(c, xf, off, res, f, step):
    """One round: piece j of xf to rank j; op over the p copies of piece r into res."""
    p, r = c.g.size, c.g.rank
    mine = xf[off[r]:off[r + 1]]
    if p == 1:
        res[...] = mine
        return
    got = c.g.scratch(0, (p, mine.size), xf.dtype)         # got[j]: rank j's copy of piece r
    reqs = []
    for k in range(1, p):                       # receive from r-1, r-2, ...; send to r+1, ...
        src, dst = (r - k) % p, (r + k) % p
        reqs += c.irecv(step, got[src], src)
        reqs += c.isend(step, xf[off[dst]:off[dst + 1]], dst)
    c.wait(reqs)
    for j in range(p):                          # reduce in rank order, starting from mine
        if j != r:
            f(mine, got[j], out=res)
            mine = res


def _all_gather(c, res, off, mine, step):
    """One round: this rank's piece (mine, or already in place in res) to every rank, and
    theirs into res."""
    p, r = c.g.size, c.g.rank
    send = res[off[r]:off[r + 1]] if mine is None else mine
    reqs = []
    for k in range(1, p):
        src, dst = (r - k) % p, (r + k) % p
        reqs += c.irecv(step, res[off[src]:off[src + 1]], src)
        reqs += c.isend(step, send, dst)
    if reqs:
        c.wait(reqs)
    if mine is not None:                        # the local copy after the wait: this rank
        res[off[r]:off[r + 1]] = mine           # reads its incoming pieces itself (MPICH's
                                                # single-copy CMA), so it polls first


def all_gather_into(g, x, sizes, out, bruck=False):
    """Direct-exchange all-gather (as direct.all_gather), or Bruck's (as doubling.all_gather)."""
    xf = x.ravel()
    off = gather_layout(g, xf.size, sizes)
    res = result(out, (off[-1],), x.dtype, "all_gather")
    p = g.size
    c = g.begin("all_gather", (p - 1).bit_length() if bruck else 1,
                describe_gather(x, sizes) if g.debug else None, "Bruck" if bruck else "direct exchange")
    if bruck:
        _bruck(c, xf, off, res)
    else:
        _all_gather(c, res, off, xf, 1)
    c.done()
    return res


def _bruck(c, x, off, res):
    """Bruck all-gather, blocking: see doubling._all_gather for the layout."""
    p, r = c.g.size, c.g.rank
    n = off[-1]
    rot_off = bruck_offsets(off, p, r)
    rot = c.g.scratch(0, (n,), x.dtype)
    rot[:x.size] = x
    have, step = 1, 0
    while have < p:
        step += 1
        count = min(have, p - have)
        c.wait(c.sendrecv(step, rot[:rot_off[count]], (r - have) % p,
                          rot[rot_off[have]:rot_off[have + count]], (r + have) % p))
        have += count
    head = n - off[r]
    res[off[r]:] = rot[:head]
    res[:off[r]] = rot[head:]
