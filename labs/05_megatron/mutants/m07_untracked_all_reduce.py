# criterion: 4L+5 all-reduces per micro-batch
"""Mutant: f and g call comm.all_reduce directly: the values are right, but tensor parallelism's
ledger (tensor_parallel.traffic(), by kind f and g) never sees them, so the trainer's count
against Megatron's 4L + 5 is wrong."""
from minipar import comm, ops
from minipar.parallel.tensor_parallel import tp_all_reduce
from minipar.tensor import Function


class CopyToTP(Function):
    """f: the input is already on every rank, so forward passes it through; each rank's
    columns produce only part of dL/dx, so backward adds the parts up."""

    def forward(self, x, group):
        self.group = group
        return x

    def backward(self, grad):
        whole = comm.all_reduce(self.group, grad)
        return whole, None


class ReduceFromTP(Function):
    """g: each rank holds one term of a sum, forward adds them; the sum is replicated, so
    its gradient already is too, and backward passes it through."""

    def forward(self, x, group):
        return comm.all_reduce(group, x)

    def backward(self, grad):
        return grad, None


def f(x, group):
    return CopyToTP.apply(x, group)


def g(x, group):
    return ReduceFromTP.apply(x, group)


class ColumnParallelLinear:
    def __init__(self, weight, bias, group):
        self.weight = weight          # (Cin, Cout/tp)
        self.bias = bias              # (Cout/tp,)
        self.group = group

    def __call__(self, x):            # (B, t, Cin) -> (B, t, Cout/tp)
        x = f(x, self.group)          # so that backward sums dL/dx over the ranks
        return ops.linear(x, self.weight, self.bias)


class RowParallelLinear:
    def __init__(self, weight, bias, group):
        self.weight = weight          # (Cin/tp, Cout)
        self.bias = bias              # (Cout,), the same on every rank
        self.group = group

    def __call__(self, x):            # (B, t, Cin/tp) -> (B, t, Cout)
        partial = ops.linear(x, self.weight)          # no bias yet: it would be summed tp times
        return g(partial, self.group) + self.bias
