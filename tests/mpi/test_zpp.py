"""ZeRO++'s messages on emulated hosts (zero/zpp.py): qgZ's two quantized all-to-alls give each
rank the sum of its piece within the bound of the codes they carried (every rank's piece, then
every host's partial sum, each within half its block's scale), and send what comm.sent says,
inside the host and across; qwZ's all-gather gives every rank the same decoded weights, each
within half its block's scale of the shard it came from."""
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from minipar import comm
from minipar.comm.sent import sent
from minipar.parallel.zero import quantize, zpp
from named_hosts import group_on_hosts

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
pytestmark = pytest.mark.skipif(SIZE != 4, reason="written for 4 ranks")
HOSTS = {"one host": (0, 0, 0, 0), "2x2": (0, 0, 1, 1), "4 hosts": (0, 1, 2, 3), "pair": (0, 0, None, None)}


def unit_on(g, shard):
    local, cross = zpp.host_groups(g)
    return SimpleNamespace(group=g, local=local, cross=cross, shard_size=shard)


@pytest.mark.parametrize("name", HOSTS)
@pytest.mark.parametrize("shard,B", [(1000, 256), (37, 8), (4096, 4096)])
def test_qgz_sums_each_piece_within_the_codes_bound(name, shard, B):
    g = group_on_hosts(HOSTS[name])
    if g is None:
        return
    u = unit_on(g, shard)
    rng = np.random.default_rng(RANK)
    x = rng.standard_normal(g.size * shard) * np.repeat(10.0 ** rng.integers(-3, 3, g.size), shard)
    xs = g.comm.allgather(x)
    before = comm.traffic()
    piece = zpp.Wire(qgz=B).reduce_scatter(u, x).wait()
    after = comm.traffic()["all_to_all"]
    mine = slice(g.rank * shard, (g.rank + 1) * shard)
    exact = np.sum([y[mine] for y in xs], axis=0)
    H, k = g.n_nodes, u.local.size
    hosts = [[q for q in range(g.size) if g.nodes[q] == h] for h in range(H)]
    first = sum(quantize.bound(y[mine], B) for y in xs)                 # every rank's piece, coded once
    partial = [np.sum([xs[q][mine] for q in members], axis=0) for members in hosts]
    second = sum(quantize.bound(p, B) for p in partial) if H > 1 else 0     # every host's partial sum, coded again
    slack = first + second + 1e-9 * np.abs(exact).max()
    assert (np.abs(piece - exact) <= slack * (1 + 1e-6)).all(), (name, float(np.abs(piece - exact).max()))
    w = quantize.wire_bytes(shard, B)
    inside = sent("all_to_all", u.local, np.zeros((k, H * w), np.uint8))
    across = sent("all_to_all", u.cross, np.zeros((H, w), np.uint8)) if u.cross is not None else (0, 0)
    got = (after["bytes_sent"] - before.get("all_to_all", {}).get("bytes_sent", 0),
           after["bytes_sent_inter"] - before.get("all_to_all", {}).get("bytes_sent_inter", 0))
    assert got == (sum(inside) + sum(across), inside[1] + across[1]) == \
        ((k - 1) * H * w + (H - 1) * w, (H - 1) * w), (name, got)
    assert got[0] < (g.size - 1) * shard * 8, "qgZ sent no fewer bytes than the float64 reduce-scatter"


@pytest.mark.parametrize("name", ["one host", "2x2"])
def test_qwz_gives_every_rank_the_same_weights_within_the_bound(name):
    g = group_on_hosts(HOSTS[name])
    shard, B = 777, 64
    shards = [np.random.default_rng(r).standard_normal(shard) for r in range(g.size)]
    u = SimpleNamespace(group=g, param_shard=shards[g.rank], shard_size=shard, wire_recv=None, secondary=None,
                        param_gathered=np.empty(g.size * shard))
    wire = zpp.Wire(qwz=B)
    wire.start_gather(u, again=False).wait()
    wire.landed(u)
    for r, s in enumerate(shards):
        got = u.param_gathered[r * shard:(r + 1) * shard]
        assert (np.abs(got - s) <= quantize.bound(s, B) * (1 + 1e-12)).all()
        assert not np.array_equal(got, s), "nothing was quantized"
    digests = g.comm.allgather(u.param_gathered.tobytes())
    assert len(set(digests)) == 1, "ranks compute with different weights (a rank kept its exact shard)"
