"""The bytes a collective sends, by formula: what the algorithm that minipar.comm picks for
this group and this size sends from this rank to each peer, split into the bytes that stay
on the host and those that cross to another one (the ledger's bytes_sent_inter).

    inside, across = sent("all_reduce", g, x)       # x: the array (or helpers.shaped's stand-in)
    inside, across = sent("reduce_scatter", g, x)   # x: the whole vector, before the scatter
    inside, across = sent("all_gather", g, piece)   # piece: this rank's part, before the gather
    inside, across = sent("all_to_all", g, x)       # x: p equal pieces along its first axis

For the equal pieces the mechanisms built on them send (ZeRO pads each unit to a multiple of
its ranks): n bytes in p pieces of n/p. Per algorithm, to whom:

    direct exchange   reduce-scatter, all-gather: n/p to every other rank; all-reduce: 2n/p
    ring              reduce-scatter, all-gather: (p-1)/p n to the right; all-reduce: 2(p-1)/p n
    doubling          all-reduce: n to the partner of each of log2(q) steps (q the largest
                      power of two <= p); with the p-q fix-up ranks, n more to the pair's other
    Bruck             all-gather: at the step that has h pieces, min(h, p-h) of them to r-h
    all-to-all        pairwise n/p to every other rank; Bruck, at round k, the blocks whose
                      index has bit k set to r + 2^k; hierarchical: hierarchical_alltoall.sends
    hierarchical      reduce-scatter: to each rank of the host, the pieces it deputises for;
                      across, the host's sum of each piece I deputise for to its owner.
                      all-gather: the same paths backwards (hierarchical.py's table)

Summed, a reduce-scatter or an all-gather sends (p-1)/p n and an all-reduce 2(p-1)/p n by
every algorithm but doubling. tests/mpi/test_sent.py holds each column to the ledger on one
host and on emulated hosts, across every crossover size.
"""
from __future__ import annotations

from minipar import comm
from minipar.comm.algorithms import alltoall, direct, doubling, hierarchical, hierarchical_alltoall, ring


def _algorithm(op, g, x):
    if op == "all_to_all":
        return comm.all_to_all_algorithm(g, x)
    if op == "all_reduce":
        return comm.all_reduce_algorithm(g, x)
    if op == "reduce_scatter":
        return comm.reduce_scatter_algorithm(g, x)
    if op == "all_gather":
        return comm.all_gather_algorithm(g, x, None)
    raise ValueError(f"sent: no formula for {op!r}")


def to_peers(op: str, g, x) -> dict:
    """{group rank: bytes this rank sends it} in op on g of x (the module docstring)."""
    p, r = g.size, g.rank
    n = x.nbytes * (p if op == "all_gather" else 1)        # the whole vector
    if p == 1 or n == 0:
        return {}
    algorithm, piece = _algorithm(op, g, x), n // p
    out = {}

    def add(q, b):
        out[q] = out.get(q, 0) + b
    if op == "all_to_all":
        return _all_to_all(algorithm, g, piece)
    if algorithm is hierarchical:
        return _hierarchical(op, g, piece)
    if algorithm is doubling and op == "all_reduce":
        q = 1 << (p.bit_length() - 1)
        if r >= q:
            add(r - q, n)
            return out
        mask = 1
        while mask < q:
            add(r ^ mask, n)
            mask <<= 1
        if r < p - q:
            add(r + q, n)
        return out
    if algorithm is doubling:                              # Bruck's all-gather
        have = 1
        while have < p:
            count = min(have, p - have)
            add((r - have) % p, count * piece)
            have += count
        return out
    rounds = 2 if op == "all_reduce" else 1
    if algorithm is direct:
        return {q: rounds * piece for q in range(p) if q != r}
    if algorithm is ring:
        return {(r + 1) % p: rounds * (p - 1) * piece}
    raise ValueError(f"sent: no formula for {op} by {algorithm.__name__}")


def _all_to_all(algorithm, g, piece):
    """all_to_all of equal pieces: pairwise a piece to every other rank; Bruck, at round k,
    the blocks whose index has bit k set to r + 2^k; hierarchical_alltoall.sends."""
    p, r = g.size, g.rank
    if algorithm == "hierarchical":
        out = {}
        for q, b in hierarchical_alltoall.sends(g.nodes, r, piece):
            out[q] = out.get(q, 0) + b
        return out
    if algorithm == "bruck":
        out = {}
        for k in range((p - 1).bit_length()):
            q = (r + (1 << k)) % p
            out[q] = out.get(q, 0) + piece * alltoall.bruck_round_blocks(p, k)
        return out
    return {q: piece for q in range(p) if q != r}


def _hierarchical(op, g, piece):
    """hierarchical.py's two rounds (four for the all-reduce), piece by piece."""
    hosts, deputy = hierarchical.layout(g.nodes)
    me, r = g.node, g.rank
    out = {}

    def add(q, b):
        out[q] = out.get(q, 0) + b
    if op in ("reduce_scatter", "all_reduce"):
        for q in hosts[me]:                                # round 1: what each local rank deputises for
            if q != r:
                add(q, piece * len(hierarchical.pieces_of(g, q)))
        for a in hierarchical.pieces_of(g, r):             # round 2: the host's sum to each owner
            if a != r:
                add(a, piece)
    if op in ("all_gather", "all_reduce"):
        for h in range(g.n_nodes):                         # round 1: my piece to its deputy on each host
            if h != me:
                add(deputy[h][r], piece)
        for q in hosts[me]:                                # round 2: the pieces I hold, to each local rank
            if q != r:
                add(q, piece * len(hierarchical.pieces_of(g, r)))
    return out


def sent(op: str, g, x) -> tuple[int, int]:
    """(bytes inside the host, bytes across hosts) this rank sends in op on g of x."""
    peers = to_peers(op, g, x)
    return (sum(b for q, b in peers.items() if not g.remote[q]),
            sum(b for q, b in peers.items() if g.remote[q]))
