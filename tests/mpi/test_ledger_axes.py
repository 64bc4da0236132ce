"""The ledger by axis: every call is counted under its operation (comm.traffic()) and under
the axis of the group it was started on (comm.traffic_by_axis()). The axes add up to the
operations exactly; a view (Group.with_axis) shares its group's message order; a handle is
counted under the axis it was started on; ProcessGrid's groups carry "tp", "dp", "pp",
"world"."""
import functools
import time

import numpy as np
import pytest
from mpi4py import MPI

import minipar.comm as comm
from minipar.comm import Handle
from minipar.comm.algorithms import ring
from minipar.comm.protocol import HEADER_BYTES
from minipar.parallel.grid import ProcessGrid
from minipar.parallel.layout import Layout
from minipar.plan.comm_bytes import all_reduce_sent

pytestmark = pytest.mark.mpi(min_size=2)

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()
COUNTS = ("calls", "bytes_sent", "bytes_recv")       # exact; seconds are timings


def group(groups, k):
    if k not in groups:
        pytest.skip(f"needs a world of at least {k} ranks")
    return groups[k]


def totals(ledger):
    """{field: sum over the ledger's entries} of the exact fields."""
    return {f: sum(e[f] for e in ledger.values()) for f in COUNTS}


def counts(entry):
    return {f: entry[f] for f in COUNTS}


def workload(g, seed):
    """A bit of everything on g: blocking collectives on each algorithm's path, rooted ones,
    an async all-reduce, blocking and non-blocking point-to-point."""
    p, r = g.size, g.rank
    rng = np.random.default_rng([r, seed])
    x = rng.standard_normal(3000)                   # 24 KB: recursive doubling
    big = rng.standard_normal(20_000)               # 160 KB: direct exchange
    comm.all_reduce(g, x)
    comm.all_reduce(g, big)
    comm.reduce_scatter(g, big)
    comm.all_gather(g, x[:100])
    comm.broadcast(g, x if r == 0 else None, 0)
    comm.reduce(g, x, 0)
    comm.all_reduce_async(g, big).wait()
    if p > 1 and r == 0:
        comm.send(g, x, 1)
        comm.recv_async(g, 1).wait()
    elif p > 1 and r == 1:
        comm.recv(g, 0)
        comm.send_async(g, big, 0).wait()


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_axes_add_up_to_the_operations(groups, k):
    """Each axis holds exactly what its group's calls put in the per-operation ledger when
    run alone, and mixed together the axes sum to the operations, field by field."""
    base = group(groups, k)
    dp = comm.Group(base.comm, axis="dp")
    zero = dp.with_axis("zero")
    tp = comm.Group(base.comm, axis="tp", debug=True)     # its debug_check is tp's too
    untagged = comm.Group(base.comm)
    alone = {}
    for g in (dp, zero, tp, untagged):
        comm.reset_traffic()
        workload(g, seed=1)
        ops = comm.traffic()
        by_axis = comm.traffic_by_axis()
        assert list(by_axis) == [g.axis], by_axis
        assert counts(by_axis[g.axis]) == totals(ops), (g.axis, by_axis, ops)
        alone[g.axis] = (ops, by_axis[g.axis])

    comm.reset_traffic()
    assert comm.traffic() == {} and comm.traffic_by_axis() == {}
    for g in (dp, tp, zero, untagged, zero, dp):                # interleaved, twice for some
        workload(g, seed=1)
    ops, by_axis = comm.traffic(), comm.traffic_by_axis()
    assert set(by_axis) == {"dp", "zero", "tp", None}, by_axis
    assert {f: sum(e[f] for e in by_axis.values()) for f in COUNTS} == totals(ops), (by_axis, ops)
    times = {"dp": 2, "zero": 2, "tp": 1, None: 1}
    for axis, n in times.items():
        want = {f: n * alone[axis][1][f] for f in COUNTS}
        assert counts(by_axis[axis]) == want, (axis, by_axis[axis], want)
    for name, entry in ops.items():                       # the per-operation ledger as before
        want = {f: sum(n * alone[axis][0].get(name, dict.fromkeys(COUNTS, 0))[f]
                       for axis, n in times.items()) for f in COUNTS}
        assert counts(entry) == want, (name, entry, want)
    comm.reset_traffic()
    assert comm.traffic_by_axis() == {}


def test_a_view_shares_its_groups_message_order(groups):
    """g.with_axis(a) differs from g only in its label: the same communicator, call counter
    (so collective tags never collide), scratch buffers, pending receives and settings.
    Async calls on both, advanced in opposite orders on neighbouring ranks, each get their
    own messages; point-to-point messages through either arrive in the order they were sent."""
    g = comm.Group(group(groups, SIZE).comm, axis="dp")
    z = g.with_axis("zero")
    p, r = g.size, g.rank
    assert (z.axis, g.axis) == ("zero", "dp")
    assert z.comm is g.comm and (z.rank, z.size, z.world_ranks) == (g.rank, g.size, g.world_ranks)
    assert np.shares_memory(z.scratch(0, (8,), np.float64), g.scratch(0, (8,), np.float64))
    before = g.calls
    comm.all_reduce(z, np.ones(4))
    assert g.calls == z.calls == before + 1
    timeout = g.timeout
    g.timeout = 123.0
    assert z.timeout == 123.0
    g.timeout = timeout

    # Ring all-reduces (several steps each) of equal sizes, alternately on g and z. If the
    # view counted calls apart, two of them would share a tag, and a rank advancing them in
    # another order than its neighbour would take the other call's message: wrong sums.
    rng = np.random.default_rng([r, 5])
    xs = [rng.integers(-50, 50, 4 * p).astype(np.float64) for _ in range(6)]
    on = [g, z, g, z, z, g]
    handles = [Handle(*ring.start_all_reduce(h, x, "sum")) for h, x in zip(on, xs)]
    middle = comm.all_reduce(z, xs[0], "max")
    order = handles if r % 2 == 0 else handles[::-1]
    deadline = time.monotonic() + 60
    while not all([h.test() for h in order]):
        assert time.monotonic() < deadline, "test() made no progress"
    every = [g.comm.allgather(x) for x in xs]
    for i, h in enumerate(handles):
        np.testing.assert_array_equal(h.wait(), functools.reduce(np.add, every[i]),
                                      err_msg=f"call {i} on {on[i].axis}, rank {r}")
    np.testing.assert_array_equal(middle, functools.reduce(np.maximum, every[0]))

    # MINIPAR_DEBUG numbers calls on the shared counter: alternating g and z agree.
    gd = comm.Group(g.comm, axis="dp", debug=True)
    zd = gd.with_axis("zero")
    for h in (gd, zd, zd, gd):
        np.testing.assert_array_equal(comm.all_reduce(h, np.ones(3)), np.full(3, p))

    if p < 2:
        return
    msgs = [np.arange(5.0), np.ones((2, 3), np.float32), np.arange(7, dtype=np.int64),
            np.linspace(0, 1, 50_000)]
    if r == 0:
        sends = [comm.send_async(g, msgs[0], 1), comm.send_async(z, msgs[1], 1)]
        comm.send(z, msgs[2], 1)
        sends.append(comm.send_async(g, msgs[3], 1))
        for h in sends:
            h.wait()
    elif r == 1:
        pending = comm.recv_async(z, 0)
        with pytest.raises(comm.CommError, match="still pending"):     # one receive set for both
            comm.recv(g, 0)
        got = [pending.wait(), comm.recv(g, 0), comm.recv_async(g, 0).wait(), comm.recv(z, 0)]
        for a, b in zip(got, msgs):
            assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
            np.testing.assert_array_equal(a, b)


def test_a_handle_counts_under_the_axis_it_was_started_on(groups):
    """An all-reduce and a send/recv started on the "zero" view and finished after blocking
    calls on the "dp" group: counted under "zero" when they complete, never under "dp"."""
    g = comm.Group(group(groups, SIZE).comm, axis="dp")
    z = g.with_axis("zero")
    p, r = g.size, g.rank
    x, y = np.ones(50_000), np.ones(300)
    comm.reset_traffic()                            # what each call counts on its own
    comm.all_reduce_async(g, x).wait()
    alone_async = counts(comm.traffic()["all_reduce"])
    comm.reset_traffic()
    comm.all_reduce(g, y)
    alone_blocking = counts(comm.traffic()["all_reduce"])
    payload = np.arange(1000.0)

    comm.reset_traffic()
    h = comm.all_reduce_async(z, x)
    p2p = None
    if p > 1 and r == 0:
        p2p = comm.send_async(z, payload, 1)
    elif p > 1 and r == 1:
        p2p = comm.recv_async(z, 0)
    comm.all_reduce(g, y)                           # on the parent, while the view's are open
    if p > 1:                                       # nothing advanced them: not counted yet
        assert "zero" not in comm.traffic_by_axis(), comm.traffic_by_axis()
    assert counts(comm.traffic_by_axis()["dp"]) == alone_blocking
    h.wait()
    if p2p is not None:
        got = p2p.wait()
        if r == 1:
            np.testing.assert_array_equal(got, payload)
    by_axis = comm.traffic_by_axis()
    assert counts(by_axis["dp"]) == alone_blocking, by_axis
    want = dict(alone_async)
    if p2p is not None:
        p2p_bytes = payload.nbytes + HEADER_BYTES
        want["calls"] += 1
        want["bytes_sent" if r == 0 else "bytes_recv"] += p2p_bytes
    assert counts(by_axis["zero"]) == want, (by_axis, want)
    assert totals(by_axis) == totals(comm.traffic())


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_grid_groups_carry_their_axis(tp, pp):
    """ProcessGrid tags its groups "tp", "dp", "pp" and "world"; an all-reduce on each is
    counted under that axis with the bytes comm_bytes.all_reduce_sent predicts for the group."""
    if SIZE % (tp * pp):
        pytest.skip(f"world of {SIZE} ranks is not divisible by tp*pp = {tp * pp}")
    grid = ProcessGrid(WORLD, Layout(dp=SIZE // (tp * pp), tp=tp, pp=pp))
    named = {"tp": grid.tp_group, "dp": grid.dp_group, "pp": grid.pp_group, "world": grid.world}
    assert {axis: g.axis for axis, g in named.items()} == {a: a for a in named}
    comm.reset_traffic()
    n = {"tp": 1000, "dp": 3000, "pp": 20_000, "world": 7}
    for axis, g in named.items():
        comm.all_reduce(g, np.ones(n[axis]))
    by_axis = comm.traffic_by_axis()
    assert set(by_axis) == set(named), by_axis
    for axis, g in named.items():
        want = all_reduce_sent(n[axis], 8, g.size, g.rank)
        assert (by_axis[axis]["calls"], by_axis[axis]["bytes_sent"]) == (1, want), \
            (axis, g.size, g.rank, by_axis[axis], want)
    assert totals(by_axis) == totals(comm.traffic())
