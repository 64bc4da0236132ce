"""all_to_all (minipar/comm/algorithms/alltoall.py): every algorithm against the obvious reference, the
ledger to the byte, the rounds, bad arguments, and p = 5.

Every rank's input is a function of (p, its group rank, the case), so each rank computes
what it must receive without asking anyone: piece r of every rank's x, in rank order. The
float inputs are multiples of 1/4 below 64 in magnitude (exact in float16); nothing is
summed, so results must match bit for bit.

Run on a world of 4 with groups of 1, 2, 3 and 4 ranks (conftest.py). p = 5 (a second
non-power of two for Bruck) needs a world of 5: tests/test_alltoall_five.py launches
`mpirun -n 5` on this file, whose __main__ runs the same checks (main() below).
"""
import contextlib
import io
import re
import zlib

import numpy as np
import pytest
from mpi4py import MPI

import minipar.comm as comm
from minipar.comm.algorithms import alltoall

pytestmark = pytest.mark.mpi(min_size=2)

WORLD = MPI.COMM_WORLD
KS = [1, 2, 3, 4]
DTYPES = [np.float64, np.float32, np.int64, np.float16]
REST = {"1-D": (), "2-D": (3,)}                 # trailing dimensions of x: x is (rows, *rest)
ROWS_PER_PIECE = [0, 1, 5]                      # 0: every piece empty

EQUAL = {
    "auto": comm.all_to_all,
    "pairwise": alltoall.pairwise,
    "bruck": alltoall.bruck,
    "async": lambda g, x, **kw: comm.all_to_all_async(g, x, **kw).wait(),
}
VARIABLE = {                                    # sizes=: the pairwise exchange only
    "auto": comm.all_to_all,
    "pairwise": alltoall.pairwise,
    "async": lambda g, x, **kw: comm.all_to_all_async(g, x, **kw).wait(),
}


def group(groups, k):
    if k not in groups:
        pytest.skip(f"needs a world of at least {k} ranks")
    return groups[k]


def make(dtype, shape, *key):
    """Reproducible input: exact floats (see the module docstring), full-range ints."""
    rng = np.random.default_rng(zlib.crc32(repr(key).encode()))
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dt.kind == "f":
        return (rng.integers(-256, 256, n) / 4).astype(dt).reshape(shape)
    return rng.integers(-2**61, 2**61, n, dtype=dt, endpoint=True).reshape(shape)


def check(out, expected, what):
    assert out.dtype == expected.dtype, f"{what}: dtype {out.dtype} != {expected.dtype}"
    assert out.shape == expected.shape, f"{what}: shape {out.shape} != {expected.shape}"
    np.testing.assert_array_equal(out, expected, err_msg=what)


# ---------------------------------------------------------------------------- equal split

def check_equal_split(g, impl, dtype, rest):
    """Rank s's x: p pieces of m rows; rank r must get piece r of every rank's x."""
    p, r = g.size, g.rank
    f = EQUAL[impl]
    for m in ROWS_PER_PIECE:
        xs = [make(dtype, (p * m, *rest), p, s, m, "equal") for s in range(p)]
        x, before = xs[r], xs[r].copy()
        expected = np.concatenate([xs[s][r * m:(r + 1) * m] for s in range(p)])
        what = (f"all_to_all[{impl}] {np.dtype(dtype).name} p={p} rank={r} "
                f"x={x.shape} ({m} rows per piece)")
        check(f(g, x), expected, what)
        np.testing.assert_array_equal(x, before, err_msg=f"{what}: the input was modified")
        out = np.empty_like(x)
        y, got = f(g, x, out=out, return_sizes=True)
        assert y is out, f"{what}: out= was not the result"
        check(out, expected, f"{what} out=")
        assert got == [m] * p, f"{what}: return_sizes gave {got}"


@pytest.mark.parametrize("rest", list(REST))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("impl", list(EQUAL))
@pytest.mark.parametrize("k", KS)
def test_equal_split(groups, k, impl, dtype, rest):
    check_equal_split(group(groups, k), impl, dtype, REST[rest])


def test_noncontiguous_input(groups):
    """A strided view is sent as its values (every algorithm)."""
    g = group(groups, 4 if 4 in groups else max(groups))
    p, r = g.size, g.rank
    xs = [make(np.float64, (p * 2, 6), p, s, "strided") for s in range(p)]
    expected = np.concatenate([xs[s][2 * r:2 * r + 2, ::2] for s in range(p)])
    for impl, f in EQUAL.items():
        check(f(g, xs[r][:, ::2]), expected, f"all_to_all[{impl}] of x[:, ::2] rank={r}")


# ---------------------------------------------------------------------------- variable sizes

CASES = ["random", "a rank sends nothing", "rank 0 receives nothing", "all empty"]


def counts(p, s, case):
    """Rows rank s sends to each rank: random 0..3, with zeros in every case."""
    c = np.random.default_rng(zlib.crc32(repr((p, s, case)).encode())).integers(0, 4, p)
    c[(s + 1) % p] = 0                          # some zeros in every row
    if case == "a rank sends nothing" and s == p - 1 or case == "all empty":
        c[:] = 0
    if case == "rank 0 receives nothing":
        c[0] = 0
    return [int(v) for v in c]


def check_variable(g, impl, case, dtype, rest):
    p, r = g.size, g.rank
    f = VARIABLE[impl]
    sizes = [counts(p, s, case) for s in range(p)]
    xs = [make(dtype, (sum(sizes[s]), *rest), p, s, case, "variable") for s in range(p)]
    starts = [np.concatenate([[0], np.cumsum(sizes[s])]) for s in range(p)]
    expected = np.concatenate([xs[s][starts[s][r]:starts[s][r + 1]] for s in range(p)])
    what = (f"all_to_all[{impl}] sizes={sizes[r]} ({case}) {np.dtype(dtype).name} "
            f"p={p} rank={r}")
    y, got = f(g, xs[r], sizes=sizes[r], return_sizes=True)
    check(y, expected, what)
    assert got == [sizes[s][r] for s in range(p)], f"{what}: received counts {got}"
    check(f(g, xs[r], sizes=np.array(sizes[r])), expected, f"{what} (sizes as an array)")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("impl", list(VARIABLE))
@pytest.mark.parametrize("k", KS)
def test_variable_sizes(groups, k, impl, case):
    g = group(groups, k)
    for dtype in (np.float16, np.int64):
        for rest in REST.values():
            check_variable(g, impl, case, dtype, rest)


# ---------------------------------------------------------------------------- the ledger

def sent_and_received(f, *args, **kwargs):
    comm.reset_traffic()
    f(*args, **kwargs)
    t = comm.traffic()["all_to_all"]
    assert t["calls"] == 1
    return t["bytes_sent"], t["bytes_recv"]


def test_bruck_blocks_formula():
    """bruck_blocks(p) = the set bits of 0, 1, ..., p-1 (counted by hand for p = 1..8)."""
    assert [alltoall.bruck_blocks(p) for p in range(1, 9)] == [0, 1, 2, 4, 5, 7, 9, 12]
    assert alltoall.bruck_blocks(16) == 32 and alltoall.bruck_blocks(64) == 6 * 32


def check_ledger(g):
    """Equal split of n bytes: pairwise (p-1)/p * n, Bruck (n/p) * bruck_blocks(p), sent and
    received by every rank; the dispatcher as the algorithm it names. No headers travel."""
    p = g.size
    for m, rest in ((1, ()), (7, (3,)), (0, (3,))):
        x = np.ones((p * m, *rest), np.float32)
        n = x.nbytes
        what = f"p={p} rank={g.rank} n={n}"
        pair = (p - 1) * n // p
        assert sent_and_received(alltoall.pairwise, g, x) == (pair, pair), what
        bruck = n // p * alltoall.bruck_blocks(p)
        assert sent_and_received(alltoall.bruck, g, x) == (bruck, bruck), what
        auto = alltoall.bytes_sent(p, n, comm.all_to_all_algorithm(g, x))
        assert sent_and_received(comm.all_to_all, g, x) == (auto, auto), what
    assert alltoall.bytes_sent(p, 8 * p, "pairwise") == 8 * (p - 1)


@pytest.mark.parametrize("k", KS)
def test_ledger_equal_split(groups, k):
    check_ledger(group(groups, k))


def check_ledger_variable(g):
    """sizes=: the counts (8 bytes to each other rank), then the rows not for oneself."""
    p, r = g.size, g.rank
    sizes = [counts(p, s, "random") for s in range(p)]
    row = 3 * 8
    x = np.ones((sum(sizes[r]), 3), np.float64)
    sent = 8 * (p - 1) + row * (sum(sizes[r]) - sizes[r][r])
    recv = 8 * (p - 1) + row * (sum(sizes[s][r] for s in range(p)) - sizes[r][r])
    for impl, f in VARIABLE.items():
        assert sent_and_received(f, g, x, sizes=sizes[r]) == (sent, recv), \
            f"all_to_all[{impl}] sizes={sizes[r]} p={p} rank={r}"


@pytest.mark.parametrize("k", KS)
def test_ledger_variable_sizes(groups, k):
    check_ledger_variable(group(groups, k))


def test_dispatcher_crossover(groups):
    """Bruck for p >= 4 up to the crossover (bytes of x), the pairwise exchange otherwise."""
    for g in groups.values():
        p = g.size
        small = np.ones(comm.ALL_TO_ALL_BRUCK_MAX_BYTES // 8 // p * p)
        big = np.ones(comm.ALL_TO_ALL_BRUCK_MAX_BYTES // 8 + p)
        bruck_if_many = "bruck" if p >= comm.ALL_TO_ALL_BRUCK_MIN_RANKS else "pairwise"
        assert comm.all_to_all_algorithm(g, small) == bruck_if_many, f"p={p}"
        assert comm.all_to_all_algorithm(g, big) == "pairwise", f"p={p}"
        assert comm.all_to_all_algorithm(g, small, sizes=[0] * p) == "pairwise", f"p={p}"


@pytest.mark.parametrize("k", KS)
def test_dispatcher_runs_what_it_names(groups, k, monkeypatch):
    """With Bruck's crossover moved down to p >= 2, all_to_all runs Bruck on small x (its
    ledger: at p = 4, n bytes instead of the pairwise 3n/4) and the pairwise exchange above."""
    g = group(groups, k)
    p, r = g.size, g.rank
    monkeypatch.setattr(comm, "ALL_TO_ALL_BRUCK_MIN_RANKS", 2)
    limit = comm.ALL_TO_ALL_BRUCK_MAX_BYTES
    for rows, algorithm in ((limit // 8 // p, "bruck" if p > 1 else "pairwise"),
                            (limit // 8 // p + 1, "pairwise")):
        x = make(np.float64, (p * rows,), p, r, "dispatch")
        n = x.nbytes
        assert comm.all_to_all_algorithm(g, x) == algorithm, f"p={p} n={n}"
        expected = alltoall.bytes_sent(p, n, algorithm)
        assert sent_and_received(comm.all_to_all, g, x) == (expected, expected), \
            f"p={p} n={n}: not {algorithm}'s bytes"
        xs = [make(np.float64, (p * rows,), p, s, "dispatch") for s in range(p)]
        check(comm.all_to_all(g, x), np.concatenate([a[r * rows:(r + 1) * rows] for a in xs]),
              f"all_to_all ({algorithm}) p={p} rank={r} n={n}")


ROUNDS = {"pairwise": lambda p: p - 1, "bruck": lambda p: (p - 1).bit_length()}


def check_rounds(g):
    """MINIPAR_TRACE's lines: pairwise p-1 steps of one message, Bruck ceil(log2 p) steps."""
    p = g.size
    x = np.ones(p * 4, np.float64)
    g.trace = True
    try:
        for name, f in (("pairwise", alltoall.pairwise), ("bruck", alltoall.bruck)):
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                f(g, x)
            lines = re.findall(r"all_to_all step (\d+)/(\d+)", printed.getvalue())
            rounds = ROUNDS[name](p)
            assert sorted(int(s) for s, _ in lines) == list(range(1, rounds + 1)), \
                f"{name} p={p}: {lines}"
            assert {int(n) for _, n in lines} <= {rounds}, f"{name} p={p}: {lines}"
    finally:
        g.trace = False


@pytest.mark.parametrize("k", KS[1:])
def test_rounds(groups, k):
    check_rounds(group(groups, k))


# ---------------------------------------------------------------------------- bad input

def check_bad_input(g):
    """One-line ValueErrors, raised on the calling rank before any message (a rank alone can
    make them: no other rank takes part, nothing is counted, the call counter is unchanged)."""
    p = g.size
    x = np.ones((2 * p, 3))
    negative = [2 * p + 1, -1] + [0] * (p - 2) if p > 1 else [-1]
    bad = [
        (dict(x=np.ones(2 * p + 1)), f"shape ({2 * p + 1},) does not split into {p} equal"),
        (dict(x=np.float64(1.0)), "shape () does not split"),
        (dict(x=x, sizes=[1] * (p + 1)), f"sizes must be {p} whole row counts"),
        (dict(x=x, sizes=[2 * p - 0.5, 0.5] + [0] * (p - 2) if p > 1 else [2.5]), "got ["),
        (dict(x=x, sizes=[2 * p + 1] + [0] * (p - 1)), f"adding up to x.shape[0] = {2 * p}"),
        (dict(x=x, sizes=negative), f">= 0 adding up to x.shape[0] = {2 * p}, got {negative}"),
        (dict(x=x, out=x), "out must not overlap x"),
        (dict(x=x, out=np.empty((2 * p, 4))), "out must be a writeable"),
    ]
    comm.reset_traffic()
    calls = g.calls
    for impl, f in EQUAL.items():
        for kwargs, message in bad:
            kwargs = dict(kwargs)
            if impl == "bruck" and "sizes" in kwargs:
                continue                        # bruck takes no sizes
            with pytest.raises(ValueError, match=re.escape(message)) as e:
                f(g, kwargs.pop("x"), **kwargs)
            assert "\n" not in str(e.value), f"{impl}: not one line: {e.value}"
    with pytest.raises(ValueError, match="out= is for the equal split"):
        comm.all_to_all(g, x, sizes=[2 * p] + [0] * (p - 1), out=np.empty_like(x))
    assert comm.traffic() == {} and g.calls == calls, "a message went out before the error"


def test_bad_input_raises_before_any_message(groups):
    g = groups[WORLD.Get_size()]
    if g.rank == 0:                             # alone: the others must not be needed
        check_bad_input(g)
    np.testing.assert_array_equal(comm.all_to_all(g, np.full(g.size, g.rank)),
                                  np.arange(g.size))                  # still in step


def test_debug_names_what_each_rank_called(groups):
    """MINIPAR_DEBUG: both forms pass when the ranks agree; an equal split on rank 0 against
    sizes= on the others is a CollectiveMismatch on every rank, before any row moves."""
    g = groups[WORLD.Get_size()]
    p, r = g.size, g.rank
    x = np.ones((2 * p, 3), np.float32)
    g.debug = True
    try:
        comm.all_to_all(g, x)
        comm.all_to_all(g, x, sizes=[2] * p)
        with pytest.raises(comm.CollectiveMismatch, match="all_to_all"):
            comm.all_to_all(g, x, sizes=None if r == 0 else [2] * p)
    finally:
        g.debug = False


# ---------------------------------------------------------------------------- p = 5



def main():
    """The checks above on this world (mpirun -n 5 python tests/mpi/test_alltoall.py)."""
    g = comm.Group(WORLD)
    for impl in EQUAL:
        for dtype in DTYPES:
            for rest in REST.values():
                check_equal_split(g, impl, dtype, rest)
    for impl in VARIABLE:
        for case in CASES:
            check_variable(g, impl, case, np.float32, (2,))
    check_ledger(g)
    check_ledger_variable(g)
    check_rounds(g)
    if g.rank == 0:
        check_bad_input(g)
    comm.all_to_all(g, np.zeros(g.size))        # in step after rank 0's errors
    if g.rank == 0:
        print(f"all_to_all p={g.size}: ok", flush=True)


if __name__ == "__main__":
    main()
