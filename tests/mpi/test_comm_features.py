"""The rest of minipar.comm: the ledger's exact volumes, the trace, MINIPAR_DEBUG's mismatch
detection, timeouts, non-blocking handles, random floats, odd shapes, and argument errors."""
import functools
import re
import time

import numpy as np
import pytest
from mpi4py import MPI

import minipar.comm as comm
from minipar.comm.algorithms import direct, doubling, ring, tree
from minipar.comm.protocol import HEADER_BYTES

pytestmark = pytest.mark.mpi(min_size=2)

WORLD = MPI.COMM_WORLD
NP_OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def group(groups, k):
    if k not in groups:
        pytest.skip(f"needs a world of at least {k} ranks")
    return groups[k]


def world(groups):
    return groups[WORLD.Get_size()]


def rng_for(*key):
    return np.random.default_rng([WORLD.Get_rank(), *key])


def total(g, value):
    """Sum of value over the group, with MPI's own allreduce (the test's oracle)."""
    return g.comm.allreduce(value)


# ---------------------------------------------------------------------------- the ledger

@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_ledger_ring_volumes(groups, k):
    """Ring (and direct-exchange) all-reduce of n bytes sends and receives 2(p-1)/p * n per
    rank; reduce-scatter and all-gather (p-1)/p * n; a group of one sends nothing."""
    g = group(groups, k)
    p = g.size
    x = np.ones(p * 3000, np.float64)               # p divides n
    n = x.nbytes
    comm.reset_traffic()
    assert comm.traffic() == {}
    for algorithm in (ring, direct):                # the same volumes, in p-1 steps or 1 round
        algorithm.all_reduce(g, x)
        algorithm.reduce_scatter(g, x)
        algorithm.all_gather(g, x[:x.size // p])    # the result has n bytes
    big = np.ones(p * 40_000)                       # 320 KB per rank: above the crossover
    comm.all_reduce(g, big)
    t = comm.traffic()
    assert t["all_reduce"]["calls"] == 3
    expected = {"all_reduce": 2 * (p - 1) * (2 * n + big.nbytes) // p,
                "reduce_scatter": 2 * (p - 1) * n // p,
                "all_gather": 2 * (p - 1) * n // p}
    for name, volume in expected.items():
        assert t[name]["bytes_sent"] == volume, (name, p, t[name])
        assert t[name]["bytes_recv"] == volume, (name, p, t[name])
        assert t[name]["seconds"] >= 0.0
    assert "debug_check" not in t
    comm.reset_traffic()
    assert comm.traffic() == {}


@pytest.mark.parametrize("k", [2, 3, 4])
def test_ledger_doubling_volumes(groups, k):
    """Recursive doubling sends the whole message log2(q) times (q: the largest power of two
    <= p), plus one more for each rank in a fix-up pair; Bruck's all-gather sends (p-1)/p."""
    g = group(groups, k)
    p, r = g.size, g.rank
    x = np.ones(p * 64, np.float32)
    n = x.nbytes
    comm.reset_traffic()
    doubling.all_reduce(g, x)
    doubling.all_gather(g, x[:x.size // p])
    t = comm.traffic()
    q = 1 << (p.bit_length() - 1)
    log_q = q.bit_length() - 1
    if r >= q:                                      # extra rank: sends x, gets the answer
        sent, recvd = n, n
    elif r < p - q:                                 # its partner
        sent, recvd = (log_q + 1) * n, (log_q + 1) * n
    else:
        sent, recvd = log_q * n, log_q * n
    assert (t["all_reduce"]["bytes_sent"], t["all_reduce"]["bytes_recv"]) == (sent, recvd), \
        (p, r, t["all_reduce"])
    assert t["all_gather"]["bytes_sent"] == (p - 1) * n // p, (p, r, t["all_gather"])


@pytest.mark.parametrize("k", [2, 3, 4])
def test_ledger_rooted_and_point_to_point(groups, k):
    """Binomial broadcast and reduce move the message once per edge (p-1 edges, plus the
    128-byte dtype/shape header for broadcast); send/recv count header and payload."""
    g = group(groups, k)
    p, r = g.size, g.rank
    x = np.arange(1000, dtype=np.float64)
    comm.reset_traffic()
    comm.broadcast(g, x if r == 0 else None, 0)
    comm.reduce(g, x, 0)
    if p > 1:
        if r == 0:
            comm.send(g, x, 1)
        elif r == 1:
            comm.recv(g, 0)
    t = comm.traffic()
    for name, per_edge in [("broadcast", x.nbytes + HEADER_BYTES), ("reduce", x.nbytes)]:
        sent = total(g, t[name]["bytes_sent"])
        recvd = total(g, t[name]["bytes_recv"])
        assert sent == recvd == (p - 1) * per_edge, (name, p, sent, recvd)
    if p > 1 and r == 0:
        assert (t["send"]["calls"], t["send"]["bytes_sent"], t["send"]["bytes_recv"]) == \
            (1, x.nbytes + HEADER_BYTES, 0), t["send"]
    if p > 1 and r == 1:
        assert (t["recv"]["calls"], t["recv"]["bytes_sent"], t["recv"]["bytes_recv"]) == \
            (1, 0, x.nbytes + HEADER_BYTES), t["recv"]


# ---------------------------------------------------------------------------- the trace

def test_trace_prints_every_message(groups, capfd):
    base = world(groups)
    g = comm.Group(base.comm, trace=True)
    p, w = g.size, g.world_ranks
    x = np.ones(p * 512, np.float64)                # pieces of 4096 B
    capfd.readouterr()
    ring.all_reduce(g, x)
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("rank ")]
    right = w[(g.rank + 1) % p]
    expected = [f"rank {w[g.rank]} -> {right} | all_reduce step {s}/{2 * (p - 1)} | 4096 B"
                for s in range(1, 2 * (p - 1) + 1)]
    assert lines == expected


# ---------------------------------------------------------------------------- MINIPAR_DEBUG

def _mismatch(g, calls):
    """Every rank makes calls[rank % len(calls)]; returns the CollectiveMismatch text."""
    with pytest.raises(comm.CollectiveMismatch) as info:
        calls[g.rank % len(calls)]()
    return str(info.value)


def test_debug_names_what_each_rank_called(groups):
    g = comm.Group(world(groups).comm, debug=True)
    x = np.ones(10, np.float32)
    text = _mismatch(g, [lambda: comm.all_reduce(g, x), lambda: comm.all_gather(g, x)])
    for r in range(g.size):
        name = "all_reduce" if r % 2 == 0 else "all_gather"
        assert re.search(rf"rank {r} \(world {g.world_ranks[r]}\): call #1: {name}\(", text), text

    text = _mismatch(g, [lambda: comm.all_reduce(g, x),
                         lambda: comm.all_reduce(g, x.astype(np.float64))])
    assert "float32" in text and "float64" in text, text
    text = _mismatch(g, [lambda: comm.all_reduce(g, x), lambda: comm.all_reduce(g, x[:9])])
    assert "shape=(10,)" in text and "shape=(9,)" in text, text
    text = _mismatch(g, [lambda: comm.all_reduce(g, x, "sum"),
                         lambda: comm.all_reduce(g, x, "max")])
    assert "op=sum" in text and "op=max" in text, text
    text = _mismatch(g, [lambda: comm.broadcast(g, x, 0), lambda: comm.broadcast(g, x, 1)])
    assert "root=0" in text and "root=1" in text, text

    # a rank that skipped a call: the call numbers differ
    if g.rank == 0:
        g.calls += 1
    text = _mismatch(g, [lambda: comm.all_reduce(g, x)])
    assert "call #6: all_reduce" in text and "call #7: all_reduce" in text, text
    if g.rank == 0:
        g.calls -= 1

    # nothing was left half-sent: the group still works, and the checks are in the ledger
    comm.reset_traffic()
    out = comm.all_reduce(g, x)
    np.testing.assert_array_equal(out, np.full(10, g.size, np.float32))
    assert comm.traffic()["debug_check"]["calls"] == 1


def test_debug_agreeing_calls_pass(groups):
    g = comm.Group(world(groups).comm, debug=True)
    p, r = g.size, g.rank
    x = np.arange(7, dtype=np.int64) + r
    np.testing.assert_array_equal(comm.all_reduce(g, x, "max"), np.arange(7) + p - 1)
    pieces = [len(a) for a in np.array_split(np.arange(7), p)]
    mine = comm.reduce_scatter(g, x)
    np.testing.assert_array_equal(comm.all_gather(g, mine, sizes=pieces), comm.all_reduce(g, x))
    np.testing.assert_array_equal(comm.broadcast(g, x if r == 1 else None, 1), np.arange(7) + 1)
    np.testing.assert_array_equal(comm.scatter(g, x if r == 0 else None, 0),
                                  np.array_split(np.arange(7), p)[r])


# ---------------------------------------------------------------------------- timeouts

def test_timeout_names_operation_step_and_peer(groups):
    """In each pair, rank 0 calls all_reduce (blocking, then non-blocking) while rank 1 waits
    in recv: nobody matches, both give up after 0.5 s with the operation, step and peer."""
    base = group(groups, 2)
    g = comm.Group(base.comm, timeout=0.5)
    if g.size < 2:
        return
    w = g.world_ranks
    x = np.ones(16, np.float64)
    start = time.monotonic()
    if g.rank == 0:
        with pytest.raises(comm.CommTimeout) as info:
            comm.all_reduce(g, x)
        assert f"rank {w[0]}: all_reduce step 1/1" in str(info.value), info.value
        assert f"receive from rank {w[1]}" in str(info.value), info.value
        handle = comm.all_reduce_async(g, x)
        with pytest.raises(comm.CommTimeout, match=f"all_reduce step 1/1.*rank {w[1]}"):
            handle.wait()
    else:
        for _ in range(2):
            with pytest.raises(comm.CommTimeout) as info:
                comm.recv(g, 0)
            assert f"rank {w[1]}: recv step 1/2" in str(info.value), info.value
            assert f"receive from rank {w[0]}" in str(info.value), info.value
        buf = np.empty(16, np.float64)              # drain rank 0's two small sends
        for _ in range(2):
            g.comm.Recv(buf, source=0, tag=MPI.ANY_TAG)
    assert time.monotonic() - start < 20


# ---------------------------------------------------------------------------- non-blocking

def test_async_handles_overlap(groups):
    """Several collectives in flight at once, a blocking one in the middle, finished by
    polling test() in reverse order: each result as if it had run alone."""
    g = world(groups)
    p, r = g.size, g.rank
    rng = rng_for(1)
    xs = [rng.integers(-50, 50, n).astype(np.float64) for n in (3, 5000, 300_000, 40_000)]
    handles = [comm.all_reduce_async(g, xs[0]), comm.all_reduce_async(g, xs[1], "max"),
               comm.reduce_scatter_async(g, xs[2]), comm.all_gather_async(g, xs[3]),
               comm.all_reduce_async(g, xs[2], "min")]
    middle = comm.all_reduce(g, xs[1])
    deadline = time.monotonic() + 60
    while not all([h.test() for h in reversed(handles)]):
        assert time.monotonic() < deadline, "test() made no progress"
    assert all(h.done for h in handles)
    got = [h.wait() for h in handles]
    every = [g.comm.allgather(x) for x in xs]
    np.testing.assert_array_equal(got[0], functools.reduce(np.add, every[0]))
    np.testing.assert_array_equal(got[1], functools.reduce(np.maximum, every[1]))
    np.testing.assert_array_equal(got[2], np.array_split(functools.reduce(np.add, every[2]), p)[r])
    np.testing.assert_array_equal(got[3], np.concatenate(every[3]))
    np.testing.assert_array_equal(got[4], functools.reduce(np.minimum, every[2]))
    np.testing.assert_array_equal(middle, functools.reduce(np.add, every[1]))


def test_async_progresses_while_other_work_happens(groups):
    """An 8 MiB all-reduce started, then advanced only by test() between chunks of other work
    (as a gradient bucket would be during backward), completes before wait() is called."""
    g = world(groups)
    x = np.full(1 << 20, 1.0)
    handle = comm.all_reduce_async(g, x)
    deadline = time.monotonic() + 60
    while not handle.test():
        np.dot(np.ones(2000), np.ones(2000))        # "backward"
        assert time.monotonic() < deadline, "test() made no progress"
    assert handle.done
    np.testing.assert_array_equal(handle.wait(), np.full(1 << 20, float(g.size)))


# ---------------------------------------------------------------------------- floats, shapes

@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("n", [17, 100_003])
def test_random_floats_and_identical_results(groups, dtype, rtol, n):
    """Random floats: close to NumPy's sum in the input dtype, and bit-identical on every rank
    (what keeps data-parallel replicas identical)."""
    g = world(groups)
    p, r = g.size, g.rank
    x = rng_for(2, n).standard_normal(n).astype(dtype)
    xs = g.comm.allgather(x)
    expected = np.sum(np.stack(xs).astype(np.float64), axis=0)
    for name, fn in [("ring", ring.all_reduce), ("doubling", doubling.all_reduce),
                     ("direct", direct.all_reduce), ("auto", comm.all_reduce)]:
        out = fn(g, x)
        assert out.dtype == dtype
        np.testing.assert_allclose(out, expected, rtol=rtol, atol=rtol * 10, err_msg=name)
        every = g.comm.allgather(out.tobytes())
        assert all(b == every[0] for b in every), f"{name}: ranks got different bits"
    piece = comm.reduce_scatter(g, x)
    np.testing.assert_allclose(piece, np.array_split(expected, p)[r], rtol=rtol, atol=rtol * 10)
    summed = comm.reduce(g, x, 0)
    if r == 0:
        np.testing.assert_allclose(summed, expected, rtol=rtol, atol=rtol * 10)


def _shapes(rng):
    base = rng.integers(-100, 100, 240).astype(np.float64)
    return {"strided": base[::3],                       # non-contiguous 1-D
            "transposed": base.reshape(12, 20).T,         # Fortran order
            "sliced 3-D": base.reshape(4, 6, 10)[:, ::2, 1:9],
            "0-d": np.array(base[0]),
            "list": [1.5, 2.5, -3.0]}


@pytest.mark.parametrize("label", ["strided", "transposed", "sliced 3-D", "0-d", "list"])
def test_noncontiguous_and_any_shape(groups, label):
    g = world(groups)
    p, r = g.size, g.rank
    x = _shapes(rng_for(3))[label]
    before = np.array(x, copy=True)
    xs = [np.asarray(a) for a in g.comm.allgather(x)]
    total_ = functools.reduce(np.add, xs)
    flat = [a.ravel() for a in xs]
    for name, out, expected in [
        ("all_reduce ring", ring.all_reduce(g, x), total_),
        ("all_reduce doubling", doubling.all_reduce(g, x), total_),
        ("all_reduce direct", direct.all_reduce(g, x), total_),
        ("reduce_scatter", comm.reduce_scatter(g, x), np.array_split(total_.ravel(), p)[r]),
        ("all_gather", comm.all_gather(g, x), np.concatenate(flat)),
        ("broadcast", comm.broadcast(g, x if r == 1 else None, 1), xs[1]),
        ("scatter", comm.scatter(g, x if r == 1 else None, 1), np.array_split(flat[1], p)[r]),
    ]:
        np.testing.assert_array_equal(out, expected, err_msg=f"{name} {label}")
        assert out.shape == expected.shape, (name, label, out.shape, expected.shape)
    out = comm.reduce(g, x, 0)
    gathered = comm.gather(g, x, 0)
    if r == 0:
        np.testing.assert_array_equal(out, total_)
        np.testing.assert_array_equal(gathered, np.concatenate(flat))
    np.testing.assert_array_equal(np.asarray(x), before, err_msg=f"{label}: input modified")


def test_bfloat16_as_raw_bytes(groups):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    g = world(groups)
    p, r = g.size, g.rank
    x = (np.arange(10) + r).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(comm.all_reduce(g, x, "max").astype(np.float32),
                                  np.arange(10) + p - 1)
    np.testing.assert_array_equal(comm.all_reduce(g, x).astype(np.float32),
                                  p * np.arange(10) + p * (p - 1) // 2)
    if r == 0:
        comm.send(g, x.reshape(2, 5), 1)
    elif r == 1:
        got = comm.recv(g, 0)
        assert got.dtype == x.dtype and got.shape == (2, 5)
        np.testing.assert_array_equal(got.astype(np.float32), np.arange(10).reshape(2, 5))


# ---------------------------------------------------------------------------- out=

@pytest.mark.parametrize("n", [10, 100_001])
def test_out_buffers_and_in_place(groups, n):
    """out= receives the result (no new array); all_reduce may work in place on x."""
    g = world(groups)
    p, r = g.size, g.rank
    x = (np.arange(n) % 7 + r).astype(np.float32).reshape(-1, 1) if n % 2 else \
        (np.arange(n) % 7 + r).astype(np.float32).reshape(2, -1)
    expected = (np.arange(n) % 7 * p + p * (p - 1) // 2).astype(np.float32).reshape(x.shape)
    for name, fn in [("auto", comm.all_reduce), ("ring", ring.all_reduce),
                     ("doubling", doubling.all_reduce), ("direct", direct.all_reduce)]:
        out = np.empty_like(x)
        assert fn(g, x, out=out) is out
        np.testing.assert_array_equal(out, expected, err_msg=name)
        mine = x.copy()
        assert fn(g, mine, out=mine) is mine                       # in place
        np.testing.assert_array_equal(mine, expected, err_msg=f"{name} in place")
    handle = comm.all_reduce_async(g, x, out=np.empty_like(x))
    np.testing.assert_array_equal(handle.wait(), expected)
    piece = np.array_split(expected.ravel(), p)[r]
    for fn in (comm.reduce_scatter, ring.reduce_scatter, doubling.reduce_scatter,
               direct.reduce_scatter):
        out = np.empty_like(piece)
        assert fn(g, x, out=out) is out
        np.testing.assert_array_equal(out, piece)
    sizes = [len(a) for a in np.array_split(np.arange(n), p)]
    for fn in (comm.all_gather, ring.all_gather, doubling.all_gather, direct.all_gather):
        out = np.empty(n, np.float32)
        assert fn(g, piece, sizes=sizes, out=out) is out
        np.testing.assert_array_equal(out, expected.ravel())
    with pytest.raises(ValueError, match="out must be a writeable C-contiguous float32 array"):
        comm.all_reduce(g, x, out=np.empty(x.shape, np.float64))
    with pytest.raises(ValueError, match="out must be"):
        comm.all_gather(g, piece, sizes=sizes, out=np.empty(2 * n, np.float32)[::2])


# ---------------------------------------------------------------------------- point-to-point only

class PointToPointOnly:
    """Stands in for a Group's communicator: passes on Isend and Irecv, refuses the rest."""

    def __init__(self, comm):
        self._comm, self.used = comm, set()

    def __getattr__(self, name):
        if name not in ("Isend", "Irecv"):
            raise AssertionError(f"minipar.comm called {name} on its communicator")
        self.used.add(name)
        return getattr(self._comm, name)


def test_every_function_uses_only_isend_and_irecv(groups):
    """Behind the static scan (tests/test_comm_static.py): run every function, every algorithm,
    on a communicator that allows nothing but Isend and Irecv."""
    g = comm.Group(world(groups).comm)
    p2p = g.comm
    g.comm = PointToPointOnly(p2p)
    p, r = g.size, g.rank
    x = np.arange(5000, dtype=np.float64) + r
    expected = np.arange(5000) * p + p * (p - 1) / 2
    np.testing.assert_array_equal(ring.all_reduce(g, x), expected)
    np.testing.assert_array_equal(doubling.all_reduce(g, x), expected)
    np.testing.assert_array_equal(comm.all_reduce_async(g, x).wait(), expected)
    np.testing.assert_array_equal(direct.all_reduce(g, x), expected)
    np.testing.assert_array_equal(ring.reduce_scatter(g, x), np.array_split(expected, p)[r])
    np.testing.assert_array_equal(direct.reduce_scatter(g, x), np.array_split(expected, p)[r])
    np.testing.assert_array_equal(doubling.reduce_scatter(g, x), np.array_split(expected, p)[r])
    for gather_all in (ring.all_gather, doubling.all_gather, direct.all_gather):
        np.testing.assert_array_equal(gather_all(g, x[:3]),
                                      np.concatenate([np.arange(3) + i for i in range(p)]))
    np.testing.assert_array_equal(comm.broadcast(g, x if r == 0 else None, 0), np.arange(5000))
    np.testing.assert_array_equal(comm.scatter(g, x if r == 0 else None, 0),
                                  np.array_split(np.arange(5000), p)[r])
    out, parts = comm.reduce(g, x, 0), comm.gather(g, x[:2], 0)
    if r == 0:
        np.testing.assert_array_equal(out, expected)
        np.testing.assert_array_equal(parts, np.concatenate([[i, i + 1] for i in range(p)]))
    if r == 0:
        comm.send(g, x, 1)
    elif r == 1:
        np.testing.assert_array_equal(comm.recv(g, 0), np.arange(5000))
    assert g.comm.used == {"Isend", "Irecv"}


# ---------------------------------------------------------------------------- errors

def test_bad_arguments_raise_before_any_message(groups):
    g = world(groups)
    x = np.ones(4)
    comm.reset_traffic()
    with pytest.raises(ValueError, match="op must be one of sum, max, min, got 'avg'"):
        comm.all_reduce(g, x, "avg")
    with pytest.raises(ValueError, match="root must be a rank"):
        comm.broadcast(g, x, g.size)
    with pytest.raises(ValueError, match="sizes has 1 entries"):
        comm.all_gather(g, x, sizes=[4])
    with pytest.raises(ValueError, match="cannot send to itself"):
        comm.send(g, x, g.rank)
    assert comm.traffic() == {}
    np.testing.assert_array_equal(comm.all_reduce(g, x), np.full(4, g.size))  # still in step


# ---------------------------------------------------------------------- straight-line fast paths

def test_straight_line_path_matches_the_general_path(groups, capfd):
    """Blocking calls on small messages run straight_line.py instead of the generators: the
    same results bit for bit, the same ledger volumes and the same trace lines; receive buffers
    reused across calls of other sizes and dtypes (Group.scratch) never leak into results."""
    from minipar.comm.algorithms import straight_line
    base = world(groups)
    g = comm.Group(base.comm, trace=True)
    p, r = g.size, g.rank
    rng = rng_for(7)
    cases = [rng.standard_normal(n).astype(dt) for n, dt in
             [(1000, np.float32), (7, np.float64), (p * 300, np.float16), (1, np.int64),
              (5000, np.float64), (1000, np.float32), (300_001, np.float32)]]
    for x in cases:
        large = x.nbytes > comm.SMALL_MAX_BYTES     # direct reduce-scatter, all-gather only
        pieces = [len(a) for a in np.array_split(np.arange(x.size), p)]
        mine = np.array_split(x, p)[r].copy()
        runs = {}
        for label, calls in [
                ("straight_line",
                 [lambda: straight_line.reduce_scatter_into(g, x, "max", None),
                  lambda: straight_line.all_gather_into(g, mine, pieces, None),
                  lambda: straight_line.all_reduce_direct_into(g, x, "sum", None)]
                 + ([] if large else
                    [lambda: straight_line.all_reduce_into(g, x, "sum", None),
                     lambda: straight_line.all_gather_into(g, mine, pieces, None, bruck=True)])),
                ("general", [lambda: direct.reduce_scatter(g, x, "max"),
                             lambda: direct.all_gather(g, mine, pieces),
                             lambda: direct.all_reduce(g, x, "sum")]
                 + ([] if large else [lambda: doubling.all_reduce(g, x, "sum"),
                                      lambda: doubling.all_gather(g, mine, pieces)]))]:
            comm.reset_traffic()
            capfd.readouterr()
            results = [f() for f in calls]
            lines = [ln for ln in capfd.readouterr().out.splitlines() if ln.startswith("rank ")]
            runs[label] = (results, comm.traffic(), lines)
        (res_s, led_s, tr_s), (res_g, led_g, tr_g) = runs["straight_line"], runs["general"]
        for a, b in zip(res_s, res_g):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.tobytes() == b.tobytes()
        for name in led_g:
            for field in ("calls", "bytes_sent", "bytes_recv"):
                assert led_s[name][field] == led_g[name][field], (name, field)
        assert tr_s == tr_g
        every = g.comm.allgather(res_s[1].tobytes())   # the all-gather: the same on every rank
        assert all(b == every[0] for b in every)


def test_straight_line_path_is_what_blocking_calls_use(groups):
    """comm.all_reduce & co. on a small message go through straight_line.py (and the async
    calls do not), and so does direct exchange on a large one: checked by counting calls into
    it."""
    from minipar.comm.algorithms import straight_line
    g = world(groups)
    x = np.ones(64, np.float32)
    seen = []
    originals = {name: getattr(straight_line, name) for name in
                 ("all_reduce_into", "reduce_scatter_into", "all_gather_into", "all_reduce_direct_into")}
    try:
        for name, f in originals.items():
            setattr(straight_line, name,
                    (lambda f, name: lambda *a, **k: (seen.append(name), f(*a, **k))[1])(f, name))
        comm.all_reduce(g, x)
        comm.reduce_scatter(g, x)
        comm.all_gather(g, x)
        assert seen == list(originals)[:3]
        comm.all_reduce_async(g, x).wait()
        assert seen == list(originals)[:3]
        big = np.ones(100_000, np.float32)              # 400 KB: above SMALL_MAX_BYTES
        seen.clear()
        comm.all_reduce(g, big)                         # direct exchange: straight-line at any size
        comm.reduce_scatter(g, big)
        comm.all_gather(g, big)
        assert seen == ["all_reduce_direct_into", "reduce_scatter_into", "all_gather_into"], seen
    finally:
        for name, f in originals.items():
            setattr(straight_line, name, f)


# ---------------------------------------------------------------------------- non-blocking point-to-point

def test_send_async_crossing_large_sends_do_not_deadlock(groups):
    """Two ranks send each other 4 MB at the same moment (1F1B's steady state): with blocking
    sends above the eager limit both would wait for the other's receive. send_async posts and
    returns; the ledger counts header + payload under "send", as send() does."""
    g = group(groups, 2)
    if g.size < 2:
        pytest.skip("a group of one")
    other = 1 - g.rank
    x = np.arange(500_000, dtype=np.float64) + 10 * g.rank          # 4 MB
    comm.reset_traffic()
    h = comm.send_async(g, x, other)
    got = comm.recv(g, other)
    assert h.wait() is None and h.done
    np.testing.assert_array_equal(got, np.arange(500_000) + 10 * other)
    t = comm.traffic()
    assert (t["send"]["calls"], t["send"]["bytes_sent"]) == (1, x.nbytes + HEADER_BYTES), t["send"]
    assert (t["recv"]["calls"], t["recv"]["bytes_recv"]) == (1, x.nbytes + HEADER_BYTES), t["recv"]


def test_recv_async_and_send_async_keep_message_order(groups):
    """Mixed blocking and non-blocking sends arrive in the order they were posted, with
    dtype and shape (0-d, empty, 3-D, int) intact; recv_async can be posted before the send."""
    g = group(groups, 2)
    if g.size < 2:
        pytest.skip("a group of one")
    msgs = [np.float64(3.5) * np.ones(()), np.zeros((0, 4), np.float32),
            np.arange(24, dtype=np.int32).reshape(2, 3, 4), np.linspace(0, 1, 70_000)]
    if g.rank == 1:
        h = comm.recv_async(g, 0)                                    # posted before anything is sent
        with pytest.raises(comm.CommError, match="still pending"):   # one at a time per source
            comm.recv_async(g, 0)
        with pytest.raises(comm.CommError, match="still pending"):
            comm.recv(g, 0)
        comm.send(g, np.ones(1), 0)                                  # tell rank 0 to go on
        got = [h.wait(), comm.recv_async(g, 0).wait(), comm.recv(g, 0), comm.recv_async(g, 0).wait()]
        for a, b in zip(got, msgs):
            assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
            np.testing.assert_array_equal(a, b)
    elif g.rank == 0:
        comm.recv(g, 1)
        handles = [comm.send_async(g, msgs[0], 1), comm.send_async(g, msgs[1], 1)]
        comm.send(g, msgs[2], 1)
        handles.append(comm.send_async(g, msgs[3], 1))
        for h in handles:
            h.wait()


def test_send_async_is_traced_and_point_to_point_only(groups, capfd):
    g = comm.Group(group(groups, 2).comm, trace=True)
    if g.size < 2:
        pytest.skip("a group of one")
    g.comm = PointToPointOnly(g.comm)
    x = np.ones(512, np.float64)
    capfd.readouterr()
    if g.rank == 0:
        comm.send_async(g, x, 1).wait()
    else:
        np.testing.assert_array_equal(comm.recv_async(g, 0).wait(), x)
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("rank ")]
    w = g.world_ranks
    if g.rank == 0:
        assert lines == [f"rank {w[0]} -> {w[1]} | send step 1/2 | {HEADER_BYTES} B",
                         f"rank {w[0]} -> {w[1]} | send step 2/2 | 4096 B"], lines
    assert g.comm.used <= {"Isend", "Irecv"} and g.comm.used


def test_send_async_bad_arguments(groups):
    g = world(groups)
    with pytest.raises(ValueError, match="cannot send to itself"):
        comm.send_async(g, np.ones(2), g.rank)
    with pytest.raises(ValueError, match="dst must be a rank"):
        comm.send_async(g, np.ones(2), g.size)
    with pytest.raises(ValueError, match="cannot receive from itself"):
        comm.recv_async(g, g.rank)
