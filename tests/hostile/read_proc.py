# hostile: reads /proc for the grader's environment and command line, looking for answers
# lab: 02
# scan: open: opens files
# sandbox: largest |difference|
import os

import numpy as np

LOOT = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        for name in ("environ", "cmdline"):
            try:
                with open(f"/proc/{pid}/{name}", "rb") as f:
                    LOOT.append(f.read())
            except OSError:
                pass


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
