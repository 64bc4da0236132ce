"""The hierarchical all-to-all (minipar/comm/algorithms/hierarchical_alltoall.py) on groups that span hosts.

As tests/mpi/test_hierarchical.py: the 4 ranks share one machine, so each group gets host names
of its own: 2 hosts x 2 ranks, 2 + 1 (a sub-group of 3), 2 + 1 + 1, interleaved (0 1 0 1),
one rank per host and all on one host. Checked: the result is every rank's piece for this
one, in source order, bit for bit (equal pieces and variable sizes with empty pieces, four
dtypes, 1-D and 2-D rows); the ledger's bytes inside and across hosts equal bytes_sent()
exactly; the messages across hosts are messages() (k times fewer than the flat exchange's);
the dispatcher takes it exactly when a group spans hosts, up to the measured crossover.
"""
import numpy as np
import pytest
from mpi4py import MPI

from minipar import comm
from named_hosts import group_on_hosts
from minipar.comm.algorithms import alltoall, hierarchical_alltoall as ha
from minipar.comm import calls as calls_mod

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
pytestmark = pytest.mark.skipif(SIZE != 4, reason="written for 4 ranks")

LAYOUTS = {"2x2": (0, 0, 1, 1), "2+1": (0, 0, 1, None), "2+1+1": (0, 0, 1, 2),
           "interleaved": (0, 1, 0, 1), "1+1+1+1": (0, 1, 2, 3), "one host": (0, 0, 0, 0)}
SPANS = {"2x2", "2+1", "2+1+1", "interleaved"}      # several hosts, several ranks on one
DTYPES = [np.float64, np.float32, np.int64, np.float16]


def group_for(name):
    return group_on_hosts(LAYOUTS[name])


def make(g, rows, rest, dtype, salt):
    rng = np.random.default_rng(1000 * salt + 10 * g.rank + rows)
    x = rng.integers(-100, 100, (rows,) + rest)
    return x.astype(dtype)


def expected(g, x, counts):
    """Rank s's piece for me, for every s: from everyone's x and counts (MPI's allgather,
    allowed in tests)."""
    xs, cs = g.comm.allgather(x), g.comm.allgather(counts)
    parts = []
    for s in range(g.size):
        off = np.cumsum([0] + list(cs[s]))
        parts.append(xs[s][off[g.rank]:off[g.rank + 1]])
    return np.concatenate(parts), [c[g.rank] for c in cs]


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("rows", [0, 5])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rest", [(), (3,)])
def test_equal(name, rows, dtype, rest):
    g = group_for(name)
    if g is None:
        return
    x = make(g, rows * g.size, rest, dtype, 1)
    want, sizes = expected(g, x, [rows] * g.size)
    got = ha.all_to_all(g, x)
    assert got.dtype == x.dtype and got.shape == x.shape and np.array_equal(got, want)
    out = np.empty_like(x)
    res, got_sizes = ha.all_to_all(g, x, out=out, return_sizes=True)
    assert res is out and np.array_equal(out, want) and got_sizes == sizes
    assert np.array_equal(comm.all_to_all_async(g, x).wait(), want)
    assert np.array_equal(comm.all_to_all(g, x), want)


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("dtype", [np.float64, np.int64])
@pytest.mark.parametrize("rest", [(), (2, 3)])
@pytest.mark.parametrize("salt", [1, 2, 3])
def test_variable(name, dtype, rest, salt):
    g = group_for(name)
    if g is None:
        return
    rng = np.random.default_rng(salt * 10 + g.rank)
    counts = [int(c) for c in rng.integers(0, 4, g.size)]      # zeros among them
    if salt == 3 and g.rank == 0:
        counts = [0] * g.size                                   # a rank that sends nothing
    x = make(g, sum(counts), rest, dtype, salt)
    want, sizes = expected(g, x, counts)
    got, got_sizes = ha.all_to_all(g, x, sizes=counts, return_sizes=True)
    assert got_sizes == sizes and got.shape == want.shape and np.array_equal(got, want)
    h = ha.start_all_to_all(g, x, counts, return_sizes=True)
    res, s2 = comm.Handle(*h).wait()
    assert np.array_equal(res, want) and s2 == sizes


def ledger(call, g, x, **kw):
    comm.reset_traffic()
    call(g, x, **kw)
    t = comm.traffic_by_axis()[None]
    return t["bytes_sent"] - t["bytes_sent_inter"], t["bytes_sent_inter"]


@pytest.mark.parametrize("name", LAYOUTS)
def test_bytes_equal_the_formula(name):
    g = group_for(name)
    if g is None:
        return
    rows = 6
    x = np.ones((rows * g.size, 5))
    piece = rows * 5 * 8
    assert ledger(ha.all_to_all, g, x) == ha.bytes_sent(g.nodes, g.rank, piece)
    inside, across = ledger(alltoall.pairwise, g, x)
    assert across == sum(g.remote) * piece               # flat: a piece per rank on another host
    host_total = [0] * g.n_nodes                         # what leaves each host: the same bytes
    for q, (flat, hier) in enumerate(g.comm.allgather((across, ha.bytes_sent(g.nodes, g.rank, piece)[1]))):
        host_total[g.nodes[q]] += flat - hier
    assert host_total == [0] * g.n_nodes
    if name == "2x2":                                    # the docstring's table, N = k = 2
        n = x.nbytes
        assert ha.bytes_sent(g.nodes, g.rank, piece) == (n // 2, n // 2)
        assert inside == n // 4


@pytest.mark.parametrize("name", LAYOUTS)
def test_variable_bytes_equal_the_formula(name):
    g = group_for(name)
    if g is None:
        return
    counts = [(3 * g.rank + 2 * q) % 4 for q in range(g.size)]          # zeros among them
    x = np.ones((sum(counts), 5), np.float32)
    B = np.array(g.comm.allgather(counts)) * 5 * 4                      # B[s][q]: bytes of s's piece for q
    rows = ha.bytes_sent(g.nodes, g.rank, B)
    heads = ha.bytes_sent(g.nodes, g.rank, 8)                           # the counts, one int64 a piece
    assert ledger(ha.all_to_all, g, x, sizes=counts) == (rows[0] + heads[0], rows[1] + heads[1])


def test_formula_by_hand():
    """2 + 1 (nodes 0 0 1): rank 2 alone on its host deputises for both ranks of host 0."""
    nodes = (0, 0, 1)
    assert ha.plan(nodes, 0)[1] == {0: [0, 2], 1: [1]}   # rank 0 forwards host 0's pieces for 2
    assert ha.plan(nodes, 2)[1] == {2: [2, 0, 1]}
    assert [ha.bytes_sent(nodes, r, 10) for r in range(3)] == [(10, 20), (20, 0), (0, 20)]
    B = [[0, 1, 2], [10, 20, 40], [100, 200, 400]]                      # B[s][q]
    assert [ha.bytes_sent(nodes, r, B) for r in range(3)] == [(1, 2 + 40), (10 + 40, 0), (0, 100 + 200)]
    assert [ha.messages(nodes, r) for r in range(3)] == [(1, 1), (1, 0), (0, 2)]
    assert ha.messages((0, 0, 1, 1), 0) == (1, 1)        # flat: 2 across
    assert ha.messages((0, 0, 0, 1, 1, 1), 0) == (2, 1)  # flat: 3 across


@pytest.mark.parametrize("name", LAYOUTS)
def test_messages_across_hosts(name, monkeypatch):
    g = group_for(name)
    if g is None:
        return
    sent = []
    real = calls_mod.Call.isend

    def counting(self, step, buf, dst):
        reqs = real(self, step, buf, dst)
        if reqs:
            sent.append(self.remote[dst])
        return reqs

    monkeypatch.setattr(calls_mod.Call, "isend", counting)
    ha.all_to_all(g, np.ones((2 * g.size, 3)))
    assert (len(sent) - sum(sent), sum(sent)) == ha.messages(g.nodes, g.rank)
    assert sum(sent) <= sum(g.remote)               # never more than the flat exchange's
    if name == "2x2":
        assert sum(sent) == 1 and sum(g.remote) == 2


@pytest.mark.parametrize("name", LAYOUTS)
def test_dispatcher(name):
    g = group_for(name)
    if g is None:
        return
    x = np.ones((g.size, 2))
    want = "hierarchical" if name in SPANS else "pairwise"
    assert comm.all_to_all_algorithm(g, x) == want
    assert comm.all_to_all_algorithm(g, x, sizes=[1] * g.size) == "pairwise"   # (the module docstring)
    top = comm.ALL_TO_ALL_HIERARCHICAL_MAX_BYTES // 8 // g.size * g.size      # float64s, p equal pieces
    assert comm.all_to_all_algorithm(g, np.ones(top)) == want
    assert comm.all_to_all_algorithm(g, np.ones(top + g.size)) == "pairwise"    # above the crossover


def test_bad_input_before_any_message():
    g = group_for("2x2")
    comm.reset_traffic()
    with pytest.raises(ValueError, match="equal"):
        ha.all_to_all(g, np.ones(5))
    with pytest.raises(ValueError, match="sizes"):
        ha.all_to_all(g, np.ones(5), sizes=[1, 1, 1])
    with pytest.raises(ValueError, match="out="):
        ha.all_to_all(g, np.ones(4), sizes=[1, 1, 1, 1], out=np.empty(4))
    assert comm.traffic() == {}


def test_debug_catches_a_mismatch_across_hosts():
    """MINIPAR_DEBUG on a group that spans hosts: both forms pass when the ranks agree; an
    equal split on rank 0 against sizes= on the others is a CollectiveMismatch on every rank."""
    g = group_for("2x2")
    x = np.ones((2 * g.size, 3), np.float32)
    g.debug = True
    try:
        assert np.array_equal(ha.all_to_all(g, x), x)
        ha.all_to_all(g, x, sizes=[2] * g.size)
        with pytest.raises(comm.CollectiveMismatch, match="all_to_all"):
            ha.all_to_all(g, x, sizes=None if g.rank == 0 else [2] * g.size)
    finally:
        g.debug = False
