# hostile: lab 17's checkpoint defined in the file, handing every block to minipar's own Recompute
# lab: 17
# scan: minipar's own recomputation: this lab grades yours
# sandbox: minipar's own minipar.autograd.recompute.Recompute.forward was called
from minipar.autograd import recompute
from minipar.tensor import Function, is_grad_enabled


class Checkpoint(Function):
    def forward(self, x, run):
        return recompute.Recompute.forward(self, x, run)

    def backward(self, grad):
        return recompute.Recompute.backward(self, grad)


def checkpoint(run, x):
    if not is_grad_enabled() or not x.requires_grad:
        return run(x)
    return Checkpoint.apply(x, run)
