"""Lab 05, solved by hand as a student would: f and g as two Functions, each one line of
communication, and the two layers as plain classes that call them through f() and g()
(minipar's own, in minipar/parallel/tensor/tensor_parallel.py, is the same maths)."""
from minipar import ops
from minipar.parallel.tensor.tensor_parallel import tp_all_reduce
from minipar.tensor import Function


class CopyToTP(Function):
    """f: the input is already on every rank, so forward passes it through; each rank's
    columns produce only part of dL/dx, so backward adds the parts up."""

    def forward(self, x, group):
        self.group = group
        return x

    def backward(self, grad):
        whole = tp_all_reduce(self.group, grad, "sum", "f")
        return whole, None


class ReduceFromTP(Function):
    """g: each rank holds one term of a sum, forward adds them; the sum is replicated, so
    its gradient already is too, and backward passes it through."""

    def forward(self, x, group):
        return tp_all_reduce(group, x, "sum", "g")

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
