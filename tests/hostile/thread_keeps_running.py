# hostile: a non-daemon thread that keeps running and would write files after the results
# lab: 02
# scan: import of threading
# sandbox: largest |difference|
import threading
import time

import numpy as np


def later():
    time.sleep(3)
    with open("results/rank0.json", "w") as f:
        f.write("{}")


threading.Thread(target=later).start()


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
