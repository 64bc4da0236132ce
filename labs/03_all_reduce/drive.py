"""Lab 03, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's two all-reduces, and the seam. Nothing here judges; lab.py does, in the grader.

Cases: groups of p = 1 (rank 0 alone), 2, 3, 4 and 5 ranks cut from 5 (p = 3 and 5 run
doubling's fix-up); sizes from empty to 1001 (and a teacher's "sizes" in cases.json); four
dtypes; every op the contract names; 1-D inputs, 2-D and 3-D ones for some sizes, and a
transposed (not contiguous) one. Each rank's input is drawn from its own seed, so the grader
rebuilds every rank's input without being told.
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
FUNCTIONS = ("all_reduce_ring", "all_reduce_doubling")
P_MAX = 5
# doubling also on p = 6: q = 4 with two extra ranks (4 -> 0, 5 -> 1), where p = 3 and 5 have one
DOUBLING_P_MAX = 6
# minipar's own all-reduces, in every form (the dispatcher and each algorithm's module), and
# the other collectives of minipar.comm: reached from the student's file, each raises
# (labs/child.py)
OWN = [f"minipar.comm:{n}" for n in ("all_reduce", "all_reduce_async", "reduce_scatter", "all_gather",
                                     "reduce_scatter_async", "all_gather_async", "broadcast", "reduce",
                                     "scatter", "gather", "all_to_all", "all_to_all_async")] + \
      [f"minipar.comm.algorithms.{m}:{n}" for m in ("ring", "doubling", "direct", "hierarchical")
       for n in ("all_reduce", "start_all_reduce", "reduce_scatter", "start_reduce_scatter", "all_gather",
                 "start_all_gather")] + \
      [f"minipar.comm.algorithms.straight_line:{n}" for n in ("all_reduce_into", "all_reduce_direct_into",
                                                    "reduce_scatter_into", "all_gather_into")]


def sizes_for(p: int) -> list[int]:
    """Empty, one element, fewer than p, p +- 1, odd, and large enough for real pieces; and a
    teacher's extra "sizes" ($MINIPAR_LAB_EXTRA/03_all_reduce/cases.json)."""
    extra = extra_cases(HERE).get("sizes", [])
    return sorted({0, 1, max(p - 1, 0), p, p + 1, 2 * p - 1, 7, 13, 96, 1001, *map(int, extra)})


SHAPES = {96: (8, 12), 1001: (7, 11, 13), 13: (13, 1)}   # some inputs are not 1-D: any shape


def shape_of(n: int) -> tuple:
    return SHAPES.get(n, (n,))


def case_input(p, r, shape, dtype, salt=0):
    """Rank r's input: integers in [-1000, 1000), or normal floats (sums round); a teacher's
    "seed" draws other values for every case."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    seed = int(extra_cases(HERE).get("seed", 0))
    rng = np.random.default_rng([p, r, *shape, np.dtype(dtype).num, salt, seed])
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def cases(p):
    """(shape, dtype, op, transposed) of the NumPy criteria: every size of sizes_for(p) (some
    2-D or 3-D) in every dtype with every op; a (p+1, 3) input; and the transpose of a
    (3, p+1) one (not C-contiguous)."""
    out = [(shape_of(n), d, op, False) for n in sizes_for(p) for d in DTYPES for op in OPS]
    out += [((p + 1, 3), "float64", op, False) for op in OPS]
    out += [((3, p + 1), d, op, True) for d in DTYPES for op in OPS]   # x.T: not C-contiguous
    return out


def p_values(name) -> range:
    """The group sizes a function's NumPy criterion runs: 1..5, and 6 for doubling."""
    return range(1, (DOUBLING_P_MAX if name == "all_reduce_doubling" else P_MAX) + 1)


def cases_for(name, p):
    """cases(p), and on doubling's p = 6 a few of them (what it adds is two extra ranks)."""
    if p > P_MAX:
        return [((n,), d, op, False) for n in (1, 7, 96) for d in ("float64", "int32") for op in ("sum", "max")]
    return cases(p)


def case_x(p, r, shape, dtype, transposed, salt=0):
    """The array rank r passes in a case (the transpose of its input when `transposed`)."""
    x = case_input(p, r, shape, dtype, salt)
    return x.T if transposed else x


def case_key(name, p, r, shape, dtype, op, transposed):
    return key(name, p, r, "x".join(map(str, shape)), dtype, op, "T" if transposed else "C")


def describe(name, p, r, shape, dtype, op, transposed):
    shown = tuple(reversed(shape)) if transposed else tuple(shape)
    return f"{name} p={p} rank {r} shape {shown}{' (transposed)' if transposed else ''} {dtype} op={op}"


IDENTICAL = [(n, d) for n in (7, 96, 1001) for d in ("float64", "float32")]


def ledger_cases(name, p):
    """(n, dtype) of the ledger criterion: for the ring, p dividing n (in two dtypes), not
    dividing it, an int32 one and an empty x; for doubling, large and small, and empty."""
    if name == "all_reduce_ring":
        return [(p * 1000, "float64"), (p * 17, "float32"), (1001, "float64"), (13, "int32"), (0, "float64")]
    return [(1000, "float64"), (13, "float32"), (1, "float64"), (96, "int64"), (0, "float32")]


def groups(smallest=1, largest=P_MAX):
    """(p, Group) for p = smallest..largest that hold this rank: ranks 0..p-1 of the world."""
    return rank_groups(range(smallest, largest + 1))


def snapshot(v):
    """The returned value as it is now (an array the student's code keeps and reuses would
    otherwise be recorded as it is at the end)."""
    return np.array(v) if type(v) is np.ndarray else v


# --- what the child runs ----------------------------------------------------------------------

def against_numpy(student, out, name):
    fn = getattr(student, name)
    for p, g in groups(largest=p_values(name)[-1]):
        r = g.rank
        for shape, dtype, op, transposed in cases_for(name, p):
            out.case(describe(name, p, r, shape, dtype, op, transposed))
            x = case_x(p, r, shape, dtype, transposed)
            k = case_key(name, p, r, shape, dtype, op, transposed)
            got = fn(g, x, op)
            out.put(k, snapshot(got))
            out.put(key(k, "x after"), np.array(x))
            out.put(key(k, "aliases x"), bool(isinstance(got, np.ndarray) and np.shares_memory(got, x)))


def ring(student, out):
    against_numpy(student, out, "all_reduce_ring")


def doubling(student, out):
    against_numpy(student, out, "all_reduce_doubling")


def identical(student, out):
    """Every rank's float sums, recorded whole: the grader compares them bit for bit."""
    for p, g in groups(2):
        r = g.rank
        for name in FUNCTIONS:
            fn = getattr(student, name)
            for n, dtype in IDENTICAL:
                out.case(f"{name} p={p} rank {r} n={n} {dtype} op=sum (the same bits on every rank)")
                out.put(key("same", name, p, r, n, dtype), snapshot(fn(g, case_input(p, r, n, dtype, salt=3), "sum")))


def ledger(student, out):
    """The bytes minipar's ledger counted for one call, and what it counted them under."""
    for p, g in groups():
        r = g.rank
        for name in FUNCTIONS:
            fn = getattr(student, name)
            for n, dtype in ledger_cases(name, p):
                out.case(f"{name} p={p} rank {r} n={n} {dtype}, counting bytes")
                x = case_input(p, r, n, dtype)
                comm.reset_traffic()
                fn(g, x)
                t = comm.traffic()
                k = key("ledger", name, p, r, n, dtype)
                out.put(key(k, "sent"), int(sum(v["bytes_sent"] for v in t.values())))
                out.put(key(k, "calls"), {op: int(v["calls"]) for op, v in t.items()})


# --- the seam ---------------------------------------------------------------------------------

class Calls:
    """The seam's counter: calls() is how many all-reduces ran the student's code here;
    record(out) hands back how many went each way (the grader wants both)."""

    def __init__(self):
        self.ring = self.doubling = 0

    def __call__(self):
        return self.ring + self.doubling

    def record(self, out):
        out.put("trainer ring calls", self.ring)
        out.put("trainer doubling calls", self.doubling)


def install(student):
    """The trainer's all-reduces, blocking and not, become the student's: doubling up to
    comm.ALL_REDUCE_DOUBLING_MAX_BYTES, the ring above (minipar itself uses direct exchange
    there on p <= 8; the lab wants the ring)."""
    calls = Calls()

    def all_reduce(g, x, op="sum", *, out=None):
        x = np.asarray(x)
        if x.nbytes > comm.ALL_REDUCE_DOUBLING_MAX_BYTES:
            calls.ring += 1
            y = student.all_reduce_ring(g, x, op)
        else:
            calls.doubling += 1
            y = student.all_reduce_doubling(g, x, op)
        if out is None:
            return y
        out[...] = y                             # out may be x itself (the buckets: in place)
        return out

    comm.all_reduce = all_reduce
    comm.all_reduce_async = lambda g, x, op="sum", *, out=None: Done(all_reduce(g, x, op, out=out))
    return calls
