# hostile: ends its own process with exit code 0 as soon as it is imported, before any result
# lab: 02
# scan: import of os
# sandbox: exited before returning its results
import os

os._exit(0)


def reduce_scatter(g, x, op="sum"):
    return x


def all_gather(g, piece, sizes=None):
    return piece
