# hostile: wraps minipar's own ring in functions of its own file (passes the "defined here" check)
# lab: 02
# scan: minipar.comm.ring is not part of this lab's API
# sandbox: minipar's own minipar.comm.algorithms.ring.reduce_scatter was called
from minipar.comm import ring


def reduce_scatter(g, x, op="sum"):
    return ring.reduce_scatter(g, x, op)


def all_gather(g, piece, sizes=None):
    return ring.all_gather(g, piece, sizes)
