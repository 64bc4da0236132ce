"""Lab 03 answered by minipar's own code (python -m labs.grade 03 --solution): the ring of
minipar/comm/algorithms/ring.py and the recursive doubling of minipar/comm/algorithms/doubling.py, each a
generator per collective, behind the lab's signatures."""
from minipar.comm.algorithms import doubling, ring


def all_reduce_ring(g, x, op="sum"):
    return ring.all_reduce(g, x, op)


def all_reduce_doubling(g, x, op="sum"):
    return doubling.all_reduce(g, x, op)
