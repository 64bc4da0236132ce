"""Lab 11: the all-to-all that moves a mixture-of-experts layer's tokens, on point-to-point
messages only.

Write the function below (labs/11_all_to_all/README.md has the picture and the hints). A
collective is one Call on the group g: it numbers the call, tags its messages, counts the
bytes in minipar's ledger under the call's name, and gives up with a clear message if a
peer never answers:

    call = g.begin("all_to_all", nsteps)              # one step per exchange
    for step in range(nsteps):
        call.wait(call.sendrecv(step, send_buf, dst, recv_buf, src))   # both at once
    call.done()                                       # into the ledger

send_buf and recv_buf are contiguous 1-D NumPy arrays (slices of a 1-D array are); a buffer
of 0 elements sends nothing (both sides know it is empty). Use nothing else to communicate:
no MPI collective, and none of minipar.comm's own.

Check:  make lab L=11
        (or: .venv/bin/python -m labs.grade 11 --student labs/11_all_to_all/student.py)
"""
import numpy as np  # noqa: F401 - you will want it


def all_to_all(g, x, sizes=None):
    """Rank r's piece j of x (along its first axis) goes to rank j. Returns (y, received): y
    the pieces every rank sent to this one, concatenated along the first axis in source-rank
    order (x's dtype and trailing dimensions; a new array, never x or a view of it), and
    received[s] the rows that came from rank s.

    sizes=None: x.shape[0] is divisible by p and piece j is x[j*m:(j+1)*m], m = x.shape[0]/p.
    sizes: p row counts adding up to x.shape[0], piece j has sizes[j] rows; the counts must
    reach their destinations first (rank j cannot size its receive otherwise), by the same
    exchange on one int64 each, in the same Call as the rows. Neither x nor sizes is ever modified.

    The pairwise exchange: in round k = 1 .. p-1 rank r sends its piece for r+k and receives
    the piece rank r-k has for it (mod p); its own piece is a copy. Each rank sends (p-1)/p of
    x for equal pieces."""
    raise NotImplementedError("lab 11: the pairwise all_to_all, see labs/11_all_to_all/README.md")
