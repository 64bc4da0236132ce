# hostile: reads an object's insides through a str.format field
# lab: 02
# scan: reaches into attributes
# sandbox: largest |difference|
import numpy as np

_leak = "{0.__class__.__mro__}".format(np.zeros(1))


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
