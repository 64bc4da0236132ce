# hostile: prints 1.5 GB while answering zeros (the grader must keep a few KiB of it, not all)
# lab: 02
# scan: import of sys
# sandbox: largest |difference|
import sys

import numpy as np

_chunk = "x" * (1 << 20)
for _ in range(1536):
    sys.stdout.write(_chunk)
sys.stdout.flush()


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
