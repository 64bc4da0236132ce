# hostile: rewrites the grader's own helpers in sys.modules so every comparison says "equal"
# lab: 02
# scan: import of sys
# sandbox: largest |difference|
import sys

import numpy as np

for name, module in list(sys.modules.items()):
    if name.startswith("labs"):
        for attr in ("first_difference", "expect"):
            if hasattr(module, attr):
                setattr(module, attr, (lambda *a, **k: None))


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
