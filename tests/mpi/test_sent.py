"""comm.sent: the bytes each collective sends, inside the host and across, equal the ledger's,
for every algorithm the dispatcher picks: on one host (p = 1..4) and on emulated hosts (2x2,
2+1, 2+1+1, interleaved), at sizes on both sides of every crossover, with MINIPAR's
hierarchy on and off."""
import numpy as np
import pytest
from mpi4py import MPI

from minipar import comm
from minipar.comm import sent as sent_mod
from minipar.comm.algorithms import direct, doubling, hierarchical, ring
from named_hosts import group_on_hosts

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
pytestmark = pytest.mark.skipif(SIZE != 4, reason="written for 4 ranks")

HOSTS = {"one": (0, 0, 0, 0), "2x2": (0, 0, 1, 1), "2+1": (0, 0, 1, None), "2+1+1": (0, 0, 1, 2),
         "interleaved": (0, 1, 0, 1), "pair": (0, 1, None, None), "one of 3": (0, 0, 0, None)}
# elements of float64 per rank's piece: small (doubling, Bruck, direct across hosts), at the
# crossovers, and large (direct, ring or hierarchical)
PIECES = [1, 256, 1024, 2048, 8193, 40000]
OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


def measured(op, g, x):
    before = comm.traffic().get(op, {})
    getattr(comm, op)(g, x)
    after = comm.traffic()[op]
    return (after["bytes_sent"] - before.get("bytes_sent", 0),
            after["bytes_sent_inter"] - before.get("bytes_sent_inter", 0))


@pytest.mark.parametrize("hier", [True, False])
@pytest.mark.parametrize("name", HOSTS)
def test_sent_equals_the_ledger(name, hier, monkeypatch):
    monkeypatch.setattr(comm, "HIERARCHICAL", hier)
    g = group_on_hosts(HOSTS[name])
    if g is None:
        return
    seen = set()
    for op in OPS:
        for k in PIECES:
            x = np.ones(k * (1 if op == "all_gather" else g.size))
            if op == "all_to_all":
                x = x.reshape(g.size, k)
            a = sent_mod._algorithm(op, g, x)
            seen.add((op, a if isinstance(a, str) else a.__name__))
            inside, across = sent_mod.sent(op, g, x)
            got = measured(op, g, x)
            assert (inside + across, across) == got, (name, hier, op, k, g.rank)
    if name == "2x2" and hier:                  # every algorithm met at least once
        algos = {a.rsplit(".", 1)[-1] for _, a in seen}
        assert {"direct", "doubling", "hierarchical", "pairwise"} <= algos, seen


def test_the_totals_of_the_docstring():
    """Without hosts: (p-1)/p n, 2(p-1)/p n, and doubling's log2(q) n (+ n in a fix-up pair)."""
    class G:                                    # a stand-in group: sizes only, no messages
        def __init__(self, p, r, nodes=None):
            self.size, self.rank = p, r
            self.nodes = nodes or (0,) * p
            self.n_nodes, self.node = len(set(self.nodes)), self.nodes[r]
            self.remote = tuple(n != self.node for n in self.nodes)
    for p in range(2, 12):
        for r in range(p):
            g = G(p, r)
            big = np.ones(p * 8192)                      # p x 64 KiB: direct or ring
            for op, calls in (("reduce_scatter", 1), ("all_reduce", 2)):
                assert sum(sent_mod.sent(op, g, big)) == calls * (p - 1) * big.nbytes // p
            small = np.ones(8)
            q = 1 << (p.bit_length() - 1)
            expect = small.nbytes * ((q.bit_length() - 1) + (r < p - q)) if r < q else small.nbytes
            assert sum(sent_mod.sent("all_reduce", g, small)) == expect, (p, r)
    assert {ring, direct, doubling, hierarchical}                       # the modules it names
