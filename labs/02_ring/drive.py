"""Lab 02, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's ring, and the seam. Nothing here judges; lab.py does, in the grader.

Cases: groups of p = 1 (rank 0 alone), 2, 3, 4 and 5 ranks cut from 5; sizes from empty to
1001 (and a teacher's "sizes" in cases.json); four dtypes; every op the contract names; 1-D
inputs and, for some sizes, 2-D and 3-D ones (the contract says x.ravel()). Each rank's input
is drawn from its own seed, so the grader rebuilds every rank's input without being told.
"""
import os

import numpy as np

from labs.framework import extra_cases, rank_groups
from minipar.comm.calls import Done
from labs.results import key
from minipar import comm

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = ("float64", "float32", "int64", "int32")
OPS = ("sum", "max", "min")
P_MAX = 5
# minipar's own reduce-scatter and all-gather, in every form: reached from the student's file,
# each raises (labs/child.py)
OWN = [f"minipar.comm:{n}" for n in ("reduce_scatter", "all_gather", "all_reduce", "reduce_scatter_async",
                                     "all_gather_async", "all_reduce_async", "broadcast", "reduce", "scatter",
                                     "gather", "all_to_all")] + \
      [f"minipar.comm.algorithms.ring:{n}" for n in ("reduce_scatter", "all_gather", "all_reduce", "start_reduce_scatter",
                                          "start_all_gather", "start_all_reduce")]


def sizes_for(p: int) -> list[int]:
    """Empty, one element, fewer than p, p +- 1, 2p (a whole number of pieces), odd, and large
    enough for real pieces; and a teacher's extra "sizes" ($MINIPAR_LAB_EXTRA/02_ring/cases.json)."""
    extra = extra_cases(HERE).get("sizes", [])
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 2 * p, 2 * p - 1, 7, 13, 96, 1001, *map(int, extra)})


SHAPES = {96: (8, 12), 1001: (7, 11, 13), 13: (13, 1)}   # some inputs are not 1-D: the contract ravels


def shape_of(n: int) -> tuple:
    return SHAPES.get(n, (n,))


def case_input(p, r, n, dtype, salt=0):
    """Rank r's input of a case, shaped shape_of(n); a teacher's "seed" draws other values."""
    seed = int(extra_cases(HERE).get("seed", 0))
    rng = np.random.default_rng([p, r, n, np.dtype(dtype).num, salt, seed])
    if np.issubdtype(np.dtype(dtype), np.integer):
        x = rng.integers(-1000, 1000, size=n).astype(dtype)
    else:
        x = rng.standard_normal(n).astype(dtype)
    return x.reshape(shape_of(n))


def rs_cases(p: int):
    """(n, dtype, op) of the reduce-scatter criterion."""
    return [(n, d, op) for n in sizes_for(p) for d in DTYPES for op in OPS]


# all_gather's `sizes` as any caller may give them, not np.array_split's (largest first): an
# empty piece before the last, and a last piece larger than the others
UNEVEN = (3, 0, 5, 1, 9)


def uneven_sizes(p: int) -> list[int]:
    return list(UNEVEN[:p])


def ledger_sizes(p: int) -> list[int]:
    return [p * 1000, p * 17, 1001, 0]


def uneven_piece(p: int, r: int):
    """Rank r's piece of the uneven case: its slice of one drawn array cut at uneven_sizes(p)."""
    at = np.cumsum([0, *uneven_sizes(p)])
    return case_input(p, 0, int(at[-1]), "float64", salt=3).ravel()[at[r]:at[r + 1]].copy()


def groups():
    """(p, Group) for p = 1..5 that hold this rank: ranks 0..p-1 of the world."""
    return rank_groups(range(1, P_MAX + 1))


def call_and_record(out, k: str, fn, x):
    """fn(x): record what it returned, x as it is afterwards, and whether the two share memory."""
    got = fn(x)
    out.put(k, got)
    out.put(key(k, "x after"), x)
    out.put(key(k, "aliases x"), bool(isinstance(got, np.ndarray) and np.shares_memory(got, x)))


# --- what the child runs ----------------------------------------------------------------------

def reduce_scatter(student, out):
    for p, g in groups():
        r = g.rank
        for n, dtype, op in rs_cases(p):
            out.case(f"reduce_scatter p={p} rank {r} n={n} {dtype} op={op}")
            call_and_record(out, key("rs", p, r, n, dtype, op),
                            lambda x: student.reduce_scatter(g, x, op), case_input(p, r, n, dtype))


def all_gather(student, out):
    for p, g in groups():
        r = g.rank
        for n in sizes_for(p):
            for dtype in DTYPES:
                out.case(f"all_gather p={p} rank {r} each n={n} {dtype}")
                call_and_record(out, key("ag", p, r, n, dtype), lambda x: student.all_gather(g, x),
                                case_input(p, r, n, dtype, salt=1))
            sizes = [len(a) for a in np.array_split(np.arange(n), p)]
            out.case(f"all_gather p={p} rank {r} pieces {sizes}")
            piece = np.array_split(case_input(p, 0, n, "float64", salt=2).ravel(), p)[r].copy()
            call_and_record(out, key("agv", p, r, n), lambda x: student.all_gather(g, x, sizes), piece)
        sizes = uneven_sizes(p)
        out.case(f"all_gather p={p} rank {r} pieces {sizes}")
        piece = uneven_piece(p, r)
        call_and_record(out, key("agu", p, r), lambda x: student.all_gather(g, x, sizes), piece)


def ledger(student, out):
    """The bytes minipar's ledger counted for each call, and the names it counted them under."""
    for p, g in groups():
        r = g.rank
        for n in ledger_sizes(p):
            for name in ("reduce_scatter", "all_gather"):
                out.case(f"{name} p={p} rank {r} n={n} float64, counting bytes")
                x = case_input(p, r, n, "float64")
                comm.reset_traffic()
                getattr(student, name)(g, x)
                t = comm.traffic()
                out.put(key("sent", name, p, r, n), int(sum(v["bytes_sent"] for v in t.values())))
                out.put(key("names", name, p, r, n), sorted(t))


# --- the seam ---------------------------------------------------------------------------------

def install(student):
    """The trainer's reduce-scatters and all-gathers, blocking and not, become the student's."""
    calls = [0]

    def reduce_scatter_seam(g, x, op="sum", *, out=None):
        calls[0] += 1
        y = student.reduce_scatter(g, x, op)
        if out is None:
            return y
        out[...] = y
        return out

    def all_gather_seam(g, x, sizes=None, *, out=None):
        calls[0] += 1
        y = student.all_gather(g, x, sizes)
        if out is None:
            return y
        out[...] = y
        return out

    comm.reduce_scatter, comm.all_gather = reduce_scatter_seam, all_gather_seam
    comm.reduce_scatter_async = lambda g, x, op="sum", *, out=None: Done(reduce_scatter_seam(g, x, op, out=out))
    comm.all_gather_async = lambda g, x, sizes=None, *, out=None: Done(all_gather_seam(g, x, sizes, out=out))
    return lambda: calls[0]
