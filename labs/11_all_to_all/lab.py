"""Lab 11's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): minipar.comm.all_to_all and all_to_all_async, so every all-to-all of the
trainer (the dispatch and combine of a mixture-of-experts layer with --ep, forward and
backward, and the experts' row counts) runs the student's exchange.
Oracle: every rank's pieces, which the grader draws itself from the cases' seeds
(drive.case_input, drive.variable_sizes); the child only hands back what each rank's call
returned, x as it was afterwards, and the ledger's counts.
"""
import os

import numpy as np

from labs.framework import Criterion, expect, load_drive, trainer_flags
from labs.results import key
from labs.scan import Allowed

TITLE = "the pairwise all-to-all (a mixture of experts' dispatch and combine)"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
OWN_REASON = "minipar's own all-to-all: this lab grades yours"
ALLOWED = Allowed(
    modules={"minipar.comm": {"traffic", "reset_traffic", "CommTimeout"}},
    refused={f"minipar.comm.{n}": OWN_REASON for n in ("all_to_all", "all_to_all_async", "alltoall",
                                                        "hierarchical_alltoall")})


def wanted(xs, counts, r):
    """What rank r must receive: each rank's piece for it, in source order, and how many rows."""
    starts = [np.cumsum([0] + list(c)) for c in counts]
    parts = [xs[s][starts[s][r]:starts[s][r + 1]] for s in range(len(xs))]
    return np.concatenate(parts), [int(c[r]) for c in counts]


def judge_case(res, r, k, x, want, received, what, sizes=None):
    """sizes: the rank's sizes handed in (None: equal pieces), which must come back untouched."""
    got = res.get(r, k)
    if not (isinstance(got, tuple) and len(got) == 2):
        kind = getattr(got, "typename", type(got).__name__)
        size = f" of {len(got)}" if isinstance(got, (tuple, list)) else ""
        raise AssertionError(f"{what}: return a tuple (y, received), got a {kind}{size}")
    y, rows = got
    assert isinstance(y, np.ndarray), f"{what}: y is {getattr(y, 'typename', type(y).__name__)}, not an array"
    expect(y, want, what)
    as_ints = None
    if (isinstance(rows, (list, tuple)) or isinstance(rows, np.ndarray) and rows.ndim == 1) \
            and len(rows) == len(received):
        items = list(rows)
        if all(isinstance(n, (int, float, np.integer, np.floating)) and not isinstance(n, bool)
               and float(n).is_integer() for n in items):                    # whole numbers, as before
            as_ints = [int(n) for n in items]
    assert as_ints == received, f"{what}: received {rows!r:.200}, want {received} (rows from each rank, " \
                                f"a list of ints)"
    after = res.get(r, key(k, "x after"))
    assert isinstance(after, np.ndarray) and after.shape == x.shape and np.array_equal(after, x), \
        f"{what}: the input x was modified"
    if sizes is not None:
        kept = res.get(r, key(k, "sizes after"))
        assert isinstance(kept, list) and kept == list(sizes), \
            f"{what}: the caller's sizes list is {kept!r:.200} after the call, it handed in {list(sizes)} " \
            f"(never modify sizes: the caller keeps its counts, e.g. to put the combined rows back)"
    assert res.get(r, key(k, "aliases x")) is False, f"{what}: y shares memory with x (return a new array)"


def judge_equal(res):
    for p in range(1, drive.P_MAX + 1):
        for m, rest, dtype in drive.equal_cases():
            xs = [drive.case_input(p, s, m * p, rest, dtype) for s in range(p)]
            counts = [[m] * p] * p
            for r in range(p):
                want, received = wanted(xs, counts, r)
                judge_case(res, r, key("eq", p, r, m, len(rest), dtype), xs[r], want, received,
                           f"p={p} rank {r} equal pieces of {m} row(s) x {rest} {dtype}")


def judge_variable(res):
    for p in range(1, drive.P_MAX + 1):
        for case, name in enumerate(drive.VARIABLE):
            counts = [drive.variable_sizes(p, s, case) for s in range(p)]
            for rest, dtype in drive.VARIABLE_X:
                xs = [drive.case_input(p, s, sum(counts[s]), rest, dtype, salt=1 + case) for s in range(p)]
                for r in range(p):
                    want, received = wanted(xs, counts, r)
                    judge_case(res, r, key("var", p, r, case, len(rest), dtype), xs[r], want, received,
                               f"p={p} rank {r} sizes {counts[r]} ({name}) x {rest} {dtype}", counts[r])


def judge_ledger(res):
    """Bytes sent, from minipar's ledger: equal pieces (p-1)/p of x; with sizes, a row count
    (an int64, 8 bytes) to each peer and the rows for the others; one call, named all_to_all."""
    for p in range(1, drive.P_MAX + 1):
        for r in range(p):
            for i, (sizes, rows, rest, dtype) in enumerate(drive.ledger_cases(p, r)):
                row_bytes = int(np.prod(rest, dtype=np.int64)) * np.dtype(dtype).itemsize
                nbytes = rows * row_bytes
                what = f"p={p} rank {r} {'equal' if sizes is None else f'sizes {sizes}'} x {rest} {dtype} " \
                       f"of {nbytes} B"
                sent, calls = res.get(r, key("sent", p, r, i)), res.get(r, key("calls", p, r, i))
                assert isinstance(sent, int) and isinstance(calls, dict), f"{what}: the ledger's record is damaged"
                if p == 1:
                    assert sent == 0, f"{what}: sent {sent} B; a rank alone sends nothing"
                    assert set(calls) <= {"all_to_all"} and calls.get("all_to_all", 0) <= 1, \
                        f"{what}: the ledger holds {calls}; at most one call, named all_to_all"
                    continue
                assert set(calls) == {"all_to_all"}, f"{what}: the ledger holds {sorted(calls)}; begin the call " \
                                                     f"as g.begin('all_to_all', steps)"
                n_calls = calls["all_to_all"]
                assert n_calls == 1, f"{what}: {n_calls} calls in the ledger: one g.begin(...) and one " \
                                     f"call.done() per all-to-all, counts and rows alike"
                if sizes is None:
                    want = (p - 1) * nbytes // p
                    assert sent == want, f"{what}: sent {sent} B, the pairwise exchange sends (p-1)/p of x = {want} B"
                else:
                    want = 8 * (p - 1) + (rows - sizes[r]) * row_bytes
                    others = rows - sizes[r]
                    assert sent == want, f"{what}: sent {sent} B; want {want} B: 8 per peer for the counts (one " \
                                         f"int64 each, whatever x's dtype) and the {others} rows for the others"


MOE = ("--moe-experts", "4", "--moe-top-k", "2")

CRITERIA = [
    Criterion("equal pieces against NumPy", ranks=5, run="equal", judge=judge_equal, timeout=60,
              uses=("all_to_all",),
              hint="round k pairs r with r+k (send) and r-k (receive); the piece from rank s goes to "
                   "slot s of y; MINIPAR_TRACE=1 prints every message"),
    Criterion("variable sizes against NumPy", ranks=5, run="variable", judge=judge_variable, timeout=60,
              uses=("all_to_all",),
              hint="exchange the counts first, one int64 per peer, then size each receive from them"),
    Criterion("bytes in the ledger", ranks=5, run="ledger", judge=judge_ledger, timeout=60, uses=("all_to_all",),
              hint="one call (g.begin once) for counts and rows; send each peer its piece only, the "
                   "counts as int64; comm.traffic() after a call shows what was counted"),
    Criterion("trainer --dp 4 --ep 4 --moe-experts 4 --moe-top-k 2", ranks=4,
              trainer=trainer_flags("--dp", "4", "--ep", "4", *MOE), timeout=120, uses=("all_to_all",),
              hint="each MoE layer dispatches and combines with your all-to-all (variable sizes, no "
                   "capacity) and sends the experts' row counts (equal pieces), forward and backward; "
                   "the grader compares the run with one process"),
]
