"""Every collective against NumPy applied to the inputs gathered with MPI's own allgather.

Run on a world of 4 with groups of k = 1, 2, 3 and 4 ranks (see conftest.py), every dtype of
the issue, sizes 0, 1, p-1, p+1 and 1000 (2^20 + 3 for a few cases), every op, and every
algorithm (ring, direct exchange, recursive doubling / Bruck, binomial tree, pipelined chain,
non-blocking).

The float inputs are multiples of 1/4 below 64 in magnitude, so every partial sum of up to 4
of them is exact even in float16: results must match bit for bit, in any summation order,
like the integers. (test_comm_features.py checks random floats with a tolerance.)
"""
import functools
import zlib

import numpy as np
import pytest
from mpi4py import MPI

import minipar.comm as comm
from minipar.comm.algorithms import direct, doubling, ring, tree

pytestmark = pytest.mark.mpi(min_size=2)

DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
SIZES = ["0", "1", "p-1", "p+1", "1000"]
KS = [1, 2, 3, 4]
OPS = ["sum", "max", "min"]
NP_OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}
BIG = 2**20 + 3


def group(groups, k):
    if k not in groups:
        pytest.skip(f"needs a world of at least {k} ranks")
    return groups[k]


def length(size, p):
    lengths = {"0": 0, "1": 1, "p-1": p - 1, "p+1": p + 1}
    return lengths[size] if size in lengths else int(size)


def make(dtype, n, *key):
    """Reproducible input for this rank: exact floats (see module docstring), full-range ints."""
    rng = np.random.default_rng(zlib.crc32(repr(key).encode()))
    dt = np.dtype(dtype)
    if dt.kind == "f":
        return (rng.integers(-256, 256, n) / 4).astype(dt)
    lo, hi = (np.iinfo(dt).min, np.iinfo(dt).max) if dt.itemsize != 8 else (-2**61, 2**61)
    return rng.integers(lo, hi, n, dtype=dt, endpoint=True)


def inputs(g, dtype, n, *key):
    """This rank's x, and every rank's x of the group gathered by MPI's own allgather."""
    x = make(dtype, n, MPI.COMM_WORLD.Get_rank(), g.size, *key)
    return x, g.comm.allgather(x)


def check(out, expected, what):
    assert out is not None, f"{what}: got None"
    assert out.dtype == expected.dtype, f"{what}: dtype {out.dtype} != {expected.dtype}"
    assert out.shape == expected.shape, f"{what}: shape {out.shape} != {expected.shape}"
    np.testing.assert_array_equal(out, expected, err_msg=what)


def unchanged(x, before, what):
    np.testing.assert_array_equal(x, before, err_msg=f"{what}: the input was modified")


ALL_REDUCE = {
    "auto": comm.all_reduce,
    "ring": ring.all_reduce,
    "doubling": doubling.all_reduce,
    "direct": direct.all_reduce,
    "async": lambda g, x, op: comm.all_reduce_async(g, x, op).wait(),
}


@pytest.mark.parametrize("impl", list(ALL_REDUCE))
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("k", KS)
def test_all_reduce(groups, k, dtype, size, impl):
    g = group(groups, k)
    x, xs = inputs(g, dtype, length(size, g.size), "all_reduce", size)
    before = x.copy()
    for op in OPS:
        what = f"all_reduce[{impl}] op={op} p={g.size} rank={g.rank} n={x.size}"
        out = ALL_REDUCE[impl](g, x, op)
        check(out, functools.reduce(NP_OPS[op], xs), what)
        unchanged(x, before, what)


REDUCE_SCATTER = {
    "auto": comm.reduce_scatter,
    "ring": ring.reduce_scatter,
    "doubling": doubling.reduce_scatter,
    "direct": direct.reduce_scatter,
    "async": lambda g, x, op: comm.reduce_scatter_async(g, x, op).wait(),
}


@pytest.mark.parametrize("impl", list(REDUCE_SCATTER))
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("k", KS)
def test_reduce_scatter(groups, k, dtype, size, impl):
    g = group(groups, k)
    x, xs = inputs(g, dtype, length(size, g.size), "reduce_scatter", size)
    before = x.copy()
    for op in OPS:
        what = f"reduce_scatter[{impl}] op={op} p={g.size} rank={g.rank} n={x.size}"
        out = REDUCE_SCATTER[impl](g, x, op)
        full = functools.reduce(NP_OPS[op], xs)
        check(out, np.array_split(full.ravel(), g.size)[g.rank], what)
        unchanged(x, before, what)


ALL_GATHER = {
    "auto": comm.all_gather,
    "ring": ring.all_gather,
    "bruck": doubling.all_gather,
    "direct": direct.all_gather,
    "async": lambda g, x, sizes=None: comm.all_gather_async(g, x, sizes).wait(),
}


@pytest.mark.parametrize("impl", list(ALL_GATHER))
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("k", KS)
def test_all_gather(groups, k, dtype, size, impl):
    g = group(groups, k)
    x, xs = inputs(g, dtype, length(size, g.size), "all_gather", size)
    before = x.copy()
    what = f"all_gather[{impl}] p={g.size} rank={g.rank} n={x.size}"
    check(ALL_GATHER[impl](g, x), np.concatenate(xs), what)
    unchanged(x, before, what)
    # unequal pieces, as reduce_scatter returns them: all_gather is its inverse
    pieces = [np.array_split(a, g.size)[i] for i, a in enumerate(xs)]
    sizes = [len(piece) for piece in pieces]
    out = ALL_GATHER[impl](g, pieces[g.rank], sizes=sizes)
    check(out, np.concatenate(pieces), f"{what} sizes={sizes}")


@pytest.fixture(params=["tree", "chain"])
def rooted(request, monkeypatch):
    """Binomial trees, or pipelined chains of 256-byte segments for every size (p > 2)."""
    if request.param == "chain":
        monkeypatch.setattr(tree, "BROADCAST_TREE_MAX_BYTES", -1)
        monkeypatch.setattr(tree, "REDUCE_TREE_MAX_BYTES", -1)
        monkeypatch.setattr(tree, "CHAIN_SEGMENT_BYTES", 256)
    return request.param


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("k", KS)
def test_broadcast(groups, k, dtype, size, rooted):
    g = group(groups, k)
    x, xs = inputs(g, dtype, length(size, g.size), "broadcast", size)
    before = x.copy()
    for root in range(g.size):
        what = f"broadcast[{rooted}] root={root} p={g.size} rank={g.rank} n={x.size}"
        out = comm.broadcast(g, x if g.rank == root else None, root)
        check(out, xs[root], what)
        unchanged(x, before, what)
        assert not np.shares_memory(out, x), f"{what}: returned the input itself"


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("k", KS)
def test_reduce(groups, k, dtype, size, rooted):
    g = group(groups, k)
    x, xs = inputs(g, dtype, length(size, g.size), "reduce", size)
    before = x.copy()
    for root in range(g.size):
        for op in OPS:
            what = f"reduce[{rooted}] root={root} op={op} p={g.size} rank={g.rank} n={x.size}"
            out = comm.reduce(g, x, root, op)
            if g.rank == root:
                check(out, functools.reduce(NP_OPS[op], xs), what)
                assert not np.shares_memory(out, x), f"{what}: returned the input itself"
            else:
                assert out is None, f"{what}: non-root got {out!r}"
            unchanged(x, before, what)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("k", KS)
def test_scatter(groups, k, dtype, size):
    g = group(groups, k)
    x, xs = inputs(g, dtype, length(size, g.size), "scatter", size)
    before = x.copy()
    for root in range(g.size):
        what = f"scatter root={root} p={g.size} rank={g.rank} n={x.size}"
        out = comm.scatter(g, x if g.rank == root else None, root)
        check(out, np.array_split(xs[root], g.size)[g.rank], what)
        unchanged(x, before, what)
        assert not np.shares_memory(out, x), f"{what}: returned a view of the input"


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("k", KS)
def test_gather(groups, k, dtype, size):
    g = group(groups, k)
    x, xs = inputs(g, dtype, length(size, g.size), "gather", size)
    before = x.copy()
    pieces = [np.array_split(a, g.size)[i] for i, a in enumerate(xs)]
    sizes = [len(piece) for piece in pieces]
    for root in range(g.size):
        what = f"gather root={root} p={g.size} rank={g.rank} n={x.size}"
        out = comm.gather(g, x, root)
        uneven = comm.gather(g, pieces[g.rank], root, sizes=sizes)
        if g.rank == root:
            check(out, np.concatenate(xs), what)
            check(uneven, np.concatenate(pieces), f"{what} sizes={sizes}")
            assert not np.shares_memory(out, x), f"{what}: returned the input itself"
        else:
            assert out is None and uneven is None, f"{what}: non-root got a result"
        unchanged(x, before, what)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", DTYPES + [np.uint8], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("k", KS[1:])
def test_send_recv(groups, k, dtype, size):
    """Each rank sends to the next one round the group; odd ranks receive first (no cycle of
    blocked large sends). The receiver learns dtype and shape from the message (uint8's
    dtype token, "|u1", holds the header's separator)."""
    g = group(groups, k)
    if g.size == 1:
        return                      # the remainder group of one: nobody to talk to
    x, xs = inputs(g, dtype, length(size, g.size), "send_recv", size)
    x = x.reshape(1, -1) if x.size % 2 else x.reshape(2, -1)     # shape travels too
    before = x.copy()
    right, left = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    if g.rank % 2 == 0:
        comm.send(g, x, right)
        out = comm.recv(g, left)
    else:
        out = comm.recv(g, left)
        comm.send(g, x, right)
    theirs = xs[left]
    check(out, theirs.reshape(1, -1) if theirs.size % 2 else theirs.reshape(2, -1),
          f"recv p={g.size} rank={g.rank} from {left}")
    unchanged(x, before, "send")


BIG_CASES = [
    ("all_reduce", np.float32, "sum"),
    ("all_reduce", np.int64, "max"),
    ("reduce_scatter", np.float64, "sum"),
    ("reduce_scatter", np.float16, "min"),
    ("all_gather", np.int32, None),
    ("broadcast", np.float64, None),
    ("reduce", np.int64, "sum"),
    ("scatter", np.float32, None),
    ("gather", np.float16, None),
    ("send_recv", np.float64, None),
]


def _case_id(case):
    name, dtype, op = case
    return f"{name}-{np.dtype(dtype).name}" + (f"-{op}" if op else "")


@pytest.mark.parametrize("case", BIG_CASES, ids=_case_id)
@pytest.mark.parametrize("k", KS[1:])
def test_big(groups, k, case):
    """2^20 + 3 elements: the large-message algorithms (ring, chain) with uneven pieces."""
    name, dtype, op = case
    g = group(groups, k)
    p, r = g.size, g.rank
    x, xs = inputs(g, dtype, BIG, "big", name)
    before = x.copy()
    what = f"{name} {np.dtype(dtype).name} op={op} p={p} rank={r} n={BIG}"
    root = p - 1
    if name == "all_reduce":
        check(comm.all_reduce(g, x, op), functools.reduce(NP_OPS[op], xs), what)
    elif name == "reduce_scatter":
        full = functools.reduce(NP_OPS[op], xs)
        check(comm.reduce_scatter(g, x, op), np.array_split(full, p)[r], what)
    elif name == "all_gather":
        check(comm.all_gather(g, x), np.concatenate(xs), what)
    elif name == "broadcast":
        check(comm.broadcast(g, x if r == root else None, root), xs[root], what)
    elif name == "reduce":
        out = comm.reduce(g, x, root, op)
        if r == root:
            check(out, functools.reduce(NP_OPS[op], xs), what)
    elif name == "scatter":
        check(comm.scatter(g, x if r == root else None, root),
              np.array_split(xs[root], p)[r], what)
    elif name == "gather":
        out = comm.gather(g, x, root)
        if r == root:
            check(out, np.concatenate(xs), what)
    elif name == "send_recv" and p > 1:
        if r == 0:
            comm.send(g, x, p - 1)
        if r == p - 1:
            check(comm.recv(g, 0), xs[0], what)
    unchanged(x, before, what)
