"""Lab 17: activation recomputation (checkpointing), a block's forward run again in backward.

Write the three pieces below (labs/17_recompute/README.md has the picture and the hints).
Checkpoint is an autograd Function of minipar.tensor: forward gets NumPy arrays (and any
other argument as it was given), backward gets the gradient of the output and returns one
gradient per forward argument (None for one that is not an array):

    class Twice(Function):
        def forward(self, x, k):
            self.k = k                      # anything backward needs, on self
            return 2 * x
        def backward(self, grad):
            return 2 * grad, None           # dL/dx, and nothing for k
    y = Twice.apply(x_tensor, 3)            # a Tensor, recorded in the graph

What you may use of minipar's autograd (minipar/autograd/tensor.py): Tensor(array,
requires_grad=...), t.data, t.grad, t.requires_grad, t.backward(grad); Function and its
apply; self.saved, the tuple of arrays a node keeps for backward (what Tensor.saved_bytes()
counts; set it yourself: Function.save's name is refused by the scan); no_grad() and
enable_grad() (with-blocks that stop and restart the recording of a graph) and
is_grad_enabled(). Nothing of minipar/autograd/recompute.py: this lab grades yours.

Check:  make lab L=17        (or: .venv/bin/python -m labs.grade 17 --student this_file.py)
"""
from minipar.tensor import Function, Tensor, enable_grad, is_grad_enabled, no_grad  # noqa: F401


class Checkpoint(Function):
    """One node of the graph standing for a whole block y = run(x). Use:
    Checkpoint.apply(x_tensor, run)."""

    def forward(self, x, run):
        """x: the block's input array; run: the block, a function Tensor -> Tensor.
        Runs the block with no graph recorded (nothing inside it is saved), keeps x itself
        (self.saved = (x,): not a copy) and run for backward, and returns the output array
        run(Tensor(x)).data. Never modify x."""
        raise NotImplementedError("lab 17: Checkpoint.forward, see labs/17_recompute/README.md")

    def backward(self, grad):
        """grad: dL/dy. Runs the block again on the kept x, this time recording its graph,
        back-propagates grad through it (the block's parameters get their gradients added
        into .grad there, exactly once), and returns (dL/dx, None). Never modify x or
        grad."""
        raise NotImplementedError("lab 17: Checkpoint.backward, see labs/17_recompute/README.md")


def checkpoint(run, x):
    """y = run(x) for a Tensor x, checkpointed: a Tensor equal to run(x) whose graph keeps only
    x, the block recomputed in backward. When no graph is being recorded (inside no_grad())
    or x does not require a gradient (data), returns run(x) itself: the block's own graph
    then still reaches its parameters. The trainer's --recompute full calls it for every
    transformer block, --recompute selective for every attention core."""
    raise NotImplementedError("lab 17: checkpoint, see labs/17_recompute/README.md")
