# hostile: leaves a detached process that rewrites the --json report after the grader has exited
# lab: 02
# scan: import of os
# sandbox: largest |difference|
import os
import time

import numpy as np

REPORT = "@REPORT@"
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(4)
        try:
            with open(REPORT, "w") as f:
                f.write('{"passed": 99, "total": 6, "criteria": []}')
        finally:
            os._exit(0)
    os._exit(0)


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
