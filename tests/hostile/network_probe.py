# hostile: connects to a server on the grader machine's loopback (the test's own, port @PORT@)
# lab: 02
# scan: import of socket
# sandbox: largest |difference|
import socket

import numpy as np

try:
    with socket.create_connection(("127.0.0.1", int("@PORT@")), timeout=2) as s:
        s.sendall(b"minipar-hostile-marker")
except OSError:
    pass


def reduce_scatter(g, x, op="sum"):
    n = x.size // g.size + (g.rank < x.size % g.size)
    return np.zeros(n, dtype=x.dtype)


def all_gather(g, piece, sizes=None):
    return np.zeros(piece.size * g.size, dtype=piece.dtype)
