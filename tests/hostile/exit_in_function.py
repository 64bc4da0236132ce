# hostile: exits with code 0 from inside the graded function, so the criterion "finishes cleanly"
# lab: 02
# scan: import of os
# sandbox: exited before returning its results
import os


def reduce_scatter(g, x, op="sum"):
    os._exit(0)


def all_gather(g, piece, sizes=None):
    os._exit(0)
