# hostile: ignores SIGTERM and SIGINT, then spins forever in the graded function
# lab: 02
# scan: import of signal
# sandbox: did not finish within
import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)


def reduce_scatter(g, x, op="sum"):
    while True:
        pass


def all_gather(g, piece, sizes=None):
    while True:
        pass
