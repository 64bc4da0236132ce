# hostile: makes NumPy's comparisons always true, then answers zeros
# lab: 02
# scan: changes numpy.isclose
# sandbox: largest |difference|
import numpy as np

np.isclose = lambda *a, **k: np.ones(np.broadcast(*a[:2]).shape, dtype=bool)
np.array_equal = lambda *a, **k: True
np.allclose = lambda *a, **k: True


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
