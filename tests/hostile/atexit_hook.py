# hostile: an exit hook that would overwrite the results with its own after the child is done
# lab: 02
# scan: import of atexit
# sandbox: largest |difference|
import atexit
import glob
import json

import numpy as np


def forge():
    for path in glob.glob("results/rank*.json"):
        with open(path, "w") as f:
            json.dump({"values": {}}, f)


atexit.register(forge)


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
