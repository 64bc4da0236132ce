"""Lab 17 answered by minipar's own code (python -m labs.grade 17 --solution): the Recompute
Function of minipar/autograd/recompute.py behind the lab's signatures."""
from minipar.autograd.recompute import Recompute as Checkpoint
from minipar.autograd.tensor import is_grad_enabled


def checkpoint(run, x):
    """recompute.block(run, x, "full"), written out: the seam puts its own function in
    recompute.block's place."""
    if not is_grad_enabled() or not x.requires_grad:
        return run(x)
    return Checkpoint.apply(x, run)
