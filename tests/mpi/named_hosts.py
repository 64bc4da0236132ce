"""Groups whose ranks get host names of their own, for the hierarchical collectives' tests
(tests/mpi/test_hierarchical*.py): the 4 ranks share one machine, so each layout names them."""
from mpi4py import MPI

from minipar import comm

WORLD = MPI.COMM_WORLD


def group_on_hosts(hosts):
    """hosts[w]: the host number of world rank w, or None to sit this group out (a sub-group
    of fewer ranks). -> the Group, or None on a rank left out (collective over the world)."""
    rank = WORLD.Get_rank()
    sub = WORLD.Split(0 if hosts[rank] is not None else MPI.UNDEFINED, rank)
    if sub == MPI.COMM_NULL:
        return None
    return comm.Group(sub, host=f"host{hosts[rank]}")
