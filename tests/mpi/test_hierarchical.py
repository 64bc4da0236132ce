"""Hierarchical collectives (minipar/comm/algorithms/hierarchical.py) on groups that span hosts.

The 4 ranks of this job share one machine, so each test gives its ranks host names of its
own (Group(comm, host=...)): 2 hosts x 2 ranks, 2 + 1 (a sub-group of 3), 2 + 1 + 1, and hosts
interleaved (0 1 0 1). Checked: results equal NumPy on the gathered inputs, bit for bit on
every rank; the ledger's inter-host and intra-host bytes equal the formulas of the
module docstring exactly; the dispatcher picks the hierarchy only when a group spans hosts;
the flat ring's boundary ranks send 2(p-1)/p * n across. (tests/test_cluster.py runs them
across real network namespaces.)
"""
import numpy as np
import pytest
from mpi4py import MPI

from minipar import comm
from named_hosts import group_on_hosts
from minipar.comm.algorithms import hierarchical, ring
from minipar.comm.helpers import split_offsets

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
pytestmark = pytest.mark.skipif(SIZE != 4, reason="written for 4 ranks")

# hosts of world ranks 0..3; None: the rank sits this layout out (a sub-group of 3)
LAYOUTS = {"2x2": (0, 0, 1, 1), "2+1": (0, 0, 1, None), "2+1+1": (0, 0, 1, 2), "interleaved": (0, 1, 0, 1)}


def group_for(name):
    return group_on_hosts(LAYOUTS[name])


def inputs(g, n, dtype):
    x = (np.random.default_rng(100 * RANK + n).integers(-1000, 1000, n)).astype(dtype)
    return x, g.comm.allgather(x)


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("n", [0, 1, 3, 17, 4000])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64])
def test_equal_numpy(name, n, dtype):
    g = group_for(name)
    if g is None:
        return
    x, xs = inputs(g, n, dtype)
    total = np.sum(xs, axis=0).astype(dtype) if n else np.zeros(0, dtype)
    off = split_offsets(n, g.size)
    y = hierarchical.all_reduce(g, x)
    assert y.dtype == x.dtype and np.array_equal(y, total), (name, n)
    assert np.array_equal(hierarchical.reduce_scatter(g, x), total[off[g.rank]:off[g.rank + 1]])
    assert np.array_equal(hierarchical.all_gather(g, x), np.concatenate(xs))
    inplace = x.copy()
    hierarchical.all_reduce(g, inplace, out=inplace)
    assert np.array_equal(inplace, total)
    h = comm.all_reduce_async(g, x.copy()) if n else None
    if h is not None:
        assert np.array_equal(h.wait(), total)
    everyone = g.comm.allgather(y.tobytes())
    assert len(set(everyone)) == 1, "ranks disagree on the bits"


def test_uneven_sizes_all_gather():
    g = group_for("2+1+1")
    sizes = [3, 0, 5, 2]
    x = np.full(sizes[g.rank], float(g.rank))
    out = hierarchical.all_gather(g, x, sizes=sizes)
    assert np.array_equal(out, np.concatenate([np.full(s, float(q)) for q, s in enumerate(sizes)]))


def inter_intra(call, g, x):
    comm.reset_traffic()
    call(g, x)
    t = comm.traffic_by_axis()[None]
    return t["bytes_sent_inter"], t["bytes_sent"] - t["bytes_sent_inter"]


def test_bytes_equal_the_formulas():
    """2 hosts x 2 ranks, n divisible by p: per rank, inside a host (k-1)/k n per half and
    across hosts (N-1)/N n/k per half, as the module's table says."""
    g = group_for("2x2")
    N = k = 2
    n = 8 * 4096                                               # bytes of x: 4096 float64
    x = np.arange(n // 8, dtype=np.float64)
    assert inter_intra(hierarchical.all_reduce, g, x) == (2 * (N - 1) / N * n / k, 2 * (k - 1) / k * n)
    assert inter_intra(hierarchical.reduce_scatter, g, x) == ((N - 1) / N * n / k, (k - 1) / k * n)
    # all-gather: n is the result's bytes, p pieces of n/p
    piece = np.arange(n // 8 // 4, dtype=np.float64)
    assert inter_intra(hierarchical.all_gather, g, piece) == ((N - 1) / N * n / k, (k - 1) / k * n)
    # the flat ring: only the ranks at a host's boundary (1 -> 2 and 3 -> 0) cross, 2(p-1)/p n
    inter, intra = inter_intra(ring.all_reduce, g, x)
    p = 4
    assert (inter, intra) == ((2 * (p - 1) / p * n, 0) if RANK in (1, 3) else (0, 2 * (p - 1) / p * n))
    # the link carries 1.5x fewer bytes: summed over the ranks
    flat = WORLD.allreduce(inter)
    hier = WORLD.allreduce(inter_intra(hierarchical.all_reduce, g, x)[0])
    assert flat == 1.5 * hier


def test_topology_and_dispatch():
    g = group_for("interleaved")
    assert g.nodes == (0, 1, 0, 1) and g.n_nodes == 2 and g.hosts == ("host0", "host1")
    assert g.local_ranks == ((0, 2) if RANK % 2 == 0 else (1, 3)) and g.local_rank == RANK // 2
    big, small = np.zeros(1 << 16), np.zeros(16)
    assert comm.all_reduce_algorithm(g, big) is hierarchical
    assert comm.all_reduce_algorithm(g, small) is not hierarchical
    assert comm.reduce_scatter_algorithm(g, big) is hierarchical
    assert comm.all_gather_algorithm(g, big, None) is hierarchical
    one_host = comm.Group(WORLD, host="same")
    assert one_host.n_nodes == 1 and comm.all_reduce_algorithm(one_host, big) is not hierarchical
    every_rank_alone = comm.Group(WORLD, host=f"h{RANK}")      # nothing to gather inside a host
    assert every_rank_alone.n_nodes == 4 and comm.all_reduce_algorithm(every_rank_alone, big) \
        is not hierarchical
    # through the public API, the ledger's algorithm is hierarchical and the result exact
    x = np.full(1 << 16, float(RANK))
    assert np.array_equal(comm.all_reduce(g, x), np.full(1 << 16, 6.0))


def test_axis_views_share_the_topology():
    g = group_for("2x2")
    z = g.with_axis("zero")
    assert z.nodes == g.nodes and z.local_rank == g.local_rank
    comm.reset_traffic()
    hierarchical.reduce_scatter(z, np.ones(4096))
    assert comm.traffic_by_axis()["zero"]["bytes_sent_inter"] == 4096 * 8 / 4
