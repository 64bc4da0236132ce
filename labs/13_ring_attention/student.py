"""Lab 13: ring attention, the attention of context parallelism: causal attention over a sequence
split across the C ranks of a group, with K and V passed round a ring on point-to-point
messages.

Write the five functions below (labs/13_ring_attention/README.md has the pictures and the
hints). The ring is one Call on the group g: it numbers the call, tags its messages, counts
the bytes in minipar's ledger under the call's name, and gives up with a clear message if a
peer never answers:

    call = g.begin("ring_attention", C - 1)           # one step per pass of the K, V block
    for step in range(C - 1):
        reqs = call.sendrecv(step, send_buf, dst, recv_buf, src)   # posted, not finished
        ...                                           # compute while it travels
        call.wait(reqs)                               # finished: recv_buf holds the block
    call.done()                                       # into the ledger

send_buf and recv_buf are contiguous 1-D NumPy arrays (x.reshape(-1) of a new array is) and
must not be touched until call.wait returns. g.size is C, g.rank this rank. Use nothing else
to communicate: no MPI, and none of minipar.comm's own calls.

Check:  make lab L=13
        (or: .venv/bin/python -m labs.grade 13 --student labs/13_ring_attention/student.py)
"""
import math  # noqa: F401 - you will want it

import numpy as np  # noqa: F401 - you will want it


def positions(rank, C, T, layout="zigzag"):
    """The global positions of the T/C tokens rank `rank` of C keeps, in the order it holds
    them: a 1-D array of integers. The sequence 0..T-1 is cut into 2C chunks of c = T/2C;
    layout "zigzag": chunk `rank`, then chunk 2C-1-rank; "contiguous": chunks 2 rank and
    2 rank + 1. Raises ValueError when 2C does not divide T (T = 0 gives an empty array)."""
    raise NotImplementedError("lab 13: the split, see labs/13_ring_attention/README.md")


def block_attention(q, k, v, mask=None):
    """Attention of queries q (..., tq, hs) over the keys and values k, v (..., tk, hs) only:
    -> (o, lse), o = softmax(q k^T / sqrt(hs)) v of q's shape and dtype, lse (..., tq) the log
    of each row's softmax denominator, log sum_j e^(s_j). mask: None, or a bool array (tq, tk),
    True where the key is hidden from the query. A row that sees no key gets o = 0 and
    lse = -inf. q, k, v and mask are not modified."""
    raise NotImplementedError("lab 13: one block of attention, see labs/13_ring_attention/README.md")


def merge(o1, lse1, o2, lse2):
    """Two attention results of the same queries over two disjoint sets of keys -> (o, lse),
    the result over their union: lse = log(e^lse1 + e^lse2), o = e^(lse1-lse) o1 +
    e^(lse2-lse) o2, computed without overflow for any lse (subtract the larger). A result
    with lse = -inf (it saw no key; its o is 0) is neutral: (o1, lse1) comes back; two of them
    give (0, -inf), never NaN. o (..., t, hs) and lse (..., t) keep their dtype; the inputs
    are not modified."""
    raise NotImplementedError("lab 13: the merge, see labs/13_ring_attention/README.md")


def plan(rank, owner, C, layout="zigzag"):
    """The causal plan when rank `rank`'s queries meet the K, V block of rank `owner`: a 2 x 2
    list of lists, plan[a][b] for the rank's chunk a (0: the first it holds, 1: the second)
    against the owner's chunk b, each "full" (every key comes before every query: no mask),
    "diagonal" (the same chunk: the causal mask inside it) or "skip" (every key after every
    query: nothing to compute)."""
    raise NotImplementedError("lab 13: the causal plan, see labs/13_ring_attention/README.md")


def ring_attention(g, q, k, v, layout="zigzag"):
    """Causal attention of this rank's queries over the whole sequence -> (o, lse). q, k, v
    (..., t, hs), the same shape: this rank's t = T/C tokens at positions(g.rank, C, T, layout),
    T = t C. o of q's shape and dtype, lse (..., t); q, k, v are not modified.

    C steps: at step j the rank holds rank (r - j) mod C's K, V block (its own at j = 0),
    computes each c x c sub-block its plan does not skip with block_attention (the diagonal
    ones with the causal mask), merges it into the running (o, lse), and (for j < C - 1)
    passes the block to rank r + 1 while receiving the next from rank r - 1: C - 1 messages of
    K and V together, one Call named "ring_attention"."""
    raise NotImplementedError("lab 13: the K, V ring, see labs/13_ring_attention/README.md")
