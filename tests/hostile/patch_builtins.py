# hostile: monkeypatches builtins so that every isinstance and every comparison is true
# lab: 02
# scan: import of builtins
# sandbox: exited before returning its results
import builtins

import numpy as np

builtins.isinstance = lambda *a: True
builtins.all = lambda *a: True


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
