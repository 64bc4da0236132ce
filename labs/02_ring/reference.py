"""Lab 02 answered by minipar's own code (python -m labs.grade 02 --solution): the ring of
minipar/comm/algorithms/ring.py, a generator per collective, behind the lab's signatures."""
from minipar.comm.algorithms import ring


def reduce_scatter(g, x, op="sum"):
    return ring.reduce_scatter(g, x, op)


def all_gather(g, piece, sizes=None):
    return ring.all_gather(g, piece, sizes)
