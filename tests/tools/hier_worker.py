"""mpirun -n P python tests/tools/hier_worker.py N: the hierarchical collectives (all-to-all too) on this job's
hosts (whatever they are), each checked against NumPy on every rank's input, which each rank
makes again from its seed (so that nothing but the collectives crosses the link); rank 0 prints one JSON line, a list with each rank's host, the
group's topology, the bytes it sent to other hosts (the ledger) and "ok" (one line from one
rank: Hydra may splice lines of different ranks). Used by tests/test_cluster_minipar.py."""
import json
import sys

import numpy as np
from mpi4py import MPI

from minipar import comm
from minipar.comm.algorithms import hierarchical, hierarchical_alltoall
from minipar.comm.helpers import split_offsets

world = MPI.COMM_WORLD
g = comm.Group(world, axis="world")
n = int(sys.argv[1])
xs = [np.random.default_rng(q).integers(-1000, 1000, n).astype(np.float64) for q in range(g.size)]
x = xs[g.rank]
total = np.sum(xs, axis=0)
off = split_offsets(n, g.size)
comm.reset_traffic()
assert np.array_equal(hierarchical.all_reduce(g, x), total), "all_reduce"
assert np.array_equal(hierarchical.reduce_scatter(g, x), total[off[g.rank]:off[g.rank + 1]]), "reduce_scatter"
assert np.array_equal(hierarchical.all_gather(g, x), np.concatenate(xs)), "all_gather"
L = max(n // g.size, 3) * g.size               # the all-to-all: p equal pieces, then p sizes
zs = [np.random.default_rng(100 + q).integers(-1000, 1000, L).astype(np.float64) for q in range(g.size)]
mine = np.concatenate([z.reshape(g.size, -1)[g.rank] for z in zs])
assert np.array_equal(hierarchical_alltoall.all_to_all(g, zs[g.rank]), mine), "all_to_all"
counts = [[(q + j) % 3 for j in range(g.size)] for q in range(g.size)]   # zeros among them
starts = [np.cumsum([0] + c) for c in counts]
mine = np.concatenate([zs[q][starts[q][g.rank]:starts[q][g.rank + 1]] for q in range(g.size)])
assert np.array_equal(hierarchical_alltoall.all_to_all(g, zs[g.rank][:sum(counts[g.rank])], counts[g.rank]),
                      mine), "all_to_all, sizes"
assert comm.all_reduce_algorithm(g, x) is (hierarchical if 1 < g.n_nodes < g.size and x.nbytes > 65536
                                            else comm.all_reduce_algorithm(g, x))
led = comm.traffic_by_axis()["world"]
rows = world.gather({"rank": g.rank, "host": g.host, "nodes": list(g.nodes), "hosts": list(g.hosts),
                     "sent": led["bytes_sent"], "sent_inter": led["bytes_sent_inter"], "ok": True}, root=0)
if g.rank == 0:
    print("RESULT " + json.dumps(rows), flush=True)
