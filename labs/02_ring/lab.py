"""Lab 02's seam and criteria (labs/framework.py says what a lab is).

Seam: minipar.comm.reduce_scatter / all_gather and their non-blocking forms, so every
reduce-scatter and all-gather of the trainer (ZeRO's above all) runs the student's ring.
Oracle: NumPy on every rank's inputs, gathered by MPI's own Allgather (the grader may use
MPI's collectives; the student may not), in groups of p = 2, 3, 4 and 5 ranks cut from 5.
"""
import os

import numpy as np
from mpi4py import MPI

from labs.framework import Criterion, Done, collective_uses, expect, extra_cases, gathered, trainer_flags
from minipar import comm

TITLE = "ring reduce-scatter and all-gather on point-to-point messages"
DTYPES = (np.float64, np.float32, np.int64, np.int32)
OPS = {"sum": np.add.reduce, "max": np.maximum.reduce, "min": np.minimum.reduce}
COLLECTIVES = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "scatter", "gather",
               "all_reduce_async", "reduce_scatter_async", "all_gather_async"}


def sizes_for(p: int) -> list[int]:
    """Empty, one element, fewer than p, p +- 1, odd, and large enough for real pieces; and a
    teacher's extra "sizes" ($MINIPAR_LAB_EXTRA/02_ring/cases.json)."""
    extra = extra_cases(os.path.dirname(os.path.abspath(__file__))).get("sizes", [])
    return sorted({0, 1, p - 1, p, p + 1, 2 * p - 1, 7, 13, 96, 1001, *map(int, extra)})


def groups():
    """(p, Group or None) for p = 2..5: ranks 0..p-1 of the world, the rest sit it out."""
    world = MPI.COMM_WORLD
    for p in range(2, min(5, world.Get_size()) + 1):
        sub = world.Split(0 if world.Get_rank() < p else MPI.UNDEFINED, world.Get_rank())
        yield p, (comm.Group(sub) if sub != MPI.COMM_NULL else None)


def case_input(p, r, n, dtype, salt=0):
    """Rank r's input of a case; a teacher's "seed" ($MINIPAR_LAB_EXTRA/02_ring/cases.json)
    draws other values for every case."""
    seed = int(extra_cases(os.path.dirname(os.path.abspath(__file__))).get("seed", 0))
    rng = np.random.default_rng([p, r, n, np.dtype(dtype).num, salt, seed])
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, size=n).astype(dtype)
    return rng.standard_normal(n).astype(dtype)


# --- the criteria -------------------------------------------------------------------------

def check_static(student):
    """The student's file calls no MPI collective (the scan minipar's own code passes), nor
    minipar.comm's dispatcher (comm.reduce_scatter would grade minipar, not the student)."""
    found = collective_uses(student, COLLECTIVES)
    assert not found, "communicates other than by g.begin / sendrecv: " + "; ".join(found[:3])


def check_reduce_scatter(student):
    for p, g in groups():
        if g is None:
            continue
        r = g.rank
        for n in sizes_for(p):
            for dtype in DTYPES:
                for op in ("sum", "max") if dtype is np.float64 else ("sum",):
                    x = case_input(p, r, n, dtype)
                    keep, inputs = x.copy(), gathered(g, x)
                    got = student.reduce_scatter(g, x, op)
                    want = np.array_split(OPS[op](inputs, axis=0, dtype=dtype), p)[r]
                    # a sum in another order: a few roundings of the largest input apart
                    exact = op != "sum" or np.issubdtype(dtype, np.integer) or not n
                    atol = 0.0 if exact else 4 * p * np.finfo(dtype).eps * float(np.abs(inputs).max())
                    what = f"p={p} rank {r} n={n} {np.dtype(dtype).name} op={op}"
                    assert isinstance(got, np.ndarray), f"{what}: returned {type(got).__name__}, not an array"
                    expect(got, want, what, atol=atol)
                    assert np.array_equal(x, keep), f"{what}: the input x was modified"
        g.comm.Free()


def check_all_gather(student):
    for p, g in groups():
        if g is None:
            continue
        r = g.rank
        for n in sizes_for(p):
            for dtype in DTYPES:
                mine = case_input(p, r, n, dtype, salt=1)
                keep, want = mine.copy(), gathered(g, mine).ravel()
                got = student.all_gather(g, mine)
                what = f"p={p} rank {r} n={n} each {np.dtype(dtype).name}"
                expect(got, want, what)
                assert np.array_equal(mine, keep), f"{what}: the input piece was modified"
            # unequal pieces: those of np.array_split(range(n), p), as reduce_scatter returns
            sizes = [len(a) for a in np.array_split(np.arange(n), p)]
            full = case_input(p, 0, n, np.float64, salt=2)
            piece = np.array_split(full, p)[r].copy()
            expect(student.all_gather(g, piece, sizes), full, f"p={p} rank {r} n={n} pieces {sizes}")
        g.comm.Free()


def check_ledger(student):
    """Bytes sent, from minipar's ledger: a ring sends each element but one piece's once."""
    for p, g in groups():
        if g is None:
            continue
        r = g.rank
        for n in (p * 1000, p * 17, 1001):
            for name, run in (("reduce_scatter", lambda x: student.reduce_scatter(g, x)),
                              ("all_gather", lambda x: student.all_gather(g, x))):
                x = case_input(p, r, n, np.float64)
                comm.reset_traffic()
                run(x)
                t = comm.traffic()
                sent = sum(v["bytes_sent"] for v in t.values())
                elements = n * (p if name == "all_gather" else 1)
                total = elements * 8
                pieces = [len(a) * 8 for a in np.array_split(np.arange(elements), p)]
                what = f"{name} p={p} rank {r} of {total} B"
                assert set(t) == {name}, f"{what}: the ledger holds {sorted(t)}; begin the call as " \
                                         f"g.begin({name!r}, p - 1)"
                if elements % p == 0:
                    assert sent == (p - 1) * total // p, f"{what}: sent {sent} B, a ring sends (p-1)/p of it = " \
                                                         f"{(p - 1) * total // p} B"
                else:
                    assert sent in {total - k for k in pieces}, \
                        f"{what}: sent {sent} B, a ring sends all but one piece ({sorted(total - k for k in pieces)})"
        g.comm.Free()


def install(student):
    """The trainer's reduce-scatters and all-gathers, blocking and not, become the student's."""
    calls = [0]

    def reduce_scatter(g, x, op="sum", *, out=None):
        calls[0] += 1
        y = student.reduce_scatter(g, x, op)
        if out is None:
            return y
        out[...] = y
        return out

    def all_gather(g, x, sizes=None, *, out=None):
        calls[0] += 1
        y = student.all_gather(g, x, sizes)
        if out is None:
            return y
        out[...] = y
        return out

    comm.reduce_scatter, comm.all_gather = reduce_scatter, all_gather
    comm.reduce_scatter_async = lambda g, x, op="sum", *, out=None: Done(reduce_scatter(g, x, op, out=out))
    comm.all_gather_async = lambda g, x, sizes=None, *, out=None: Done(all_gather(g, x, sizes, out=out))
    return lambda: calls[0]



CRITERIA = [
    Criterion("no MPI collective, none of minipar's", check=check_static, timeout=30,
              hint="communicate only with call = g.begin(name, steps) and call.sendrecv(...)"),
    Criterion("reduce_scatter against NumPy", ranks=5, check=check_reduce_scatter, timeout=30,
              hint="print the piece indices you send and receive at each step for p = 3; "
                   "MINIPAR_TRACE=1 prints every message"),
    Criterion("all_gather against NumPy", ranks=5, check=check_all_gather, timeout=30,
              hint="the piece a rank sends at step s is the one it received at step s-1"),
    Criterion("bytes in the ledger", ranks=5, check=check_ledger, timeout=30,
              hint="send one piece per step, not the whole array; comm.traffic() after a call "
                   "shows what was counted"),
    Criterion("trainer --dp 4 --zero 2 --verify", ranks=4, trainer=trainer_flags("--dp", "4", "--zero", "2"),
              timeout=90, hint="ZeRO-2 reduce-scatters every gradient unit and all-gathers the "
                               "parameters with your functions; the twin is one process"),
]
