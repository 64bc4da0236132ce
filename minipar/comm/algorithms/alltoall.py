"""All-to-all: rank r's piece j goes to rank j, for every r and j (MPI_Alltoall's semantics).

What is split. x is cut along its first axis into p pieces, one per destination rank: equal
pieces of m = x.shape[0] / p rows (x[j*m:(j+1)*m] goes to rank j), or, with sizes=, sizes[j]
rows for rank j. Trailing dimensions and the dtype are the same on every rank (as the
columns of all_gather), so no header travels: every rank can size every message itself.

What is sent. Rank r receives one piece from every rank and returns them concatenated in
source-rank order: the same shape as x for the equal split. It keeps its own piece by a local
copy (never counted). A mixture-of-experts layer sends its tokens to their experts this way.

When. Two algorithms, each callable on its own (`pairwise`, `bruck`); minipar.comm's
all_to_all picks Bruck for small messages on many ranks and the pairwise exchange otherwise
(the crossover, measured, is in minipar/comm/__init__.py: ALL_TO_ALL_BRUCK_*).

pairwise exchange, p-1 rounds. In round k = 1, ..., p-1 rank r sends its piece for r+k to rank
r+k and receives rank r-k's piece for it (mod p), straight into its place in the result. Each
ordered pair of ranks meets in exactly one round; any p.
    bytes sent per rank (p-1)/p * n        time (p-1) * (alpha + n/p * beta)
(n: bytes of x; alpha per message, beta per byte, as in ring.py.)

Bruck (Bruck, Ho, Kipnis, Upfal and Weathersby, IEEE TPDS 1997), ceil(log2 p) rounds, any p:
    1. rotate: block i of rank r is its piece for rank r+i (block 0 its own piece; kept in
       place, at row (r + i) % p of a copy of x: bruck_plan);
    2. round k = 0, 1, ...: send every block whose index i has bit k set to rank r + 2^k and
       receive the same block indices from rank r - 2^k, into the same places. A block never
       changes index and only moves forward: block i travels i hops (one jump of 2^k for each
       bit of i), so after the last round block i of rank r is the piece rank r-i sent to r;
    3. inverse rotation: the result's piece s is block (r - s) % p.
Round k sends c_k(p) blocks of n/p bytes, c_k(p) = #{i < p : bit k of i is set}
    = floor(p / 2^(k+1)) * 2^k + max(0, p mod 2^(k+1) - 2^k),
so over all rounds (bruck_blocks(p) = sum_k c_k(p), the set bits of 0, 1, ..., p-1):
    bytes sent per rank (n/p) * bruck_blocks(p)
        p = 2, 3, 4, 5, 8, 16: bruck_blocks = 1, 2, 4, 5, 12, 32, i.e. n/2, 2n/3, n, n, 3n/2, 2n;
        for p a power of two (n/2) * log2(p), against the pairwise (p-1)/p * n
    time ceil(log2 p) * alpha + (n/p) * bruck_blocks(p) * beta + the local copies: x once,
         each round's blocks twice (packed to send, unpacked on arrival), the result once
Fewer rounds, more bytes and copies: Bruck can only win for small messages, and only where
it has fewer rounds, p >= 4 (p = 2, 3: as many rounds as the pairwise exchange). Its rounds
also wait for each other (a block is forwarded after it arrived), where every pairwise send
comes straight from x; measured on one machine it won only from p = 7.

Variable sizes (sizes=, pairwise exchange only): the counts go first, as an equal all-to-all
of p int64s (rank r learns how many rows each rank sends it; the same pairwise rounds,
p-1 messages of 8 bytes, counted in the ledger as part of the call), then the rows in p-1
more rounds: 2(p-1) steps,
    bytes sent per rank 8(p-1) + row bytes * (rows of x not for r itself)
An empty piece is no message at all (both sides know it is empty); a rank may send or
receive nothing.
"""
import functools

import numpy as np

from minipar.comm.calls import run
from minipar.comm.helpers import array, describe, result


# ------------------------------------------------------------------------ the bytes, one home

def bruck_round_blocks(p, k):
    """c_k(p): how many of the block indices 0..p-1 have bit k set (the blocks of round k)."""
    half = 1 << k
    return (p >> (k + 1)) * half + max(0, p % (2 * half) - half)


def bruck_blocks(p):
    """Blocks one rank sends over all ceil(log2 p) rounds of Bruck's all-to-all."""
    return sum(bruck_round_blocks(p, k) for k in range((p - 1).bit_length()))


def bytes_sent(p, n, algorithm="pairwise"):
    """Bytes one rank sends in an equal-split all-to-all of n bytes (p dividing x's rows)."""
    if algorithm == "bruck":
        return n // p * bruck_blocks(p)
    return n // p * (p - 1)


# ------------------------------------------------------------------------ arguments

def check_equal(g, x):
    """The equal split needs a first axis divisible by p (checked before any message)."""
    if x.ndim == 0 or x.shape[0] % g.size:
        raise ValueError(f"all_to_all: x of shape {x.shape} does not split into {g.size} equal "
                         f"pieces along its first axis (a group of {g.size} ranks)")


def check_sizes(g, x, sizes):
    """sizes: p non-negative row counts that add up to x's rows. -> a list of ints."""
    p = g.size
    if x.ndim == 0:
        raise ValueError("all_to_all: x must have a first axis to split, got a 0-d array")
    sizes = list(sizes)
    counts = [int(s) for s in sizes]
    if len(counts) != p or any(c < 0 or c != s for c, s in zip(counts, sizes)) \
            or sum(counts) != x.shape[0]:
        raise ValueError(f"all_to_all: sizes must be {p} whole row counts >= 0 adding up to "
                         f"x.shape[0] = {x.shape[0]}, got {np.asarray(sizes).tolist()}")
    return counts


def _offsets(counts, row):
    """Element offsets of pieces of counts[j] rows of `row` elements each."""
    off = [0]
    for s in counts:
        off.append(off[-1] + s * row)
    return off


def _describe(x, sizes):
    if sizes is None:
        return describe(x)
    return describe(None, dtype=x.dtype, row_shape=tuple(x.shape[1:]), sizes="variable")


# ------------------------------------------------------------------------ pairwise exchange

def _pairwise(c, send, soff, recv, roff, first_step=1):
    """Generator: piece j of flat `send` (send[soff[j]:soff[j+1]]) to rank j; rank j's piece
    for me into recv[roff[j]:roff[j+1]]. Round k = 1..p-1 is step first_step + k - 1."""
    p, r = c.g.size, c.g.rank
    recv[roff[r]:roff[r + 1]] = send[soff[r]:soff[r + 1]]     # my own piece: a local copy
    for k in range(1, p):
        dst, src = (r + k) % p, (r - k) % p     # round k: send to r+k, receive from r-k
        yield c.sendrecv(first_step + k - 1, send[soff[dst]:soff[dst + 1]], dst,
                         recv[roff[src]:roff[src + 1]], src)
    return recv


def _pairwise_sizes(c, x, counts, return_sizes):
    """Generator: the counts (an equal all-to-all of p int64s), then the rows."""
    p = c.g.size
    rest = x.shape[1:]
    row = int(np.prod(rest, dtype=np.int64))
    mine = np.array(counts, np.int64)
    theirs = np.empty(p, np.int64)              # theirs[j]: rows rank j sends me
    step_one = list(range(p + 1))               # one int64 per piece
    yield from _pairwise(c, mine, step_one, theirs, step_one, first_step=1)
    got = [int(s) for s in theirs]
    res = np.empty((sum(got),) + rest, x.dtype)
    yield from _pairwise(c, x.ravel(), _offsets(counts, row), res.reshape(-1),
                         _offsets(got, row), first_step=p)
    return (res, got) if return_sizes else res


def _pairwise_equal(c, x, res, return_sizes):
    p = c.g.size
    w = x.size // p                             # elements per piece
    off = [j * w for j in range(p + 1)]
    yield from _pairwise(c, x.ravel(), off, res.reshape(-1), off)
    return (res, [x.shape[0] // p] * p) if return_sizes else res


def check_args(g, x, sizes, out):
    """Every argument, before any message: -> (counts, None) with sizes=, (None, the result
    array) for the equal split."""
    if sizes is not None:
        if out is not None:
            raise ValueError("all_to_all: out= is for the equal split (the result's rows are "
                             "known only after the counts arrive)")
        return check_sizes(g, x, sizes), None
    check_equal(g, x)
    return None, _result(out, x)


def start_pairwise(g, x, sizes=None, out=None, return_sizes=False):
    x = array(x)
    counts, res = check_args(g, x, sizes, out)
    if counts is not None:
        c = g.begin("all_to_all", 2 * (g.size - 1), _describe(x, sizes) if g.debug else None,
                    "pairwise exchange")
        return c, _pairwise_sizes(c, x, counts, return_sizes)
    c = g.begin("all_to_all", g.size - 1, _describe(x, None) if g.debug else None,
                "pairwise exchange")
    return c, _pairwise_equal(c, x, res, return_sizes)


def pairwise(g, x, sizes=None, *, out=None, return_sizes=False):
    """Pairwise-exchange all-to-all (p-1 rounds): equal pieces, or sizes[j] rows for rank j."""
    return run(*start_pairwise(g, x, sizes, out, return_sizes))


def _result(out, x):
    if out is not None and np.may_share_memory(out, x):
        raise ValueError("all_to_all: out must not overlap x (pieces arrive before all of "
                         "x has been sent)")
    return result(out, x.shape, x.dtype, "all_to_all")


# ------------------------------------------------------------------------ Bruck

@functools.lru_cache(maxsize=256)
def bruck_plan(p, r):
    """Rank r's index arrays: the rows of the working array sent in each round, and the
    final permutation. Block i is kept in row (r + i) % p (where x has its piece for rank
    r + i: the rotation costs no copy), so round k sends rows (r + i) % p for the i < p with
    bit k set, and the result's piece s, block (r - s) % p, is row (2r - s) % p."""
    rounds = tuple(np.array([(r + i) % p for i in range(p) if i >> k & 1], np.intp)
                   for k in range((p - 1).bit_length()))
    return rounds, np.array([(2 * r - s) % p for s in range(p)], np.intp)


def _bruck(c, x, res, return_sizes):
    """Generator: Bruck's all-to-all of x (p equal pieces along axis 0) into res."""
    p, r = c.g.size, c.g.rank
    m = x.shape[0] // p
    x2, res2 = x.reshape(p, -1), res.reshape(p, -1)    # row j: the piece for / from rank j
    if p == 1 or x2.shape[1] == 0:
        res2[...] = x2
    else:
        rounds, final = bruck_plan(p, r)
        rows = c.buffer(0, x2.shape, x.dtype)   # 1. the blocks (row (r + i) % p: block i)
        rows[...] = x2
        for k, sent in enumerate(rounds):       # 2. the blocks whose index has bit k set ...
            send = c.buffer(1, (len(sent), x2.shape[1]), x.dtype)
            rows.take(sent, 0, send)
            recv = res2[:len(sent)]             # (the result is free until step 3)
            yield c.sendrecv(k + 1, send.reshape(-1), (r + (1 << k)) % p,  # ... go 2^k ahead
                             recv.reshape(-1), (r - (1 << k)) % p)
            rows[sent] = recv                   # rank r - 2^k's blocks, same indices
        rows.take(final, 0, res2)               # 3. piece s of the result: block (r - s) % p
    return (res, [m] * p) if return_sizes else res


def start_bruck(g, x, out=None, return_sizes=False):
    x = array(x)
    check_equal(g, x)
    res = _result(out, x)
    c = g.begin("all_to_all", (g.size - 1).bit_length(), _describe(x, None) if g.debug else None,
                "Bruck")
    return c, _bruck(c, np.ascontiguousarray(x), res, return_sizes)


def bruck(g, x, *, out=None, return_sizes=False):
    """Bruck's all-to-all (ceil(log2 p) rounds, equal pieces only): for small messages."""
    return run(*start_bruck(g, x, out, return_sizes))
