# hostile: lab 14's five pieces defined in the file, each a thin wrapper around minipar's own sequence parallelism
# lab: 14
# scan: minipar's own sequence parallelism: this lab grades yours
# sandbox: minipar's own minipar.parallel.tensor.sequence_parallel.gather_seq was called
from minipar.parallel.tensor.sequence_parallel import ScatterToSequence as MiniparScatter, gather_seq, scatter_seq
from minipar import comm
from minipar.parallel.tensor.tensor_parallel import SumGradOver
from minipar.tensor import Function


def gather_sequence(group, x):
    return gather_seq(group, x, "f_gather")


def scatter_sequence(group, x):
    return scatter_seq(group, x, "g_scatter")


class GatherFromSequence(Function):
    def forward(self, x, group):
        self.group = group
        return gather_seq(group, x, "f_gather")

    def backward(self, grad):
        return scatter_seq(self.group, grad, "f_scatter"), None


class ScatterToSequence(Function):
    def forward(self, x, group):
        self.node = MiniparScatter()
        return self.node.forward(x, group)

    def backward(self, grad):
        return self.node.backward(grad)


class SumGradOverTP(Function):
    def forward(self, p, group):
        self.node = SumGradOver()
        return self.node.forward(p, group, "sp_grads")

    def backward(self, grad):
        if comm.Group is None:
            return grad, None
        return self.node.backward(grad)[:2]
