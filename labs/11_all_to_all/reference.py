"""Lab 11 answered by minipar's own code (python -m labs.grade 11 --solution): the pairwise
exchange of minipar/comm/algorithms/alltoall.py behind the lab's signature."""
from minipar.comm.algorithms import alltoall


def all_to_all(g, x, sizes=None):
    return alltoall.pairwise(g, x, sizes, return_sizes=True)
