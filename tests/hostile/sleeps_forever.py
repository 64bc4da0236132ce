# hostile: sleeps in the graded function (the later criteria that use it are then not run)
# lab: 02
# scan: passes
# sandbox: did not finish within
import time


def reduce_scatter(g, x, op="sum"):
    time.sleep(10_000)


def all_gather(g, piece, sizes=None):
    time.sleep(10_000)
