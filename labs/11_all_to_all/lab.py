"""Lab 11's seam and criteria (labs/framework.py says what a lab is).

Seam: minipar.comm.all_to_all and all_to_all_async, so every all-to-all of the trainer (the
dispatch and combine of a mixture-of-experts layer with --ep, forward and backward, and the
experts' row counts) runs the student's exchange.
Oracle: every rank's pieces, gathered by MPI's own allgather (the grader may use MPI's
collectives; the student may not), in groups of p = 2, 3, 4 and 5 ranks cut from 5.
"""
import os

import numpy as np
from mpi4py import MPI

from labs.framework import Criterion, Done, collective_uses, expect, extra_cases, trainer_flags
from minipar import comm

TITLE = "the pairwise all-to-all (a mixture of experts' dispatch and combine)"
HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = (np.float64, np.float32, np.int64, np.float16)
REST = ((), (3,))                       # x is (rows, *rest): 1-D and 2-D
COLLECTIVES = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "scatter", "gather",
               "all_to_all", "all_to_all_async", "all_reduce_async", "reduce_scatter_async",
               "all_gather_async"}


def groups():
    """(p, Group or None) for p = 2..5: ranks 0..p-1 of the world, the rest sit it out."""
    world = MPI.COMM_WORLD
    for p in range(2, min(5, world.Get_size()) + 1):
        sub = world.Split(0 if world.Get_rank() < p else MPI.UNDEFINED, world.Get_rank())
        yield p, (comm.Group(sub) if sub != MPI.COMM_NULL else None)


def rng_for(*key):
    """A case's random numbers; a teacher's "seed" ($MINIPAR_LAB_EXTRA/11_all_to_all/cases.json)
    draws other values for every case."""
    seed = int(extra_cases(HERE).get("seed", 0))
    return np.random.default_rng([*key, seed])


def case_input(p, r, rows, rest, dtype, salt=0):
    """Rank r's x: rows x rest of small integers (exact in float16)."""
    values = rng_for(p, r, rows, len(rest), np.dtype(dtype).num, salt).integers(-500, 500, (rows, *rest))
    return values.astype(dtype)


def wanted(g, x, counts):
    """What rank g.rank must receive: each rank's piece for it, in source order, and how many rows."""
    xs, cs = g.comm.allgather(x), g.comm.allgather(list(counts))
    r = g.rank
    starts = [np.cumsum([0] + c) for c in cs]
    parts = [xs[s][starts[s][r]:starts[s][r + 1]] for s in range(g.size)]
    return np.concatenate(parts), [c[r] for c in cs]


def check_result(student, g, x, sizes, what):
    keep = x.copy()
    counts = [x.shape[0] // g.size] * g.size if sizes is None else sizes
    want, received = wanted(g, x, counts)
    got = student.all_to_all(g, x, sizes)
    assert isinstance(got, tuple) and len(got) == 2, f"{what}: return (y, received), got {type(got).__name__}"
    y, rows = got
    assert isinstance(y, np.ndarray), f"{what}: y is {type(y).__name__}, not an array"
    expect(y, want, what)
    assert [int(n) for n in rows] == received, f"{what}: received {list(rows)}, want {received}"
    assert np.array_equal(x, keep), f"{what}: the input x was modified"


# --- the criteria -------------------------------------------------------------------------

def check_static(student):
    """The student's file calls no MPI collective (the scan minipar's own code passes), nor
    minipar.comm's dispatcher (comm.all_to_all would grade minipar, not the student)."""
    found = collective_uses(student, COLLECTIVES)
    assert not found, "communicates other than by g.begin / sendrecv: " + "; ".join(found[:3])


def check_equal(student):
    extra = [int(m) for m in extra_cases(HERE).get("rows_per_piece", [])]
    for p, g in groups():
        if g is None:
            continue
        for m in sorted({0, 1, 5, *extra}):
            for rest in REST:
                for dtype in DTYPES:
                    x = case_input(p, g.rank, m * p, rest, dtype)
                    check_result(student, g, x, None,
                                 f"p={p} rank {g.rank} equal pieces of {m} row(s) x {rest} {np.dtype(dtype).name}")
        g.comm.Free()


def check_variable(student):
    for p, g in groups():
        if g is None:
            continue
        for case in range(4):
            rng = rng_for(p, g.rank, case, 99)
            sizes = [int(n) for n in rng.integers(0, 4, p)]        # zeros among them
            if case == 1 and g.rank == 0:
                sizes = [0] * p                                    # a rank that sends nothing
            if case == 2:
                sizes = [0] * p                                    # nobody sends anything
            if case == 3:
                sizes = [3 if j == (g.rank + 1) % p else 0 for j in range(p)]   # one peer each
            for rest, dtype in ((), np.float64), ((2, 3), np.int64):
                x = case_input(p, g.rank, sum(sizes), rest, dtype, salt=1 + case)
                check_result(student, g, x, sizes, f"p={p} rank {g.rank} sizes {sizes} x {rest} "
                                                   f"{np.dtype(dtype).name}")
        g.comm.Free()


def check_ledger(student):
    """Bytes sent, from minipar's ledger: equal pieces (p-1)/p of x; with sizes, a row count
    (8 bytes) to each peer and the rows for the others."""
    for p, g in groups():
        if g is None:
            continue
        r = g.rank
        for sizes in (None, [(r + j) % 3 for j in range(p)]):
            rows = 4 * p if sizes is None else sum(sizes)
            x = case_input(p, r, rows, (5,), np.float64, salt=9)
            comm.reset_traffic()
            student.all_to_all(g, x, sizes)
            t = comm.traffic()
            sent = sum(v["bytes_sent"] for v in t.values())
            what = f"p={p} rank {r} {'equal' if sizes is None else f'sizes {sizes}'} of {x.nbytes} B"
            assert set(t) == {"all_to_all"}, f"{what}: the ledger holds {sorted(t)}; begin the call as " \
                                             f"g.begin('all_to_all', steps)"
            if sizes is None:
                want = (p - 1) * x.nbytes // p
                assert sent == want, f"{what}: sent {sent} B, the pairwise exchange sends (p-1)/p of x = {want} B"
            else:
                want = 8 * (p - 1) + (rows - sizes[r]) * 5 * 8
                assert sent == want, f"{what}: sent {sent} B; want {want} B: 8 per peer for the counts and " \
                                     f"the {rows - sizes[r]} rows for the others"
        g.comm.Free()


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


MOE = ("--moe-experts", "4", "--moe-top-k", "2")

CRITERIA = [
    Criterion("no MPI collective, none of minipar's", check=check_static, timeout=30,
              hint="communicate only with call = g.begin('all_to_all', steps) and call.sendrecv(...)"),
    Criterion("equal pieces against NumPy", ranks=5, check=check_equal, timeout=60,
              hint="round k pairs r with r+k (send) and r-k (receive); the piece from rank s goes to "
                   "slot s of y; MINIPAR_TRACE=1 prints every message"),
    Criterion("variable sizes against NumPy", ranks=5, check=check_variable, timeout=60,
              hint="exchange the counts first, one int64 per peer, then size each receive from them"),
    Criterion("bytes in the ledger", ranks=5, check=check_ledger, timeout=60,
              hint="one call (g.begin once) for counts and rows; send each peer its piece only; "
                   "comm.traffic() after a call shows what was counted"),
    Criterion("trainer --dp 4 --ep 4 --moe-experts 4 --moe-top-k 2 --verify", ranks=4,
              trainer=trainer_flags("--dp", "4", "--ep", "4", *MOE), timeout=120,
              hint="each MoE layer dispatches and combines with your all-to-all (variable sizes, no "
                   "capacity) and sends the experts' row counts (equal pieces), forward and backward"),
]
