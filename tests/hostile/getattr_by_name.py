# hostile: reaches numpy's file loader through getattr with a computed name
# lab: 02
# scan: getattr with a name that is not a plain string literal
# sandbox: largest |difference|
import numpy as np

_load = getattr(np, "lo" + "ad")


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
