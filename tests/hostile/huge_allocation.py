# hostile: asks for 800 GB of memory
# lab: 02
# scan: passes
# sandbox: MemoryError
import numpy as np


def reduce_scatter(g, x, op="sum"):
    big = np.ones(100_000_000_000)
    return big[:1]


def all_gather(g, piece, sizes=None):
    return piece
