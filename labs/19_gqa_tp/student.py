"""Lab 19: grouped-query attention under tensor parallelism. Which query and key/value heads
each tp rank holds, which columns of the packed [Wq | Wk | Wv] it keeps, which ranks share each
key/value head, and the sum of a shared head's gradient over exactly those ranks.

Write the four functions below (labs/19_gqa_tp/README.md has the picture and the hints). The
first three are plain arithmetic on head counts. The last talks to the other ranks through
point-to-point messages only: one Call on the tp group g, as in lab 11:

    call = g.begin("kv_grads", nsteps)                # one step per exchange
    for step in range(nsteps):
        call.wait(call.sendrecv(step, send_buf, dst, recv_buf, src))   # both at once
    call.done()                                       # into the ledger

dst and src are ranks of g (tp ranks). send_buf and recv_buf are contiguous 1-D NumPy arrays
(`a.reshape(-1)` of a contiguous array is one); a buffer of 0 elements sends nothing. Use
nothing else to communicate: no MPI collective, none of minipar.comm's own.

Check:  make lab L=19
        (or: .venv/bin/python -m labs.grade 19 --student labs/19_gqa_tp/student.py)
"""
import numpy as np  # noqa: F401 - you will want it


def rank_heads(n_head, n_kv_head, tp, rank):
    """(query heads, key/value heads) that tp rank `rank` holds: two lists of ints, ascending.

    H = n_head query heads, Hkv = n_kv_head key/value heads, query head h reads key/value head
    h // (H/Hkv). Rank r holds the H/tp consecutive query heads r*H/tp .. (r+1)*H/tp - 1, and
    the key/value heads those read: Hkv/tp of them when tp <= Hkv, one (shared with tp/Hkv - 1
    other ranks) when tp > Hkv.

    ValueError (with a message saying why) when the split cannot be made: Hkv does not divide
    H, tp does not divide H, neither of tp and Hkv divides the other, or rank is not in
    0 .. tp-1."""
    raise NotImplementedError("lab 19: rank_heads, see labs/19_gqa_tp/README.md")


def qkv_columns(n_head, n_kv_head, head_size, tp, rank):
    """The columns of the packed projection [Wq | Wk | Wv] ((H + 2 Hkv) * head_size wide:
    query head h's channels at h*hs .. h*hs + hs - 1, key/value head j's K at (H + j)*hs ..,
    its V at (H + Hkv + j)*hs ..) that rank `rank` keeps, in the order of its own packed
    [q_r | k_r | v_r]: its query heads' columns, then its key/value heads' K columns, then
    their V columns, each head's hs channels in order. A 1-D NumPy array of int64.

    ValueError for what rank_heads refuses."""
    raise NotImplementedError("lab 19: qkv_columns, see labs/19_gqa_tp/README.md")


def kv_groups(n_head, n_kv_head, tp):
    """Which tp ranks hold each key/value head: a list of Hkv lists, entry j the ranks holding
    head j, ascending. One rank each when tp <= Hkv; tp/Hkv ranks each when tp > Hkv: the ranks
    over which head j's gradient is summed.

    ValueError for what rank_heads refuses."""
    raise NotImplementedError("lab 19: kv_groups, see labs/19_gqa_tp/README.md")


def sum_kv_grad(g, grad, ranks):
    """The sum of `grad` over the tp ranks in `ranks` (this rank among them): every rank of
    `ranks` returns the same array, bit for bit, of grad's shape and dtype, a new one (never
    grad itself or a view of it), each rank's gradient added exactly once. grad is never
    modified.

    g is the whole tp group (g.rank, g.size); ranks is one of kv_groups' lists, ascending.
    Every rank of g calls sum_kv_grad at the same time, each with the ranks of its own group
    (the groups split g's ranks, all of one size, not always neighbours: {0, 2} and {1, 3} is a
    split too). A group of one sends nothing and returns a copy. Communicate only through one
    Call on g, started as g.begin("kv_grads", steps)."""
    raise NotImplementedError("lab 19: sum_kv_grad, see labs/19_gqa_tp/README.md")
