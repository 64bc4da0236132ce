"""Lab 20: Ulysses, the all-to-alls that turn a sequence split into a head split and back.

Write the three functions below (labs/20_ulysses/README.md has the picture and the hints).
heads_of is plain arithmetic. to_heads and to_tokens are all-to-alls on point-to-point
messages only: one Call on the group g each. A Call numbers the collective, tags its
messages, counts the bytes in minipar's ledger under the call's name, and gives up with a
clear message if a peer never answers:

    call = g.begin("all_to_all", nsteps)              # one step per exchange
    for step in range(nsteps):
        call.wait(call.sendrecv(step, send_buf, dst, recv_buf, src))   # both at once
    call.done()                                       # into the ledger

send_buf and recv_buf are contiguous 1-D NumPy arrays; every piece's size is known on both
sides (the head lists are the same on every rank), so nothing but the pieces travels. Use
nothing else to communicate: no MPI collective, and none of minipar.comm's own.

Check:  make lab L=20
        (or: .venv/bin/python -m labs.grade 20 --student labs/20_ulysses/student.py)
"""
import numpy as np  # noqa: F401 - you will want it


def heads_of(j, H, Hkv, C):
    """The heads rank j of C attends with, as a list of ints indexing the H + 2 Hkv heads of
    the packed projection qkv viewed as (B, t, H + 2 Hkv, hs) = [q heads | k heads | v heads]:
    first its H/C query heads, j H/C .. (j + 1) H/C - 1; then the keys of its KV heads (index
    H + h for KV head h), then their values (index H + Hkv + h).

    Its KV heads: when C divides Hkv, the Hkv/C heads j Hkv/C .. (j + 1) Hkv/C - 1; when Hkv
    divides C (fewer KV heads than ranks), the one KV head its query heads read, j // (C/Hkv),
    which is then copied to C/Hkv ranks. Anything else (C does not divide H; Hkv and C neither
    divide the other) cannot be split into whole heads: raise ValueError with a one-line
    message that names H, Hkv and C."""
    raise NotImplementedError("lab 20: heads_of, see labs/20_ulysses/README.md")


def to_heads(g, x, heads):
    """The sequence-to-head all-to-all. x (B, t, n, hs): this rank's t tokens of n heads.
    heads[j]: the list of heads rank j gets (the same lists on every rank, each of the same
    length m, no head twice in one list; a head may be in several lists).

    Returns a new array y (B, C t, m, hs), x's dtype: the heads heads[me] of rank 0's t tokens,
    then of rank 1's, ..., rank C-1's (rank order), y[:, i t:(i + 1) t] = x_i[:, :, heads[me]]
    with x_i rank i's x. Rank j gets x[:, :, heads[j]] from this rank: one Call named
    "all_to_all"; a rank keeps its own piece by a copy. x is never modified."""
    raise NotImplementedError("lab 20: to_heads, see labs/20_ulysses/README.md")


def to_tokens(g, y, heads, n):
    """The way back, and to_heads' adjoint. y (B, C t, m, hs): this rank's heads heads[me] of
    every rank's tokens, in rank order (what to_heads returns, or a gradient shaped like it).

    Returns a new array out (B, t, n, hs), y's dtype: this rank's t tokens of all n heads,
    out[:, :, heads[j]] += y_j[:, me t:(me + 1) t] for every rank j (y_j: rank j's y). A head
    held by several ranks (a KV head copied to C/Hkv ranks) gets the SUM of their pieces (its
    gradient is the sum of its copies'); a head no rank holds is zeros. Rank j gets
    y[:, j t:(j + 1) t] from this rank: one Call named "all_to_all". y is never modified."""
    raise NotImplementedError("lab 20: to_tokens, see labs/20_ulysses/README.md")
