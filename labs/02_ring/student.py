"""Lab 02: the ring reduce-scatter and all-gather, on point-to-point messages only.

Write the two functions below (labs/02_ring/README.md has the picture and the hints). A
collective is one Call on the group g: it numbers the call, tags its messages, counts the
bytes in minipar's ledger under the call's name, and gives up with a clear message if a
neighbour never answers:

    call = g.begin("reduce_scatter", nsteps)          # p - 1 steps for a ring
    for step in range(nsteps):
        call.wait(call.sendrecv(step, send_buf, right, recv_buf, left))   # both at once
    call.done()                                       # into the ledger

send_buf and recv_buf are contiguous NumPy arrays (slices of a 1-D array are); a buffer of
0 elements sends nothing. g.rank and g.size are this rank's place and the ring's length.
Use nothing else to communicate: no MPI collective, and none of minipar.comm's own.

Check:  make lab L=02        (or: .venv/bin/python -m labs.grade 02 --student this_file.py)
"""
import numpy as np  # noqa: F401 - you will want it


def reduce_scatter(g, x, op="sum"):
    """Rank r returns piece r of np.array_split(op over every rank's x.ravel(), p), a new
    1-D array of x's dtype. op: "sum", "max" or "min". x is never modified.

    The ring: at step s = 0 .. p-2, rank r sends a partial result to r+1 and receives one
    from r-1, adds its own copy of that piece, and passes it on at the next step; after p-1
    steps the piece it holds is complete. Each rank sends (p-1)/p of the array."""
    raise NotImplementedError("lab 02: ring reduce_scatter, see labs/02_ring/README.md")


def all_gather(g, piece, sizes=None):
    """The concatenation of every rank's piece.ravel(), in rank order: a new 1-D array of the
    pieces' dtype. sizes: each rank's element count when they differ (e.g. the pieces that
    reduce_scatter returned); None means every piece has as many elements as this rank's.
    piece is never modified. Each rank sends every piece but one: (p-1)/p of the result."""
    raise NotImplementedError("lab 02: ring all_gather, see labs/02_ring/README.md")
