"""Lab 05: Megatron's f and g, and the column- and row-parallel linear layers built from them.

Write the four pieces below (labs/05_megatron/README.md has the picture and the hints). f and
g are autograd Functions of minipar.tensor: forward gets NumPy arrays, backward gets the
gradient of the output and returns one gradient per forward argument (None for the group):

    class Twice(Function):
        def forward(self, x, k):
            self.k = k                      # anything backward needs, on self
            return 2 * x
        def backward(self, grad):
            return 2 * grad, None           # dL/dx, and nothing for k
    y = Twice.apply(x_tensor, 3)            # a Tensor, recorded in the graph

The one all-reduce you may call is minipar's, through tensor parallelism's ledger:

    tp_all_reduce(group, array, "sum", "f")     # in f's backward
    tp_all_reduce(group, array, "sum", "g")     # in g's forward

It sums the array over the tp ranks of `group` (every rank gets the same result, in the
array's dtype: a new array, or the array itself in a group of one rank, which sends nothing)
and counts the call under its kind in tensor_parallel.traffic(), which the grader and the
trainer's summary hold against Megatron's 4L + 5 all-reduces per micro-batch. No MPI
collective, and no other all-reduce (the scan refuses comm.all_reduce).

Every array keeps its dtype: float64, float32, or float16 (--precision fp16's buffers).
The layers get tensors that already hold this rank's shard (TensorParallelGPT cuts them).
ops.linear(x, w, b) is y = x @ w + b with its backward, for x of any shape (..., Cin);
ops.linear(x, w) has no bias.

Check:  make lab L=05        (or: .venv/bin/python -m labs.grade 05 --student this_file.py)
"""
from dataclasses import dataclass

from minipar import comm, ops  # noqa: F401 - ops: you will want it
from minipar.parallel.tensor.tensor_parallel import tp_all_reduce  # noqa: F401 - the only all-reduce
from minipar.tensor import Function, Tensor


class CopyToTP(Function):
    """Megatron's f, in front of a column-parallel layer: identity forward, all-reduce (sum)
    of the gradient backward. Use: y = CopyToTP.apply(x, group)."""

    def forward(self, x, group):
        """x: this rank's (replicated) input array, any shape. Returns x unchanged (x itself
        will do), without communicating; keep group for backward. Never modify x."""
        raise NotImplementedError("lab 05: f's forward (identity), see labs/05_megatron/README.md")

    def backward(self, grad):
        """grad: dL/dy on this rank, a partial gradient (each rank's columns saw only their
        share of the loss). Returns (the sum of grad over the tp ranks, None), in grad's
        dtype: one all-reduce, tp_all_reduce(group, grad, "sum", "f"). Never modify grad."""
        raise NotImplementedError("lab 05: f's backward (all-reduce), see labs/05_megatron/README.md")


class ReduceFromTP(Function):
    """Megatron's g, after a row-parallel layer: all-reduce (sum) forward, identity backward.
    Use: y = ReduceFromTP.apply(x, group)."""

    def forward(self, x, group):
        """x: this rank's partial sum, any shape. Returns the sum of x over the tp ranks (the
        same on every rank), in x's dtype: one all-reduce, tp_all_reduce(group, x, "sum", "g").
        Never modify x."""
        raise NotImplementedError("lab 05: g's forward (all-reduce), see labs/05_megatron/README.md")

    def backward(self, grad):
        """grad: dL/dy, the same on every tp rank (y is replicated). Returns (grad, None),
        without communicating."""
        raise NotImplementedError("lab 05: g's backward (identity), see labs/05_megatron/README.md")


@dataclass
class ColumnParallelLinear:
    """y_local = f(x) @ weight + bias: the columns of Y = X W + b that this rank owns.

    Built as ColumnParallelLinear(weight, bias, group), as TensorParallelGPT does."""
    weight: Tensor        # (Cin, Cout/tp): this rank's columns of W
    bias: Tensor          # (Cout/tp,): the same columns of b
    group: comm.Group     # the tp group

    def __call__(self, x):
        """x: Tensor (..., Cin), the same on every tp rank: (B, t, Cin) in the model, (N, Cin)
        too. Returns a Tensor (..., Cout/tp), this rank's columns of x @ W + b. No
        communication forward; in backward the gradient of x must be the whole dL/dx (the sum
        over ranks: that is f's job), and the weight's and bias's gradients this rank's
        columns of the full ones. Never modify x, the weight or the bias."""
        raise NotImplementedError("lab 05: column-parallel linear from f, see labs/05_megatron/README.md")


@dataclass
class RowParallelLinear:
    """y = g(x_local @ weight) + bias: every rank adds its rows' share, then the bias once.

    Built as RowParallelLinear(weight, bias, group), as TensorParallelGPT does."""
    weight: Tensor        # (Cin/tp, Cout): this rank's rows of W
    bias: Tensor          # (Cout,): the whole bias, replicated on every tp rank
    group: comm.Group     # the tp group

    def __call__(self, x):
        """x: Tensor (..., Cin/tp), this rank's columns of the input (a column-parallel
        layer's output): (B, t, Cin/tp) in the model, (N, Cin/tp) too. Returns a Tensor
        (..., Cout), X @ W + b, the same on every tp rank (tp = 1 included): one all-reduce
        forward (g), none backward. The bias's gradient is the whole dL/db on every rank; the
        weight's is this rank's rows of dL/dW; x's this rank's columns. Never modify x, the
        weight or the bias."""
        raise NotImplementedError("lab 05: row-parallel linear from g, see labs/05_megatron/README.md")
