"""Lab 11, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's all-to-all, and the seam. Nothing here judges; lab.py does, in the grader.

Cases: groups of p = 1 (rank 0 alone), 2, 3, 4 and 5 ranks cut from 5; equal pieces of 0, 1
and 5 rows (and a teacher's "rows_per_piece" in cases.json) of 1-D, 2-D and 3-D rows in five
dtypes; pieces of any size, zeros among them: a rank that sends nothing, one that receives
nothing, nobody sending, one peer each, only the own piece. Each rank's x and sizes are drawn
from its own seed, so the grader rebuilds every rank's without being told.
"""
import os

import numpy as np

from labs.framework import extra_cases, rank_groups
from minipar.comm.calls import Done
from labs.results import key
from minipar import comm

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = ("float64", "float32", "int64", "float16", "int32")
REST = ((), (3,), (2, 3))               # x is (rows, *rest): 1-D, 2-D and 3-D
P_MAX = 5
# minipar's own all-to-alls (the dispatcher and each algorithm) and the other collectives of
# minipar.comm: reached from the student's file, each raises (labs/child.py)
OWN = [f"minipar.comm:{n}" for n in ("all_to_all", "all_to_all_async", "all_reduce", "all_reduce_async",
                                     "reduce_scatter", "reduce_scatter_async", "all_gather", "all_gather_async",
                                     "broadcast", "reduce", "scatter", "gather")] + \
      [f"minipar.comm.algorithms.alltoall:{n}" for n in ("pairwise", "start_pairwise", "bruck", "start_bruck")] + \
      [f"minipar.comm.algorithms.hierarchical_alltoall:{n}" for n in ("all_to_all", "start_all_to_all")]


def rng_for(*parts):
    """A case's random numbers; a teacher's "seed" ($MINIPAR_LAB_EXTRA/11_all_to_all/cases.json)
    draws other values for every case."""
    seed = int(extra_cases(HERE).get("seed", 0))
    return np.random.default_rng([*parts, seed])


def case_input(p, r, rows, rest, dtype, salt=0):
    """Rank r's x: rows x rest of small integers (exact in float16)."""
    values = rng_for(p, r, rows, len(rest), np.dtype(dtype).num, salt).integers(-500, 500, (rows, *rest))
    return values.astype(dtype)


def equal_cases():
    """(rows per piece, rest, dtype) of the equal-pieces criterion."""
    extra = [int(m) for m in extra_cases(HERE).get("rows_per_piece", [])]
    return [(m, rest, d) for m in sorted({0, 1, 5, *extra}) for rest in REST for d in DTYPES]


VARIABLE = ("random counts, zeros among them", "rank 0 sends nothing", "nobody sends anything",
            "one peer each", "everything to rank 0 (the others receive nothing)", "only the own piece")
VARIABLE_X = (((), "float64"), ((2, 3), "int64"), ((3,), "float32"), ((), "float16"))


def variable_sizes(p, r, case):
    """Rank r's sizes in variable-sizes case `case` (an index into VARIABLE)."""
    sizes = [int(n) for n in rng_for(p, r, case, 99).integers(0, 4, p)]        # zeros among them
    if case == 1 and r == 0:
        sizes = [0] * p                                                         # a rank that sends nothing
    if case == 2:
        sizes = [0] * p                                                         # nobody sends anything
    if case == 3:
        sizes = [3 if j == (r + 1) % p else 0 for j in range(p)]                # one peer each
    if case == 4:
        sizes = [2 + r if j == 0 else 0 for j in range(p)]                      # all to rank 0
    if case == 5:
        sizes = [4 if j == r else 0 for j in range(p)]                          # no message of rows
    return sizes


def ledger_cases(p, r):
    """(sizes or None, rows, rest, dtype) of the ledger criterion: equal pieces in float64 and
    float32; sizes with zeros in float64 and float16 (the counts are int64 whatever x's dtype)."""
    mixed = [(r + j) % 3 for j in range(p)]
    return [(None, 4 * p, (5,), "float64"), (None, 2 * p, (3,), "float32"),
            (mixed, sum(mixed), (5,), "float64"), (mixed, sum(mixed), (2,), "float16")]


def groups():
    """(p, Group) for p = 1..5 that hold this rank: ranks 0..p-1 of the world."""
    return rank_groups(range(1, P_MAX + 1))


def call_and_record(student, out, g, k, x, sizes):
    """all_to_all(g, x, sizes): record what it returned (its arrays as they are now), x and the
    sizes list handed in as they are afterwards, and whether y shares memory with x."""
    passed = None if sizes is None else list(sizes)
    got = student.all_to_all(g, x, passed)
    y = got[0] if type(got) is tuple and len(got) == 2 else None
    if type(got) is tuple:
        got = tuple(np.array(v) if type(v) is np.ndarray else v for v in got)
    out.put(k, got)
    out.put(key(k, "x after"), x)
    if passed is not None:
        out.put(key(k, "sizes after"), passed)
    out.put(key(k, "aliases x"), bool(isinstance(y, np.ndarray) and np.shares_memory(y, x)))


# --- what the child runs ----------------------------------------------------------------------

def equal(student, out):
    for p, g in groups():
        r = g.rank
        for m, rest, dtype in equal_cases():
            out.case(f"p={p} rank {r} equal pieces of {m} row(s) x {rest} {dtype}")
            call_and_record(student, out, g, key("eq", p, r, m, len(rest), dtype),
                            case_input(p, r, m * p, rest, dtype), None)


def variable(student, out):
    for p, g in groups():
        r = g.rank
        for case, name in enumerate(VARIABLE):
            sizes = variable_sizes(p, r, case)
            for rest, dtype in VARIABLE_X:
                out.case(f"p={p} rank {r} sizes {sizes} ({name}) x {rest} {dtype}")
                call_and_record(student, out, g, key("var", p, r, case, len(rest), dtype),
                                case_input(p, r, sum(sizes), rest, dtype, salt=1 + case), sizes)


def ledger(student, out):
    """The bytes minipar's ledger counted for one call, and what it counted them under."""
    for p, g in groups():
        r = g.rank
        for i, (sizes, rows, rest, dtype) in enumerate(ledger_cases(p, r)):
            out.case(f"p={p} rank {r} {'equal' if sizes is None else f'sizes {sizes}'} x {rest} {dtype}, "
                     f"counting bytes")
            x = case_input(p, r, rows, rest, dtype, salt=9)
            comm.reset_traffic()
            student.all_to_all(g, x, sizes)
            t = comm.traffic()
            out.put(key("sent", p, r, i), int(sum(v["bytes_sent"] for v in t.values())))
            out.put(key("calls", p, r, i), {op: int(v["calls"]) for op, v in t.items()})


# --- the seam ---------------------------------------------------------------------------------

def install(student):
    """The trainer's all-to-alls, blocking and not, become the student's."""
    calls = [0]

    def all_to_all(g, x, *, sizes=None, out=None, return_sizes=False):
        calls[0] += 1
        y, received = student.all_to_all(g, x, None if sizes is None else list(sizes))
        if out is not None:
            out[...] = y
            y = out
        return (y, list(received)) if return_sizes else y

    comm.all_to_all = all_to_all
    comm.all_to_all_async = lambda g, x, **kw: Done(all_to_all(g, x, **kw))
    return lambda: calls[0]
