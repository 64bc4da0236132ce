"""Lab 15: a mixture-of-experts layer's routing and dispatch: the router's top-k, the capacity
and which assignments it drops, the order the kept ones travel in, the expert-parallel
dispatch and its way back, and the weighted combine.

Write the functions below (labs/15_moe_dispatch/README.md has the pictures and the hints).
Arrays are NumPy arrays; never modify an argument. The two functions that take a group g
communicate only through minipar's all-to-all, which the lab hands you (lab 11 is where it
is written):

    from minipar import comm
    y = comm.all_to_all(g, x)                   # equal pieces: x.shape[0] / p rows to each rank
    y = comm.all_to_all(g, x, sizes=sizes)      # sizes[j] rows to rank j (p ints), in rank order;
                                                # y: what every rank sent here, in source order

No MPI collective, and none of minipar's own routing (minipar.model.moe) or dispatch
(minipar.parallel.expert).

Check:  make lab L=15
        (or: .venv/bin/python -m labs.grade 15 --student labs/15_moe_dispatch/student.py)
"""
import math  # noqa: F401 - you will want it

import numpy as np  # noqa: F401 - you will want it

from minipar import comm  # noqa: F401 - you will want it


def top_k(logits, k, router="switch"):
    """The router's decision from its logits (N, E) float64: (choice, weights), both (N, k).

    p = softmax(logits) over the experts, per token (subtract the row's max first: logits of
    1e3 must not overflow). choice[n]: the k experts of largest p, largest first; equal p go
    to the lower expert id first. choice is int64.
    weights[n, j] = p[n, choice[n, j]] / (sum of p over the k chosen), float64: renormalised
    over the k. Except router == "switch" with k == 1: the weight is p itself (Switch
    Transformer keeps it, so the router still gets a gradient); "mixtral" renormalises k = 1
    too (the weight is then 1). N may be 0."""
    raise NotImplementedError("lab 15: top_k, see labs/15_moe_dispatch/README.md")


def capacity(tokens, k, experts, factor):
    """Slots per expert in a routing group of `tokens` tokens with k choices each: the
    ceiling of factor * tokens * k / experts, an int; None when factor is 0 (no capacity,
    nothing is ever dropped)."""
    raise NotImplementedError("lab 15: capacity, see labs/15_moe_dispatch/README.md")


def claim_slots(choice, experts, cap):
    """kept (N, k) bool: which assignments (token n, its j-th choice choice[n, j]) get a slot.

    Each expert has cap slots (cap None: every assignment is kept; cap 0: none is). Slots are
    claimed choice by choice, then token by token: every token's first choice in token
    order, then every token's second choice in token order, and so on. An assignment whose
    expert has no slot left is dropped (kept False); later ones are not moved up."""
    raise NotImplementedError("lab 15: claim_slots, see labs/15_moe_dispatch/README.md")


def assignments(choice, kept, experts):
    """The kept assignments in the order they are dispatched: (tokens, slots, rows).

    Ordered by expert; within an expert by choice (all first choices before any second
    choice), then by token. tokens (M,) int64: each one's token n; slots (M,) int64: n * k + j
    (its place in the flattened (N, k) weights); rows (E,) int64: the kept assignments of each
    expert, the load per expert (zeros allowed). Dropped assignments are not listed."""
    raise NotImplementedError("lab 15: assignments, see labs/15_moe_dispatch/README.md")


def dispatch(g, x, tokens, rows):
    """Expert parallelism's dispatch, on the p ranks of group g: -> (xe, counts).

    E = len(rows) experts, E/p per rank: rank j holds experts j E/p .. (j+1) E/p - 1. This
    rank sends x[tokens] (M rows, grouped by expert as assignments() orders them) to the
    ranks that hold their experts, by comm.all_to_all with sizes: the rows for each rank.
    Then each rank must learn how many rows each of its experts got from each source: send
    every rank the rows (int64) you have for each of its experts, by an equal all-to-all.
    counts (p, E/p) int64: counts[s, i] = rows from rank s for this rank's i-th expert.
    xe: the rows received, in expert-major order (all rows for this rank's first expert,
    from rank 0 then rank 1 ..., then those for its second expert, ...), x's dtype."""
    raise NotImplementedError("lab 15: dispatch, see labs/15_moe_dispatch/README.md")


def send_back(g, out, counts):
    """The experts' outputs back to the ranks their rows came from: -> back (M, C).

    out: one row per row dispatch() received, in the same expert-major order; counts as
    dispatch() returned. Undo the expert-major order (back to source by source, each
    source's rows in expert order), send each source its rows (comm.all_to_all with sizes).
    back: this rank's own M rows, in the order of the tokens it dispatched, out's dtype."""
    raise NotImplementedError("lab 15: send_back, see labs/15_moe_dispatch/README.md")


def combine(rows, tokens, slots, weights, n):
    """The weighted combine: y (n, C) in rows' dtype, a new array.

    rows (M, C): the expert output of each kept assignment m, whose token is tokens[m] and
    whose weight is weights.flat[slots[m]] (weights (n, k), the router's). y starts at zero;
    y[tokens[m]] += weight x rows[m] for every m (a token may appear several times: add each).
    A dropped assignment has no row, so it adds nothing; a token with none stays zero."""
    raise NotImplementedError("lab 15: combine, see labs/15_moe_dispatch/README.md")
