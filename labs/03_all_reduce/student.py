"""Lab 03: all-reduce two ways, on point-to-point messages only: the ring (bandwidth) and
recursive doubling (latency).

Write the two functions below (labs/03_all_reduce/README.md has the pictures and the hints).
Each all-reduce is one Call on the group g: it numbers the call, tags its messages, counts
the bytes in minipar's ledger under the call's name, and gives up with a clear message if a
peer never answers:

    call = g.begin("all_reduce", nsteps)              # name it "all_reduce": the ledger's op
    call.wait(call.sendrecv(step, send_buf, dst, recv_buf, src))   # send and receive at once
    call.wait(call.isend(step, send_buf, dst))        # or one way only
    call.wait(call.irecv(step, recv_buf, src))
    call.done()                                       # into the ledger

Buffers are contiguous NumPy arrays (slices of a 1-D array are); a buffer of 0 elements
sends nothing. Messages between two ranks arrive in the order they were sent. g.rank and
g.size are this rank's place and the group's size p. Use nothing else to communicate: no MPI
collective, and none of minipar.comm's own.

Check:  make lab L=03
        (or: .venv/bin/python -m labs.grade 03 --student labs/03_all_reduce/student.py)
"""
import numpy as np  # noqa: F401 - you will want it


def all_reduce_ring(g, x, op="sum"):
    """Every rank returns op over every rank's x: a new array of x's shape and dtype,
    bit-identical on every rank. op: "sum", "max" or "min" (np.add, np.maximum, np.minimum).
    x (any shape, any size including 0, possibly not contiguous) is never modified.

    The ring, 2(p-1) steps of one Call: cut x.ravel() into the p pieces of
    np.array_split(x.ravel(), p); then a reduce-scatter (p-1 steps: send a partial piece to
    rank r+1, receive one from r-1 and add your own copy of it, so each piece is reduced
    once, on one rank) and an all-gather of the finished pieces (p-1 steps: pass on the
    piece that came in last). Each rank sends 2(p-1)/p of x's bytes."""
    raise NotImplementedError("lab 03: ring all-reduce, see labs/03_all_reduce/README.md")


def all_reduce_doubling(g, x, op="sum"):
    """The same result and contract as all_reduce_ring, by recursive doubling.

    Let q be the largest power of two <= p. In round k = 0 .. log2(q)-1, rank r < q swaps
    its whole partial result with rank r ^ 2^k and both combine the two. When p > q (p = 3,
    5, ...) the extra ranks r >= q first send their x to rank r - q, which combines it into
    its own before the rounds, and at the end rank r - q sends them the result. Bytes sent:
    log2(q) times x's bytes on ranks < q, once more on ranks < p - q, once on ranks >= q."""
    raise NotImplementedError("lab 03: recursive-doubling all-reduce, see labs/03_all_reduce/README.md")
