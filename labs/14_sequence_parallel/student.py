"""Lab 14: sequence parallelism (Korthikanti et al. 2022): the sequence gather and scatter, the
f and g they make, and the gradient sum of the replicated norm parameters.

Write the five pieces below (labs/14_sequence_parallel/README.md has the picture and the
hints). Activations are batch-first, (B, t, ...): the sequence is axis 1, not axis 0. On a
tp group of p ranks, rank r holds tokens [r t/p, (r+1) t/p) of every sequence.

You communicate with three of minipar's collectives over `group` (given: this lab is about
which axis and which direction, not about the ring; lab 02 is):

    whole = comm.all_gather(group, piece)   # every rank's piece.ravel(), in rank order, 1-D
    mine = comm.reduce_scatter(group, x)    # piece r (of p equal ones) of the sum of every
                                            # rank's x.ravel(), 1-D: x.size divisible by p
    total = comm.all_reduce(group, x)       # the sum of every rank's x, x's shape, a new array

Each keeps the array's dtype; on a group of one rank each sends nothing. Pass them
contiguous arrays (np.ascontiguousarray). No MPI, and none of minipar's own sequence
parallelism (minipar/parallel/tensor/sequence_parallel.py): the scan refuses it.

The Functions are autograd nodes of minipar.tensor: forward gets NumPy arrays (the group as
it was passed), backward gets the gradient of the output and returns one gradient per
forward argument (None for the group):

    class Twice(Function):
        def forward(self, x, k):
            self.k = k                      # anything backward needs, on self
            return 2 * x
        def backward(self, grad):
            return 2 * grad, None           # dL/dx, and nothing for k
    y = Twice.apply(x_tensor, 3)            # a Tensor, recorded in the graph

Check:  make lab L=14        (or: .venv/bin/python -m labs.grade 14 --student this_file.py)
"""
import numpy as np  # noqa: F401 - you will want it

from minipar import comm  # noqa: F401 - all_gather, reduce_scatter, all_reduce
from minipar.tensor import Function


def gather_sequence(group, x):
    """x: this rank's tokens, (B, t/p, ...) (any trailing dimensions, B may be 0). Returns the
    whole sequences, (B, t, ...): rank s's tokens at [s t/p, (s+1) t/p) of axis 1, for every
    rank s of `group` in rank order, and every batch row b. x's dtype; one comm.all_gather
    of x's elements (nothing else sent); x is never modified. p = 1: x itself or a copy."""
    raise NotImplementedError("lab 14: the all-gather along the sequence, see labs/14_sequence_parallel/README.md")


def scatter_sequence(group, x):
    """x: this rank's partial sum of whole sequences, (B, t, ...), t divisible by p. Returns
    this rank's tokens of the SUM over the group's ranks (not the mean), (B, t/p, ...): rank
    r gets tokens [r t/p, (r+1) t/p) of axis 1 of every batch row. x's dtype; one
    comm.reduce_scatter of x's elements (each rank sends (p-1)/p of them); x is never
    modified. p = 1: x itself or a copy."""
    raise NotImplementedError("lab 14: the reduce-scatter along the sequence, see labs/14_sequence_parallel/README.md")


class GatherFromSequence(Function):
    """Sequence parallelism's g (Megatron's f, before a column-parallel linear): all-gather
    along the sequence in forward, reduce-scatter of the gradient in backward.
    Use: y = GatherFromSequence.apply(x, group)."""

    def forward(self, x, group):
        """x (B, t/p, ...) -> (B, t, ...), gather_sequence's result. Keep group for backward."""
        raise NotImplementedError("lab 14: f's forward (all-gather), see labs/14_sequence_parallel/README.md")

    def backward(self, grad):
        """grad: dL/dy (B, t, ...) on this rank, a partial gradient (each rank's layer after
        it used only its columns). Returns (dL/dx (B, t/p, ...), None): the sum over the
        group's ranks of grad, this rank's tokens only. grad's dtype; never modify grad."""
        raise NotImplementedError("lab 14: f's backward (reduce-scatter), see labs/14_sequence_parallel/README.md")


class ScatterToSequence(Function):
    """Sequence parallelism's g-bar (Megatron's g, after a row-parallel linear): reduce-scatter
    along the sequence in forward, all-gather of the gradient in backward.
    Use: y = ScatterToSequence.apply(x, group)."""

    def forward(self, x, group):
        """x (B, t, ...) partial sums -> (B, t/p, ...), scatter_sequence's result. Keep group
        for backward."""
        raise NotImplementedError("lab 14: g-bar's forward (reduce-scatter), see labs/14_sequence_parallel/README.md")

    def backward(self, grad):
        """grad: dL/dy (B, t/p, ...), this rank's tokens. Returns (dL/dx (B, t, ...), None):
        every rank's grad gathered along the sequence. grad's dtype; never modify grad."""
        raise NotImplementedError("lab 14: g-bar's backward (all-gather), see labs/14_sequence_parallel/README.md")


class SumGradOverTP(Function):
    """A parameter every tp rank holds whole (a LayerNorm's or RMSNorm's weight and bias, a
    row-parallel bias) used on this rank's t/p tokens only: identity forward, and in
    backward the sum of its gradient over the tp group. Use: w = SumGradOverTP.apply(p, group)
    wherever the parameter is used on the sequence shard."""

    def forward(self, p, group):
        """p: the parameter's array (any shape). Returns p's values (p itself will do),
        without communicating. Keep group for backward."""
        raise NotImplementedError("lab 14: the replicated parameter's forward, see labs/14_sequence_parallel/README.md")

    def backward(self, grad):
        """grad: this rank's partial dL/dp (from its own tokens). Returns (the SUM of grad
        over the group's ranks, None), in grad's dtype, with one comm.all_reduce; never modify
        grad. Not the mean, not left alone, not summed twice."""
        raise NotImplementedError("lab 14: the replicated parameter's gradient sum, see "
                                  "labs/14_sequence_parallel/README.md")
