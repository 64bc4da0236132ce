"""Lab 03's seam and criteria (labs/framework.py says what a lab is).

Seam: minipar.comm.all_reduce and all_reduce_async, dispatched as minipar's own dispatcher
does (minipar/comm/__init__.py): recursive doubling up to comm.ALL_REDUCE_DOUBLING_MAX_BYTES,
the ring above (minipar itself uses direct exchange there on p <= 8; the lab wants the ring).
So the data-parallel buckets, the loss and the gradient norm of the trainer all go through the
student's two functions.
Oracle: NumPy on every rank's inputs, gathered by MPI's own Allgather (the grader may use
MPI's collectives; the student may not), in groups of p = 2, 3, 4 and 5 ranks cut from 5.
"""

import numpy as np
from mpi4py import MPI

from labs.framework import Criterion, Done, collective_uses, expect, first_difference, gathered, trainer_flags
from minipar import comm

TITLE = "all-reduce two ways: the ring and recursive doubling"
DTYPES = (np.float64, np.float32, np.int64, np.int32)
OPS = {"sum": np.add.reduce, "max": np.maximum.reduce, "min": np.minimum.reduce}
COLLECTIVES = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "scatter", "gather",
               "all_reduce_async", "reduce_scatter_async", "all_gather_async"}
FUNCTIONS = ("all_reduce_ring", "all_reduce_doubling")


def sizes_for(p: int) -> list[int]:
    """Empty, one element, fewer than p, p +- 1, odd, and large enough for real pieces."""
    return sorted({0, 1, p - 1, p, p + 1, 2 * p - 1, 7, 13, 96, 1001})


def groups():
    """(p, Group or None) for p = 2..5: ranks 0..p-1 of the world, the rest sit it out."""
    world = MPI.COMM_WORLD
    for p in range(2, min(5, world.Get_size()) + 1):
        sub = world.Split(0 if world.Get_rank() < p else MPI.UNDEFINED, world.Get_rank())
        yield p, (comm.Group(sub) if sub != MPI.COMM_NULL else None)


def case_input(p, r, shape, dtype, salt=0):
    """Rank r's input: integers in [-1000, 1000), or normal floats (sums round)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    rng = np.random.default_rng([p, r, *shape, np.dtype(dtype).num, salt])
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


def largest_power_of_two(p: int) -> int:
    return 1 << (p.bit_length() - 1)


# --- the criteria -------------------------------------------------------------------------

def check_static(student):
    """The student's file calls no MPI collective (the scan minipar's own code passes), nor
    minipar.comm's dispatcher (comm.all_reduce would grade minipar, not the student)."""
    found = collective_uses(student, COLLECTIVES)
    assert not found, "communicates other than by g.begin / sendrecv / isend / irecv: " + "; ".join(found[:3])


def cases(p):
    """(shape, dtype, op) of the NumPy criteria: every size of sizes_for(p) in every dtype
    with op sum (max and min too for float64 and int64), a 2-D input, and a transposed
    (non-contiguous) one."""
    for n in sizes_for(p):
        for dtype in DTYPES:
            ops = ("sum", "max", "min") if dtype in (np.float64, np.int64) else ("sum",)
            for op in ops:
                yield (n,), dtype, op, False
    yield (p + 1, 3), np.float64, "sum", False
    yield (3, p + 1), np.float64, "sum", True                # x.T: not C-contiguous


def check_against_numpy(student, name):
    fn = getattr(student, name)
    for p, g in groups():
        if g is None:
            continue
        r = g.rank
        for shape, dtype, op, transposed in cases(p):
            x = case_input(p, r, shape, dtype)
            if transposed:
                x = x.T
            keep, inputs = x.copy(), gathered(g, np.ravel(x))
            got = fn(g, x, op)
            want = OPS[op](inputs, axis=0, dtype=dtype).reshape(x.shape)
            # a sum in another order: a few roundings of the largest input apart
            exact = op != "sum" or np.issubdtype(dtype, np.integer) or not x.size
            atol = 0.0 if exact else p * p * np.finfo(dtype).eps * float(np.abs(inputs).max())
            what = (f"{name} p={p} rank {r} shape {x.shape}{' (transposed)' if transposed else ''} "
                    f"{np.dtype(dtype).name} op={op}")
            assert isinstance(got, np.ndarray), f"{what}: returned {type(got).__name__}, not an array"
            expect(got, want, what, atol=atol)
            assert np.array_equal(x, keep), f"{what}: the input x was modified"
            assert not np.shares_memory(got, x), f"{what}: the result shares memory with x (return a new array)"
        g.comm.Free()


def check_ring(student):
    check_against_numpy(student, "all_reduce_ring")


def check_doubling(student):
    check_against_numpy(student, "all_reduce_doubling")


def check_identical(student):
    """Every rank's result, byte for byte, against rank 0's: floats summed in another order on
    another rank differ in the last bits, and replicas that should be equal drift apart."""
    for p, g in groups():
        if g is None:
            continue
        r = g.rank
        for name in FUNCTIONS:
            fn = getattr(student, name)
            for n in (7, 96, 1001):
                for dtype in (np.float64, np.float32):
                    got = np.ascontiguousarray(fn(g, case_input(p, r, n, dtype, salt=3), "sum"))
                    everyone = np.empty((p, got.nbytes), np.uint8)
                    g.comm.Allgather(got.view(np.uint8).ravel(), everyone)
                    for k in range(1, p):
                        if not np.array_equal(everyone[k], everyone[0]):
                            theirs = everyone[k].view(got.dtype)
                            mine = everyone[0].view(got.dtype)
                            diff = first_difference(theirs, mine, rtol=0.0)
                            raise AssertionError(
                                f"{name} p={p} n={n} {np.dtype(dtype).name} sum: rank {k}'s result is not "
                                f"bit-identical to rank 0's ({diff}; rank {k} got, rank 0 has): every "
                                f"rank must reduce the same operands in the same order")
        g.comm.Free()


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


def ledger_of(g, what, run):
    """Run one all-reduce; -> the bytes this rank sent, and every rank's, from the ledger."""
    comm.reset_traffic()
    run()
    t = comm.traffic()
    assert set(t) == {"all_reduce"}, f"{what}: the ledger holds {sorted(t)}; begin the call as " \
                                     f"g.begin('all_reduce', nsteps)"
    assert t["all_reduce"]["calls"] == 1, f"{what}: {t['all_reduce']['calls']} calls in the ledger: " \
                                          f"one g.begin(...) and one call.done() per all-reduce"
    sent = t["all_reduce"]["bytes_sent"]
    everyone = np.empty(g.size, np.int64)
    g.comm.Allgather(np.array([sent], np.int64), everyone)
    return sent, everyone


def check_ledger(student):
    """Bytes sent, from minipar's ledger: the ring 2(p-1)/p of the array per rank (exactly when
    p divides n), doubling log2(p) times the array on p = 2, 4, plus the fix-up on p = 3, 5."""
    for p, g in groups():
        if g is None:
            continue
        r = g.rank
        for n, dtype in ((p * 1000, np.float64), (p * 17, np.float32), (1001, np.float64), (13, np.int32)):
            itemsize = np.dtype(dtype).itemsize
            b = n * itemsize
            what = f"all_reduce_ring p={p} rank {r} n={n} {np.dtype(dtype).name} ({b} B)"
            x = case_input(p, r, n, dtype)
            sent, everyone = ledger_of(g, what, lambda: student.all_reduce_ring(g, x))
            if n % p == 0:
                want = 2 * (p - 1) * b // p
                assert sent == want, f"{what}: sent {sent} B, a ring sends 2(p-1)/p of it = {want} B"
            allowed = ring_bytes(n, p, itemsize)
            assert sent in allowed, f"{what}: sent {sent} B; a ring sends all pieces but one twice, " \
                                    f"one of {allowed} B"
            assert int(everyone.sum()) == 2 * (p - 1) * b, \
                f"{what}: the group sent {int(everyone.sum())} B in all (per rank {everyone.tolist()}), " \
                f"a ring 2(p-1) x {b} = {2 * (p - 1) * b} B"
        q = largest_power_of_two(p)
        for n, dtype in ((1000, np.float64), (13, np.float32), (1, np.float64), (96, np.int64)):
            itemsize = np.dtype(dtype).itemsize
            b = n * itemsize
            what = f"all_reduce_doubling p={p} rank {r} n={n} {np.dtype(dtype).name} ({b} B)"
            x = case_input(p, r, n, dtype)
            sent, everyone = ledger_of(g, what, lambda: student.all_reduce_doubling(g, x))
            want = [doubling_bytes(n, p, k, itemsize) for k in range(p)]
            if p == q:
                rule = f"log2(p) x {b} B = {want[r]} B on every rank"
            else:
                rule = (f"with q = {q}: ranks >= q send their x once ({b} B), ranks < p - q log2(q) x b "
                        f"+ b = {want[0]} B, the others log2(q) x b = {(q.bit_length() - 1) * b} B")
            assert sent == want[r], f"{what}: sent {sent} B, want {want[r]} B ({rule}); per rank " \
                                    f"{everyone.tolist()}, want {want}"
        g.comm.Free()


# --- the seam ------------------------------------------------------------------------------

def install(student):
    """The trainer's all-reduces, blocking and not, become the student's: doubling up to
    comm.ALL_REDUCE_DOUBLING_MAX_BYTES, the ring above. counter() counts both."""
    calls = {"ring": 0, "doubling": 0}

    def all_reduce(g, x, op="sum", *, out=None):
        x = np.asarray(x)
        if x.nbytes > comm.ALL_REDUCE_DOUBLING_MAX_BYTES:
            calls["ring"] += 1
            y = student.all_reduce_ring(g, x, op)
        else:
            calls["doubling"] += 1
            y = student.all_reduce_doubling(g, x, op)
        if out is None:
            return y
        out[...] = y                             # out may be x itself (the buckets: in place)
        return out

    comm.all_reduce = all_reduce
    comm.all_reduce_async = lambda g, x, op="sum", *, out=None: Done(all_reduce(g, x, op, out=out))
    counter = lambda: calls["ring"] + calls["doubling"]          # noqa: E731
    counter.calls = calls                                        # by path, for a look by hand
    return counter


# A tiny float64 model whose tied embedding (256 x 32 + the positions' 16 x 32, 68 KiB)
# closes the last bucket above 64 KiB (the ring), while 0.01 MiB buckets keep every other
# bucket, the loss and the norm below it (doubling).

CRITERIA = [
    Criterion("no MPI collective, none of minipar's", check=check_static, timeout=30,
              hint="communicate only with call = g.begin('all_reduce', nsteps) and call.sendrecv / "
                   "call.isend / call.irecv, then call.done()"),
    Criterion("all_reduce_ring against NumPy", ranks=5, check=check_ring, timeout=30,
              hint="a ring reduce-scatter, then a ring all-gather of the finished pieces, in one Call "
                   "of 2(p-1) steps (minipar.comm.ring); print (step, piece sent, piece received) for p = 3"),
    Criterion("all_reduce_doubling against NumPy", ranks=5, check=check_doubling, timeout=30,
              hint="partner at round k is r ^ (1 << k) among the q = largest power of two <= p "
                   "ranks; ranks r >= q hand x to r - q first and get the result back last "
                   "(minipar.comm.doubling); a wait that never ends is MINIPAR_COMM_TIMEOUT's"),
    Criterion("identical results on every rank", ranks=5, check=check_identical, timeout=30,
              hint="two ranks that combine the same two partial results get the same bits "
                   "(a + b == b + a); combining them in another grouping does not"),
    Criterion("bytes in the ledger", ranks=5, check=check_ledger, timeout=30,
              hint="send pieces, not the array, in the ring; the whole partial result, once per "
                   "round, in doubling, in x's dtype; comm.traffic() after a call shows what was counted"),
    Criterion("trainer --dp 4 --verify", ranks=4, trainer=trainer_flags("--dp", "4", batch_size=12, bucket_mb=0.01), timeout=90,
              hint="every gradient bucket, the loss and the norm go through your two functions "
                   "(the ring above comm.ALL_REDUCE_DOUBLING_MAX_BYTES); the twin is one process"),
    Criterion("trainer --dp 3 --verify", ranks=3, trainer=trainer_flags("--dp", "3", batch_size=12, bucket_mb=0.01), timeout=90,
              hint="p = 3 is not a power of two: doubling's fix-up (rank 2 folds into rank 0) "
                   "runs on every small bucket"),
]
