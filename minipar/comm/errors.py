"""What goes wrong in minipar.comm, and how the job ends when it does.

The errors its calls raise (CommTimeout: no progress for MINIPAR_COMM_TIMEOUT seconds, from
the wait in calls.py; CollectiveMismatch: MINIPAR_DEBUG's check, group.py), and the end of
the whole job when one of them, or any other exception, is not caught on some rank: the
other ranks would otherwise wait for the dead one until their own timeout.
"""
import os
import sys
import time
import traceback

from mpi4py import MPI


class CommError(RuntimeError):
    """A collective or point-to-point call failed."""


class CommTimeout(CommError, TimeoutError):
    """No progress for MINIPAR_COMM_TIMEOUT seconds."""


class CollectiveMismatch(CommError):
    """MINIPAR_DEBUG: ranks of a group called different collectives (or shapes, dtypes...)."""


_HOOK_INSTALLED = False


def abort_on_error():
    """Make an uncaught exception on any rank print its traceback and end the whole job.

    Without this, the other ranks would wait for the dead one (until their timeout).
    Installed by the first Group created in a world of more than one process.
    """
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    _HOOK_INSTALLED = True
    previous = sys.excepthook

    def hook(kind, value, tb):
        if MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
            return previous(kind, value, tb)
        text = "".join(traceback.format_exception(kind, value, tb))
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        sys.stderr.write(f"[rank {rank}] aborting the job (uncaught exception)\n")
        abort_world(1)

    sys.excepthook = hook


# How long an aborting rank lets the launcher forward what it has just printed: MPICH's
# hydra tears the job down as soon as it handles the abort, and may do so before it has
# read the rank's last lines from their pipe (seen: an empty stderr, 1 run in 12 on 2 busy
# cores, when two ranks abort at once).
ABORT_GRACE_S = 0.3


def abort_world(code: int):
    """End every rank of the job with exit code `code`, after flushing this rank's output
    and giving the launcher ABORT_GRACE_S to forward it. Never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)             # Abort can return when another rank's abort is already ending the job
