"""Lab 20, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's heads_of, to_heads and to_tokens, and the seam. Nothing here judges; lab.py
does, in the grader.

Cases: heads_of for a table of (H, Hkv, C), some of which no split can serve; to_heads and
to_tokens on groups of p = 1 (rank 0 alone), 2, 3 and 4 ranks cut from 4, with the head
lists of real layouts (the packed q | k | v of multi-head, grouped-query and multi-query
attention, and the query heads alone), lists that are not ranges, heads copied to several
ranks, heads no rank holds, and no heads at all; one token and one sequence; float64 and
float32. Every rank's array is drawn from its own seed, so the grader rebuilds each one.
"""
import os

import numpy as np

from labs.framework import extra_cases, rank_groups
from labs.results import key
from minipar import comm

HERE = os.path.dirname(os.path.abspath(__file__))
P_MAX = 4
ULYSSES = "minipar.parallel.context.ulysses"
# minipar's own Ulysses and the collectives of minipar.comm: reached from the student's file,
# each raises (labs/child.py)
OWN = [f"{ULYSSES}:{n}" for n in ("heads_of", "kv_heads_of", "head_split", "to_heads", "to_tokens")] + \
      [f"minipar.comm:{n}" for n in ("all_to_all", "all_to_all_async", "all_reduce", "all_reduce_async",
                                     "reduce_scatter", "reduce_scatter_async", "all_gather", "all_gather_async",
                                     "broadcast", "reduce", "scatter", "gather")] + \
      [f"minipar.comm.algorithms.alltoall:{n}" for n in ("pairwise", "start_pairwise", "bruck", "start_bruck")]

# (H, Hkv, C) for heads_of: the ones a split serves, then the ones it cannot
HEAD_CASES = [(1, 1, 1), (4, 4, 1), (4, 4, 2), (4, 2, 2), (4, 1, 2), (4, 4, 4), (4, 2, 4), (4, 1, 4),
              (6, 6, 3), (6, 3, 3), (6, 1, 3), (12, 4, 2), (12, 6, 3), (12, 2, 4), (16, 8, 4), (8, 2, 8),
              (24, 8, 8), (24, 3, 6)]
REFUSED = [(4, 4, 3), (6, 2, 3), (12, 4, 6), (8, 8, 16), (6, 6, 4), (24, 8, 3)]
# (H, Hkv) pairs whose packed lists the exchange criteria use, for each p
PACKED = {1: [(2, 2), (4, 1)], 2: [(4, 4), (4, 1), (2, 2)], 3: [(6, 6), (6, 1), (3, 3)],
          4: [(4, 2), (8, 8), (4, 1)]}
DTYPES = ("float64", "float32")


def rng_for(*parts):
    """A case's random numbers; a teacher's "seed" ($MINIPAR_LAB_EXTRA/20_ulysses/cases.json)
    draws other values for every case."""
    seed = int(extra_cases(HERE).get("seed", 0))
    return np.random.default_rng([*parts, seed])


def packed_heads(j, H, Hkv, C):
    """The packed lists of a layout, written out here (the oracle's own lives in lab.py)."""
    Hq = H // C
    kv = list(range(j * (Hkv // C), (j + 1) * (Hkv // C))) if Hkv % C == 0 else [j // (C // Hkv)]
    return list(range(j * Hq, (j + 1) * Hq)) + [H + h for h in kv] + [H + Hkv + h for h in kv]


def exchange_cases(p):
    """(name, B, t, n, hs, heads, dtype) of the exchange criteria on p ranks."""
    cases = []
    for H, Hkv in PACKED[p]:
        heads = [packed_heads(j, H, Hkv, p) for j in range(p)]
        cases.append((f"q|k|v of H={H} Hkv={Hkv}", 2, 3, H + 2 * Hkv, 4, heads, "float64"))
    cases.append(("the query heads of H=2p (the output)", 1, 2, 2 * p, 3,
                  [[2 * j, 2 * j + 1] for j in range(p)], "float32"))
    cases.append(("lists that are not ranges, one token", 2, 1, 3 * p, 2,
                  [[3 * p - 1 - j, j] for j in range(p)], "float64"))
    cases.append(("one head copied to every rank, heads no rank holds", 1, 4, 5, 2,
                  [[3, j % 2] for j in range(p)], "float64"))
    cases.append(("no heads at all (empty pieces)", 2, 2, 3, 4, [[] for _ in range(p)], "float64"))
    for name, B, t, n, hs, heads, dtype in cases:
        assert all(len(set(h)) == len(h) == len(heads[0]) for h in heads), name
    return cases


def case_input(p, r, shape, dtype, salt):
    """Rank r's array of a case: small integers (their sums are exact in any order)."""
    return rng_for(p, r, len(shape), *shape, np.dtype(dtype).num, salt).integers(-50, 50, shape).astype(dtype)


def groups():
    """(p, Group) for p = 1..4 that hold this rank: ranks 0..p-1 of the world."""
    return rank_groups(range(1, P_MAX + 1))


def record(out, k, got, arg):
    """What the call returned (a copy of an array), its argument as it is now, and whether
    the result shares memory with it."""
    out.put(k, np.array(got) if type(got) is np.ndarray else got)
    out.put(key(k, "arg after"), arg)
    out.put(key(k, "aliases"), bool(isinstance(got, np.ndarray) and np.shares_memory(got, arg)))


# --- what the child runs ----------------------------------------------------------------------

def heads(student, out):
    for H, Hkv, C in HEAD_CASES:
        for j in range(C):
            out.case(f"heads_of(j={j}, H={H}, Hkv={Hkv}, C={C})")
            got = student.heads_of(j, H, Hkv, C)
            out.put(key("heads", H, Hkv, C, j), np.array(got) if type(got) is np.ndarray else got)
    for H, Hkv, C in REFUSED:
        out.case(f"heads_of(j=0, H={H}, Hkv={Hkv}, C={C}), which no split serves")
        try:
            got = student.heads_of(0, H, Hkv, C)
        except ValueError as e:
            out.put(key("refused", H, Hkv, C), ["ValueError", str(e)[:500]])
        else:
            out.put(key("refused", H, Hkv, C), ["returned", np.array(got) if type(got) is np.ndarray else got])


def forward(student, out):
    for p, g in groups():
        r = g.rank
        for i, (name, B, t, n, hs, hl, dtype) in enumerate(exchange_cases(p)):
            out.case(f"p={p} rank {r} to_heads, {name}: x {(B, t, n, hs)} {dtype}, heads {hl}")
            x = case_input(p, r, (B, t, n, hs), dtype, 1)
            record(out, key("fwd", p, r, i), student.to_heads(g, x, [list(h) for h in hl]), x)


def backward(student, out):
    for p, g in groups():
        r = g.rank
        for i, (name, B, t, n, hs, hl, dtype) in enumerate(exchange_cases(p)):
            m = len(hl[r])
            out.case(f"p={p} rank {r} to_tokens, {name}: y {(B, p * t, m, hs)} {dtype}, heads {hl}, n={n}")
            y = case_input(p, r, (B, p * t, m, hs), dtype, 2)
            record(out, key("bwd", p, r, i), student.to_tokens(g, y, [list(h) for h in hl], n), y)


def ledger(student, out):
    """The bytes minipar's ledger counted for one call of each, and what it counted them under."""
    for p, g in groups():
        r = g.rank
        for i, (name, B, t, n, hs, hl, dtype) in enumerate(exchange_cases(p)):
            m = len(hl[r])
            for which, arg, call in (
                    ("to_heads", case_input(p, r, (B, t, n, hs), dtype, 3),
                     lambda a: student.to_heads(g, a, [list(h) for h in hl])),
                    ("to_tokens", case_input(p, r, (B, p * t, m, hs), dtype, 4),
                     lambda a: student.to_tokens(g, a, [list(h) for h in hl], n))):
                out.case(f"p={p} rank {r} {which}, {name}, counting bytes")
                comm.reset_traffic()
                call(arg)
                t_ = comm.traffic()
                out.put(key("sent", which, p, r, i), int(sum(v["bytes_sent"] for v in t_.values())))
                out.put(key("calls", which, p, r, i), {op: int(v["calls"]) for op, v in t_.items()})


# --- the seam ---------------------------------------------------------------------------------

def lists(heads):
    """minipar's head lists (int64 arrays) as the contract's lists of ints."""
    return [[int(h) for h in hl] for hl in heads]


def install(student):
    """minipar's Ulysses attention (--cp-impl ulysses) takes its head lists and runs its four
    all-to-alls through the student's functions."""
    from minipar.parallel.context import ulysses    # noqa: PLC0415
    calls = [0]

    def counted(fn):
        def run(*args):
            calls[0] += 1
            return fn(*args)
        return run

    ulysses.heads_of = lambda j, H, Hkv, C: np.asarray(student.heads_of(j, H, Hkv, C), dtype=np.int64)
    ulysses.to_heads = counted(lambda g, x, heads: student.to_heads(g, x, lists(heads)))
    ulysses.to_tokens = counted(lambda g, y, heads, n: student.to_tokens(g, y, lists(heads), n))
    return lambda: calls[0]
