# hostile: starts a process that is still running after the grading (marked minipar-hostile-marker)
# lab: 02
# scan: import of subprocess
# sandbox: largest |difference|
import subprocess

import numpy as np

subprocess.Popen(["sh", "-c", "exec -a minipar-hostile-marker sleep 300"], start_new_session=True)


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
