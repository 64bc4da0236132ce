# hostile: calls minipar's own dispatcher comm.reduce_scatter from its own functions
# lab: 02
# scan: minipar's own collective
# sandbox: minipar's own minipar.comm.reduce_scatter was called
from minipar import comm


def reduce_scatter(g, x, op="sum"):
    return comm.reduce_scatter(g, x, op)


def all_gather(g, piece, sizes=None):
    return comm.all_gather(g, piece, sizes)
