"""Lab 17 solved by hand: the checkpointed block (labs/17_recompute/README.md)."""
from minipar.tensor import Function, Tensor, enable_grad, is_grad_enabled, no_grad


class Checkpoint(Function):
    """y = run(x), keeping x only; the block runs again in backward."""

    def forward(self, x, run):
        self.run = run
        with no_grad():                         # nothing inside the block is recorded or saved
            y = run(Tensor(x))
        self.saved = (x,)                       # the input itself, counted by saved_bytes
        return y.data

    def backward(self, grad):
        (x,) = self.saved
        leaf = Tensor(x, requires_grad=True)    # a fresh start for the block's graph
        with enable_grad():
            y = self.run(leaf)                  # the forward again, recorded this time
        y.backward(grad)                        # the parameters' .grad += ..., once
        return leaf.grad, None


def checkpoint(run, x):
    if not is_grad_enabled() or not x.requires_grad:
        return run(x)                           # no node to stand for the block: run it plainly
    return Checkpoint.apply(x, run)
