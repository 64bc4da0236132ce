"""Lab 02's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): minipar.comm.reduce_scatter / all_gather and their non-blocking forms,
so every reduce-scatter and all-gather of the trainer (ZeRO's above all) runs the student's ring.
Oracle: NumPy on every rank's input, which the grader draws itself from the cases' seeds
(drive.case_input); the child only hands back what each rank's call returned, the input as
it was afterwards, and the ledger's counts.
"""
import os

import numpy as np

from labs.framework import Criterion, expect, load_drive, trainer_flags
from labs.results import key
from labs.scan import Allowed

TITLE = "ring reduce-scatter and all-gather on point-to-point messages"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
REDUCE = {"sum": np.add.reduce, "max": np.maximum.reduce, "min": np.minimum.reduce}
ALLOWED = Allowed(
    modules={"minipar.comm": {"traffic", "reset_traffic", "CommTimeout"}},
    refused={"minipar.comm.reduce_scatter": "minipar's own collective: this lab grades yours",
             "minipar.comm.all_gather": "minipar's own collective: this lab grades yours"})


def inputs(p, n, dtype, salt=0):
    return np.stack([drive.case_input(p, r, n, dtype, salt).ravel() for r in range(p)]) if n else \
        np.zeros((p, 0), dtype=dtype)


def untouched(res, k, rank, x, what):
    """The input as the child saw it after the call, and whether the result shares its memory."""
    after = res.get(rank, key(k, "x after"))
    assert isinstance(after, np.ndarray) and after.shape == x.shape and np.array_equal(after, x), \
        f"{what}: the input x was modified"
    assert res.get(rank, key(k, "aliases x")) is False, \
        f"{what}: the result shares memory with the input x (return a new array)"


def judge_reduce_scatter(res):
    for p in range(1, drive.P_MAX + 1):
        for n, dtype, op in drive.rs_cases(p):
            xs = inputs(p, n, dtype)
            total = REDUCE[op](xs, axis=0, dtype=np.dtype(dtype))
            # a sum in another order: a few roundings of the largest input apart
            exact = op != "sum" or np.issubdtype(np.dtype(dtype), np.integer) or not n
            atol = 0.0 if exact else 4 * p * np.finfo(np.dtype(dtype)).eps * float(np.abs(xs).max())
            for r in range(p):
                what = f"p={p} rank {r} n={n} shape {drive.shape_of(n)} {dtype} op={op}"
                k = key("rs", p, r, n, dtype, op)
                got = res.get(r, k)
                assert isinstance(got, np.ndarray), f"{what}: returned {type(got).__name__}, not an array"
                expect(got, np.array_split(total, p)[r], what, atol=atol)
                untouched(res, k, r, drive.case_input(p, r, n, dtype), what)


def judge_all_gather(res):
    for p in range(1, drive.P_MAX + 1):
        for n in drive.sizes_for(p):
            for dtype in drive.DTYPES:
                want = inputs(p, n, dtype, salt=1).ravel()
                for r in range(p):
                    what = f"p={p} rank {r} each n={n} shape {drive.shape_of(n)} {dtype}"
                    k = key("ag", p, r, n, dtype)
                    expect(res.get(r, k), want, what)
                    untouched(res, k, r, drive.case_input(p, r, n, dtype, salt=1), what)
            full = drive.case_input(p, 0, n, "float64", salt=2).ravel()
            sizes = [len(a) for a in np.array_split(np.arange(n), p)]
            for r in range(p):
                what = f"p={p} rank {r} n={n} pieces {sizes}"
                expect(res.get(r, key("agv", p, r, n)), full, what)
                assert res.get(r, key("agv", p, r, n, "aliases x")) is False, \
                    f"{what}: the result shares memory with the piece (return a new array)"
        sizes = drive.uneven_sizes(p)                     # not array_split's: where each piece starts is sum(sizes[:r])
        full = np.concatenate([drive.uneven_piece(p, r) for r in range(p)])
        for r in range(p):
            what = f"p={p} rank {r} pieces {sizes}"
            k = key("agu", p, r)
            expect(res.get(r, k), full, what)
            untouched(res, k, r, drive.uneven_piece(p, r), what)


def judge_ledger(res):
    """A ring sends each element but one piece's once: (p-1)/p of the array when p divides
    it, else all of it but one piece."""
    for p in range(1, drive.P_MAX + 1):
        for n in drive.ledger_sizes(p):
            for name in ("reduce_scatter", "all_gather"):
                elements = n * (p if name == "all_gather" else 1)
                total = elements * 8
                pieces = [len(a) * 8 for a in np.array_split(np.arange(elements), p)]
                for r in range(p):
                    what = f"{name} p={p} rank {r} of {total} B"
                    names, sent = res.get(r, key("names", name, p, r, n)), res.get(r, key("sent", name, p, r, n))
                    if p == 1 or total == 0:
                        assert sent == 0, f"{what}: sent {sent} B; with nothing to exchange a rank sends nothing"
                        continue
                    assert names == [name], f"{what}: the ledger holds {names}; begin the call as " \
                                            f"g.begin({name!r}, p - 1)"
                    if elements % p == 0:
                        assert sent == (p - 1) * total // p, \
                            f"{what}: sent {sent} B, a ring sends (p-1)/p of it = {(p - 1) * total // p} B"
                    else:
                        assert sent in {total - k for k in pieces}, \
                            f"{what}: sent {sent} B, a ring sends all but one piece ({sorted(total - k for k in pieces)})"


CRITERIA = [
    Criterion("reduce_scatter against NumPy", ranks=5, run="reduce_scatter", judge=judge_reduce_scatter,
              timeout=30, uses=("reduce_scatter",),
              hint="print the piece indices you send and receive at each step for p = 3; "
                   "MINIPAR_TRACE=1 prints every message"),
    Criterion("all_gather against NumPy", ranks=5, run="all_gather", judge=judge_all_gather, timeout=30,
              uses=("all_gather",), hint="the piece a rank sends at step s is the one it received at step s-1; "
                                          "with sizes, piece r starts at sum(sizes[:r]), whatever the sizes are"),
    Criterion("bytes in the ledger", ranks=5, run="ledger", judge=judge_ledger, timeout=30,
              uses=("reduce_scatter", "all_gather"),
              hint="send one piece per step, not the whole array; comm.traffic() after a call "
                   "shows what was counted"),
    Criterion("trainer --dp 4 --zero 2", ranks=4, trainer=trainer_flags("--dp", "4", "--zero", "2"),
              timeout=90, uses=("reduce_scatter", "all_gather"),
              hint="ZeRO-2 reduce-scatters every gradient unit and all-gathers the "
                   "parameters with your functions; the grader compares the run with one process"),
    Criterion("trainer --dp 4 --zero 3 float32", ranks=4,
              trainer=trainer_flags("--dp", "4", "--zero", "3", dtype="float32"), timeout=90,
              uses=("reduce_scatter", "all_gather"),
              hint="ZeRO-3 in float32: your functions get float32 buffers; the twin's tolerance is float32's"),
]
