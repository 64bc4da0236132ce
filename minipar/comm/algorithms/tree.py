"""Rooted collectives: broadcast, reduce, scatter, gather on binomial trees (pipelined
chains for large broadcasts and reductions).

Ranks are renumbered relative to the root, v = (rank - root) % p, and sit in a binomial
tree: v's parent is v minus its lowest set bit, its children are v + m for m = half that bit,
..., 2, 1 (the root's: m = 2^(L-1), ..., 1 with L = ceil(log2 p)) while v + m < p. The subtree
under child v + m is the m relative ranks v + m ... v + 2m - 1 (cut at p). Every rank is
reached in L steps: at step k the ranks that already have the data send it one power of two
further.

broadcast, binomial:  L steps, the whole message on each edge.
    time L * (alpha + b * beta); bytes sent: b per child (the root sends L * b)
broadcast, pipelined chain (large b): cut the message into segments of s bytes; relative
    rank v receives segment k from v-1 and forwards it to v+1 while segment k+1 arrives.
    time (p - 2 + b/s) * (alpha + s * beta) ~ b * beta for b >> p*s; bytes sent: b per rank
reduce, binomial: the broadcast tree run backwards; each rank reduces what its children
    send into its own x and sends the sum to its parent.
    time L * (alpha + b * beta + b * gamma)
reduce, pipelined chain (large b): segment k flows p-1 -> p-2 -> ... -> 0, each rank adding
    its own segment on the way.  time ~ b * (beta + gamma) + (p - 2) * s * (beta + gamma)
scatter, binomial: the root sends each child the pieces of that child's whole subtree
    (np.array_split pieces, in relative order), which it passes on the same way.
    time L * alpha + (p-1)/p * b * beta; the root sends (p-1)/p * b
gather, binomial: scatter backwards; the root receives (p-1)/p * b.

broadcast and scatter first send the dtype and shape down the tree in a 128-byte header
(the other ranks pass x=None, or anything: it is ignored). reduce and gather return None
on the other ranks.
"""
import numpy as np

from minipar.comm.calls import run
from minipar.comm.helpers import array, check_rank, describe, reduce_op, split_offsets
from minipar.comm.protocol import HEADER_BYTES, decode_header, encode_header
from minipar.comm.algorithms.ring import gather_layout

# Measured crossovers (scripts/bench_collectives.py --crossover, p = 3 and 4): above these,
# a pipelined chain instead of the binomial tree.
BROADCAST_TREE_MAX_BYTES = 8 << 20   # the chain won from 16 MiB at p = 4, never at p = 3
REDUCE_TREE_MAX_BYTES = 64 << 10     # the chain won from 128 KiB at p = 3 and 4
CHAIN_SEGMENT_BYTES = 1 << 18        # pipelined chains move 256 KiB segments


def _children(v, p):
    """Relative ranks of v's children, largest subtree first, and the m of each."""
    m = (v & -v) >> 1 if v else 1 << ((p - 1).bit_length() - 1) if p > 1 else 0
    kids = []
    while m:
        if v + m < p:
            kids.append((v + m, m))
        m >>= 1
    return kids


def _down(c, buf, root, first_step):
    """Generator: binomial broadcast of buf (already filled on the root) to every rank."""
    p, r = c.g.size, c.g.rank
    v = (r - root) % p
    L = (p - 1).bit_length()
    if v:
        low = v & -v
        yield c.irecv(first_step + L - low.bit_length(), buf, (v - low + root) % p)
    reqs = []
    for kid, m in _children(v, p):              # post every send, largest subtree first
        reqs += c.isend(first_step + L - m.bit_length(), buf, (kid + root) % p)
    yield reqs


def _segments(n, itemsize):
    seg = max(1, CHAIN_SEGMENT_BYTES // max(itemsize, 1))
    return [(a, min(a + seg, n)) for a in range(0, n, seg)]


def _chain_down(c, buf, root, first_step):
    """Generator: pipelined chain broadcast root -> root+1 -> ... in segments."""
    p, r = c.g.size, c.g.rank
    v = (r - root) % p
    prev, nxt = (r - 1) % p, (r + 1) % p
    segs = _segments(buf.size, buf.itemsize)
    sends, recv = [], []
    if v:                                       # segment k arrives at step v + k
        a, b = segs[0]
        recv = c.irecv(first_step + v - 1, buf[a:b], prev)
    for k, (a, b) in enumerate(segs):
        if v:
            nxt_recv = []
            if k + 1 < len(segs):               # post the next receive before waiting
                a2, b2 = segs[k + 1]
                nxt_recv = c.irecv(first_step + v + k, buf[a2:b2], prev)
            yield recv
            recv = nxt_recv
        if v < p - 1:
            sends += c.isend(first_step + v + k, buf[a:b], nxt)
    yield sends


def _bcast(c, x, root):
    p, r = c.g.size, c.g.rank
    L = (p - 1).bit_length()
    header = encode_header(x) if r == root else np.empty(HEADER_BYTES, np.uint8)
    yield from _down(c, header, root, 1)        # steps 1..L: dtype and shape
    dtype, shape = decode_header(header)
    if r == root:
        out = x.copy()
    else:
        out = np.empty(shape, dtype)
    flat = out.reshape(-1)
    if flat.nbytes > BROADCAST_TREE_MAX_BYTES and p > 2 and flat.size:
        c.nsteps = L + len(_segments(flat.size, flat.itemsize)) + p - 2
        c.algorithm = "binomial tree, then a pipelined chain"
        yield from _chain_down(c, flat, root, L + 1)
    else:
        c.nsteps = 2 * L
        yield from _down(c, flat, root, L + 1)
    return out


def broadcast(g, x, root=0):
    """Every rank gets a copy of the root's x (x is ignored on the other ranks)."""
    root = check_rank(g, root, "root")
    x = array(x) if g.rank == root else None
    c = g.begin("broadcast", 2 * (g.size - 1).bit_length(),
                describe(None, root=root) if g.debug else None, "binomial tree")
    return run(c, _bcast(c, x, root))


def _up(c, x, out, op, root):
    """Generator: binomial reduce of flat x; out (root and inner ranks) gets the sum."""
    p, r = c.g.size, c.g.rank
    v = (r - root) % p
    mine = x
    if out is not None:
        tmp = np.empty_like(x)
        for kid, m in reversed(_children(v, p)):      # smallest subtree first: ready first
            yield c.irecv(m.bit_length(), tmp, (kid + root) % p)
            op(mine, tmp, out=out)
            mine = out
    if v:
        low = v & -v
        yield c.isend(low.bit_length(), mine, (v - low + root) % p)
    return mine


def _chain_up(c, x, out, op, root):
    """Generator: pipelined chain reduce, segments flowing root+p-1 -> ... -> root."""
    p, r = c.g.size, c.g.rank
    v = (r - root) % p
    prev, nxt = (r + 1) % p, (r - 1) % p              # receive from v+1, send to v-1
    segs = _segments(x.size, x.itemsize)
    last = p - 1
    if v == last:                                     # the tail just sends its x
        sends = []
        for k, (a, b) in enumerate(segs):
            sends += c.isend(1 + k, x[a:b], nxt)
        yield sends
        return x
    tmp = np.empty((2, segs[0][1] - segs[0][0]), x.dtype)
    step0 = last - v                                  # segment k arrives at step0 + k
    a, b = segs[0]
    recv = c.irecv(step0, tmp[0, :b - a], prev)
    sends = []
    for k, (a, b) in enumerate(segs):
        nxt_recv = []
        if k + 1 < len(segs):
            a2, b2 = segs[k + 1]
            nxt_recv = c.irecv(step0 + k + 1, tmp[(k + 1) % 2, :b2 - a2], prev)
        yield recv
        recv = nxt_recv
        op(tmp[k % 2, :b - a], x[a:b], out=out[a:b])
        if v:
            sends += c.isend(step0 + k + 1, out[a:b], nxt)
    yield sends
    return out


def reduce(g, x, root=0, op="sum"):
    """The root gets op over every rank's x (same shape); the other ranks get None."""
    root = check_rank(g, root, "root")
    f = reduce_op(op)
    x = array(x)
    p = g.size
    chain = x.nbytes > REDUCE_TREE_MAX_BYTES and p > 2
    nsteps = len(_segments(x.size, x.itemsize)) + p - 2 if chain else (p - 1).bit_length()
    c = g.begin("reduce", nsteps, describe(x, root=root, op=op) if g.debug else None,
                "pipelined chain" if chain else "binomial tree")
    return run(c, _reduce(c, x, f, root, chain))


def _reduce(c, x, f, root, chain):
    p, r = c.g.size, c.g.rank
    xf = x.ravel()
    if p == 1 or xf.size == 0:
        return x.copy() if r == root else None
    v = (r - root) % p
    if chain:
        out = np.empty_like(xf) if v < p - 1 else None
        yield from _chain_up(c, xf, out, f, root)
    else:
        inner = bool(_children(v, p))
        out = np.empty_like(xf) if inner else None
        yield from _up(c, xf, out, f, root)
    return out.reshape(x.shape) if r == root else None


def _subtree_offsets(sizes_rel):
    off = [0]
    for s in sizes_rel:
        off.append(off[-1] + s)
    return off


def _scatter(c, x, root):
    p, r = c.g.size, c.g.rank
    L = (p - 1).bit_length()
    v = (r - root) % p
    header = encode_header(x.reshape(-1)) if r == root else np.empty(HEADER_BYTES, np.uint8)
    yield from _down(c, header, root, 1)              # steps 1..L: dtype and total size
    dtype, (n,) = decode_header(header)
    off = split_offsets(n, p)
    rel = _subtree_offsets([off[(k + root) % p + 1] - off[(k + root) % p] for k in range(p)])
    kids = _children(v, p)
    end = min(v + ((v & -v) if v else p), p)          # my subtree: relative ranks v .. end-1
    if r == root:
        xf = x.reshape(-1)
        buf = xf if root == 0 else np.concatenate((xf[off[root]:], xf[:off[root]]))
    else:
        buf = np.empty(rel[end] - rel[v], dtype)
        low = v & -v
        yield c.irecv(L + L - low.bit_length() + 1, buf, (v - low + root) % p)
    reqs = []
    for kid, m in kids:
        a, b = rel[kid] - rel[v], rel[min(kid + m, p)] - rel[v]
        reqs += c.isend(L + L - m.bit_length() + 1, buf[a:b], (kid + root) % p)
    yield reqs
    mine = buf[:rel[v + 1] - rel[v]]
    return mine.copy() if (r == root or mine.size != buf.size) else mine


def scatter(g, x, root=0):
    """Rank i gets piece i of np.array_split(x.ravel(), p) of the root's x (ignored elsewhere)."""
    root = check_rank(g, root, "root")
    x = array(x) if g.rank == root else None
    c = g.begin("scatter", 2 * (g.size - 1).bit_length(),
                describe(None, root=root) if g.debug else None, "binomial tree")
    return run(c, _scatter(c, x, root))


def _gather(c, x, off, root):
    p, r = c.g.size, c.g.rank
    v = (r - root) % p
    rel = _subtree_offsets([off[(k + root) % p + 1] - off[(k + root) % p] for k in range(p)])
    kids = _children(v, p)
    end = min(v + ((v & -v) if v else p), p)
    if kids:
        buf = np.empty(rel[end] - rel[v], x.dtype)
        buf[:x.size] = x
        reqs = []
        for kid, m in kids:                           # children's subtrees into their places
            a, b = rel[kid] - rel[v], rel[min(kid + m, p)] - rel[v]
            reqs += c.irecv(m.bit_length(), buf[a:b], (kid + root) % p)
        yield reqs
    else:
        buf = x
    if v:
        low = v & -v
        yield c.isend(low.bit_length(), buf, (v - low + root) % p)
        return None
    if root == 0:
        return buf if kids else buf.copy()
    out = np.empty(off[-1], x.dtype)                  # un-rotate: root's piece came first
    head = off[-1] - off[root]
    out[off[root]:] = buf[:head]
    out[:off[root]] = buf[head:]
    return out


def gather(g, x, root=0, sizes=None):
    """The root gets the concatenation of every rank's x.ravel() (None elsewhere).

    sizes: element count of each rank's x when they differ; None: all like this rank's.
    """
    root = check_rank(g, root, "root")
    x = array(x)
    off = gather_layout(g, x.size, sizes)
    c = g.begin("gather", (g.size - 1).bit_length(),
                describe(None, root=root, dtype=x.dtype,
                         sizes=list(sizes) if sizes is not None else f"equal, n={x.size}")
                if g.debug else None, "binomial tree")
    return run(c, _gather(c, x.ravel(), off, root))
