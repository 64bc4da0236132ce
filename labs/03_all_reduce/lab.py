"""Lab 03's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): minipar.comm.all_reduce and all_reduce_async, dispatched as minipar's
own dispatcher does (minipar/comm/__init__.py): recursive doubling up to
comm.ALL_REDUCE_DOUBLING_MAX_BYTES, the ring above (minipar itself uses direct exchange there
on p <= 8; the lab wants the ring). So the data-parallel buckets, the loss and the gradient
norm of the trainer all go through the student's two functions.
Oracle: NumPy on every rank's input, which the grader draws itself from the cases' seeds
(drive.case_input); the child only hands back what each rank's call returned, the input as
it was afterwards, and the ledger's counts.
"""
import os

import numpy as np

from labs.framework import Criterion, expect, first_difference, load_drive, trainer_flags
from labs.results import key
from labs.scan import Allowed

TITLE = "all-reduce two ways: the ring and recursive doubling"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
REDUCE = {"sum": np.add.reduce, "max": np.maximum.reduce, "min": np.minimum.reduce}
OWN_REASON = "minipar's own all-reduce: this lab grades yours"
ALLOWED = Allowed(
    modules={"minipar.comm": {"traffic", "reset_traffic", "CommTimeout"}},
    refused={**{f"minipar.comm.{n}": OWN_REASON for n in ("all_reduce", "all_reduce_async", "ring", "doubling",
                                                           "direct", "straight_line", "hierarchical")}})


def inputs(p, shape, dtype, transposed=False, salt=0):
    """Every rank's input of a case, flattened as the rank's x.ravel(): (p, n)."""
    return np.stack([drive.case_x(p, r, shape, dtype, transposed, salt).ravel() for r in range(p)])


def judge_against_numpy(res, name):
    for p in drive.p_values(name):
        for shape, dtype, op, transposed in drive.cases_for(name, p):
            xs = inputs(p, shape, dtype, transposed)
            x_shape = tuple(reversed(shape)) if transposed else tuple(shape)
            want = REDUCE[op](xs, axis=0, dtype=np.dtype(dtype)).reshape(x_shape)
            # a sum in another order: a few roundings of the largest input apart
            exact = op != "sum" or np.issubdtype(np.dtype(dtype), np.integer) or not xs.size
            atol = 0.0 if exact else p * p * np.finfo(np.dtype(dtype)).eps * float(np.abs(xs).max())
            for r in range(p):
                what = drive.describe(name, p, r, shape, dtype, op, transposed)
                k = drive.case_key(name, p, r, shape, dtype, op, transposed)
                got = res.get(r, k)
                assert isinstance(got, np.ndarray), f"{what}: returned {type(got).__name__}, not an array"
                expect(got, want, what, atol=atol)
                after = res.get(r, key(k, "x after"))
                x = drive.case_x(p, r, shape, dtype, transposed)
                assert isinstance(after, np.ndarray) and after.shape == x.shape and np.array_equal(after, x), \
                    f"{what}: the input x was modified"
                assert res.get(r, key(k, "aliases x")) is False, \
                    f"{what}: the result shares memory with x (return a new array)"


def judge_ring(res):
    judge_against_numpy(res, "all_reduce_ring")


def judge_doubling(res):
    judge_against_numpy(res, "all_reduce_doubling")


def judge_identical(res):
    """Every rank's result, byte for byte, against rank 0's: floats summed in another order on
    another rank differ in the last bits, and replicas that should be equal drift apart."""
    for p in range(2, drive.P_MAX + 1):
        for name in drive.FUNCTIONS:
            for n, dtype in drive.IDENTICAL:
                what = f"{name} p={p} n={n} {dtype} sum"
                got = [res.get(r, key("same", name, p, r, n, dtype)) for r in range(p)]
                for r, y in enumerate(got):
                    assert isinstance(y, np.ndarray) and y.dtype == np.dtype(dtype) and y.shape == (n,), \
                        f"{what}: rank {r} returned {type(y).__name__} " \
                        f"{getattr(y, 'dtype', '')} {getattr(y, 'shape', '')}, want an array of {dtype} ({n},)"
                mine = got[0]
                for r in range(1, p):
                    if got[r].tobytes() != mine.tobytes():
                        diff = first_difference(got[r], mine, rtol=0.0)
                        raise AssertionError(
                            f"{what}: rank {r}'s result is not bit-identical to rank 0's ({diff}; rank {r} "
                            f"got, rank 0 has): every rank must reduce the same operands in the same order")


def ring_bytes(n, p, itemsize):
    """The bytes one rank of a correct ring may send, sorted: every piece but one in the
    reduce-scatter (piece i, the one it ends up owning) and every piece but another in the
    all-gather (piece j != i, the last one it receives), 2n - n_i - n_j elements for the
    np.array_split piece sizes n_i. Which i and j depends on how the pieces are numbered;
    over the whole group i and j each run over all pieces once, so the ranks send exactly
    2(p-1) n elements in all, whatever n."""
    sizes = [len(a) for a in np.array_split(np.arange(n), p)]
    return sorted({(2 * n - sizes[i] - sizes[j]) * itemsize
                   for i in range(p) for j in range(p) if i != j})


def largest_power_of_two(p: int) -> int:
    return 1 << (p.bit_length() - 1)


def doubling_bytes(n, p, rank, itemsize):
    """What rank sends in recursive doubling with the fix-up: q = largest power of two <= p;
    rank r >= q hands its x to r - q and gets the result back (b bytes sent); rank r < p - q
    receives that x, does the log2(q) exchanges and sends the result back (log2(q) b + b);
    the other ranks do the log2(q) exchanges only (log2(q) b)."""
    b = n * itemsize
    q = largest_power_of_two(p)
    if rank >= q:
        return b
    return (q.bit_length() - 1) * b + (b if rank < p - q else 0)


def ledger_of(res, name, p, n, dtype):
    """Every rank's bytes sent, after checking each rank's ledger holds one call named
    all_reduce (none, with nothing to send, is allowed too). -> (sent per rank, what)."""
    sent = []
    b = n * np.dtype(dtype).itemsize
    for r in range(p):
        what = f"{name} p={p} rank {r} n={n} {dtype} ({b} B)"
        k = key("ledger", name, p, r, n, dtype)
        s, calls = res.get(r, key(k, "sent")), res.get(r, key(k, "calls"))
        assert isinstance(s, int) and isinstance(calls, dict), f"{what}: the ledger's record is damaged"
        if p == 1 or n == 0:
            assert s == 0, f"{what}: sent {s} B; with nothing to exchange a rank sends nothing"
            assert set(calls) <= {"all_reduce"} and calls.get("all_reduce", 0) <= 1, \
                f"{what}: the ledger holds {calls}; at most one call, named all_reduce"
        else:
            assert set(calls) == {"all_reduce"}, f"{what}: the ledger holds {sorted(calls)}; begin the call as " \
                                                 f"g.begin('all_reduce', nsteps)"
            assert calls["all_reduce"] == 1, f"{what}: {calls['all_reduce']} calls in the ledger: " \
                                             f"one g.begin(...) and one call.done() per all-reduce"
        sent.append(s)
    return sent


def judge_ledger(res):
    """Bytes sent, from minipar's ledger: the ring 2(p-1)/p of the array per rank (exactly when
    p divides n), doubling log2(p) times the array on p = 2, 4, plus the fix-up on p = 3, 5."""
    for p in range(1, drive.P_MAX + 1):
        for n, dtype in drive.ledger_cases("all_reduce_ring", p):
            itemsize = np.dtype(dtype).itemsize
            b = n * itemsize
            everyone = ledger_of(res, "all_reduce_ring", p, n, dtype)
            if p == 1 or n == 0:
                continue
            allowed = ring_bytes(n, p, itemsize)
            for r, sent in enumerate(everyone):
                what = f"all_reduce_ring p={p} rank {r} n={n} {dtype} ({b} B)"
                if n % p == 0:
                    want = 2 * (p - 1) * b // p
                    assert sent == want, f"{what}: sent {sent} B, a ring sends 2(p-1)/p of it = {want} B"
                assert sent in allowed, f"{what}: sent {sent} B; a ring sends all pieces but one twice, " \
                                        f"one of {allowed} B"
            assert sum(everyone) == 2 * (p - 1) * b, \
                f"all_reduce_ring p={p} n={n} {dtype} ({b} B): the group sent {sum(everyone)} B in all " \
                f"(per rank {everyone}), a ring 2(p-1) x {b} = {2 * (p - 1) * b} B"
        q = largest_power_of_two(p)
        for n, dtype in drive.ledger_cases("all_reduce_doubling", p):
            itemsize = np.dtype(dtype).itemsize
            b = n * itemsize
            everyone = ledger_of(res, "all_reduce_doubling", p, n, dtype)
            if p == 1 or n == 0:
                continue
            want = [doubling_bytes(n, p, k, itemsize) for k in range(p)]
            if p == q:
                rule = f"log2(p) x {b} B = {want[0]} B on every rank"
            else:
                rule = (f"with q = {q}: ranks >= q send their x once ({b} B), ranks < p - q log2(q) x b "
                        f"+ b = {want[0]} B, the others log2(q) x b = {(q.bit_length() - 1) * b} B")
            for r, sent in enumerate(everyone):
                what = f"all_reduce_doubling p={p} rank {r} n={n} {dtype} ({b} B)"
                assert sent == want[r], f"{what}: sent {sent} B, want {want[r]} B ({rule}); per rank " \
                                        f"{everyone}, want {want}"


def judge_both_paths(run):
    """The run sent its small all-reduces (the loss, the norm, the small buckets) through the
    student's doubling and its large bucket through the student's ring, on every rank."""
    ranks = run.results.ranks
    ring = [run.results.get(r, "trainer ring calls") for r in range(ranks)]
    doubling = [run.results.get(r, "trainer doubling calls") for r in range(ranks)]
    for name, counts in (("all_reduce_ring", ring), ("all_reduce_doubling", doubling)):
        idle = [r for r, c in enumerate(counts) if not (isinstance(c, int) and c > 0)]
        assert not idle, f"{name} never ran in the trainer on rank(s) {idle} (calls per rank: ring {ring}, " \
                         f"doubling {doubling}): the run did not test it"


# A tiny float64 model whose tied embedding (256 x 32 + the positions' 16 x 32, 68 KiB)
# closes the last bucket above 64 KiB (the ring), while 0.01 MiB buckets keep every other
# bucket, the loss and the norm below it (doubling).

CRITERIA = [
    Criterion("all_reduce_ring against NumPy", ranks=5, run="ring", judge=judge_ring, timeout=60,
              uses=("all_reduce_ring",),
              hint="a ring reduce-scatter, then a ring all-gather of the finished pieces, in one Call "
                   "of 2(p-1) steps (minipar.comm.algorithms.ring); print (step, piece sent, piece received) for p = 3"),
    Criterion("all_reduce_doubling against NumPy", ranks=drive.DOUBLING_P_MAX, run="doubling", judge=judge_doubling, timeout=60,
              uses=("all_reduce_doubling",),
              hint="partner at round k is r ^ (1 << k) among the q = largest power of two <= p "
                   "ranks; ranks r >= q hand x to r - q first and get the result back last "
                   "(minipar.comm.algorithms.doubling); a wait that never ends is MINIPAR_COMM_TIMEOUT's"),
    Criterion("identical results on every rank", ranks=5, run="identical", judge=judge_identical, timeout=30,
              uses=("all_reduce_ring", "all_reduce_doubling"),
              hint="two ranks that combine the same two partial results get the same bits "
                   "(a + b == b + a); combining them in another grouping does not"),
    Criterion("bytes in the ledger", ranks=5, run="ledger", judge=judge_ledger, timeout=30,
              uses=("all_reduce_ring", "all_reduce_doubling"),
              hint="send pieces, not the array, in the ring; the whole partial result, once per "
                   "round, in doubling, in x's dtype; comm.traffic() after a call shows what was counted"),
    Criterion("trainer --dp 4", ranks=4, trainer=trainer_flags("--dp", "4", batch_size=12, bucket_mb=0.01),
              judge=judge_both_paths, timeout=90, uses=("all_reduce_ring", "all_reduce_doubling"),
              hint="every gradient bucket, the loss and the norm go through your two functions "
                   "(the ring above comm.ALL_REDUCE_DOUBLING_MAX_BYTES); the grader compares the run "
                   "with one process"),
    Criterion("trainer --dp 3", ranks=3, trainer=trainer_flags("--dp", "3", batch_size=12, bucket_mb=0.01),
              judge=judge_both_paths, timeout=90, uses=("all_reduce_ring", "all_reduce_doubling"),
              hint="p = 3 is not a power of two: doubling's fix-up (rank 2 folds into rank 0) "
                   "runs on every small bucket"),
]
