"""Lab 06: the vocabulary-parallel embedding and cross-entropy, the two ends of a
tensor-parallel GPT where the vocabulary (V rows of wte) is split over the tp ranks.

Write the pieces below (labs/06_vocab_parallel/README.md has the picture and the hints). The
Functions are autograd Functions of minipar.tensor: forward gets NumPy arrays, backward gets
the gradient of the output and returns one gradient per forward argument (None for ints,
index arrays and the group):

    class Twice(Function):
        def forward(self, x, k):
            self.k = k                      # anything backward needs, on self
            return 2 * x
        def backward(self, grad):
            return 2 * grad, None           # dL/dx, and nothing for k
    y = Twice.apply(x_tensor, 3)            # a Tensor, recorded in the graph

The vocabulary is padded to Vp = tp * ceil(V / tp) rows; rank r of the tp group holds rows
(or logit columns) [vocab_start, vocab_start + Vp/tp) with vocab_start = r * Vp/tp. Rows past
V are padding: their weights are zero, no id ever points at them, and their logits arrive
as -inf (minipar's MaskColumns puts them there before the loss).

The one all-reduce you may call is minipar's, through tensor parallelism's ledger:

    tp_all_reduce(group, array, op, kind)   # op "sum" or "max"; the same on every rank

with kind "g" for the embedding's sum and "cross_entropy" for the loss's three. No MPI
collective, and no other all-reduce. It returns a new array when the group has several ranks;
in a group of one rank (tp = 1: Vp = V, vocab_start = 0) there is nothing to add and it hands
back the array you gave it, the very object: do not write into it afterwards.

Arrays come in float64 or float32 (the trainer's dtypes): every array you return (outputs and
gradients) has the dtype of the weight or the logits. Ids and targets may be of any integer
dtype (int64, int32, int16, ...).

Check:  make lab L=06        (or: .venv/bin/python -m labs.grade 06 --student this_file.py)
"""
from dataclasses import dataclass

import numpy as np  # noqa: F401 - you will want it

from minipar import comm
from minipar.parallel.tensor.tensor_parallel import tp_all_reduce  # noqa: F401 - the only all-reduce
from minipar.tensor import Function, Tensor


class MaskedEmbedding(Function):
    """This rank's partial lookup: w[idx - start] for the ids it owns, zero rows for the
    others. Use: partial = MaskedEmbedding.apply(idx, weight, vocab_start)."""

    def forward(self, idx, w, start):
        """idx: int array (B, t) of token ids in [0, V); w: this rank's rows (Vp/tp, C); start:
        the id of w's first row. Returns a new array (B, t, C): row w[i - start] where
        start <= i < start + Vp/tp, zeros elsewhere. Keep what backward needs; never modify
        idx or w."""
        raise NotImplementedError("lab 06: the masked lookup, see labs/06_vocab_parallel/README.md")

    def backward(self, grad):
        """grad: dL/dout (B, t, C). Returns (None, dL/dw, None): dL/dw (Vp/tp, C) is zero but
        for the rows of the ids this rank owns, where grad's rows are added, a repeated id
        once per occurrence."""
        raise NotImplementedError("lab 06: the masked lookup's backward, see labs/06_vocab_parallel/README.md")


class AllReduceSum(Function):
    """The sum of every rank's partial lookup (Megatron's g): all-reduce forward, identity
    backward. Use: y = AllReduceSum.apply(x, group)."""

    def forward(self, x, group):
        """x: this rank's partial array. Returns the sum over the tp ranks, one all-reduce:
        tp_all_reduce(group, x, "sum", "g"). Never modify x."""
        raise NotImplementedError("lab 06: the all-reduce of the lookups, see labs/06_vocab_parallel/README.md")

    def backward(self, grad):
        """grad: dL/dy, the same on every tp rank (y is). Returns (grad, None), without
        communicating."""
        raise NotImplementedError("lab 06: AllReduceSum's backward, see labs/06_vocab_parallel/README.md")


@dataclass
class VocabParallelEmbedding:
    """tok = AllReduceSum(MaskedEmbedding(idx)): every token's row comes from the one rank
    that owns it. Built as VocabParallelEmbedding(weight, vocab_start, group), as
    TensorParallelGPT does."""
    weight: Tensor        # (Vp/tp, C): this rank's rows of wte (padding rows zero)
    vocab_start: int      # the id of its first row, r * Vp/tp
    group: comm.Group     # the tp group

    def __call__(self, idx):
        """idx: int array (B, t), ids in [0, V), the same on every tp rank. Returns a Tensor
        (B, t, C) = wte[idx], the same on every rank: one all-reduce forward (kind "g"), none
        backward; weight's gradient this rank's rows of dL/dwte. Read self.weight here, each
        call (the optimizer updates it in place between steps)."""
        raise NotImplementedError("lab 06: the vocabulary-parallel embedding, see labs/06_vocab_parallel/README.md")


class VocabParallelCrossEntropy(Function):
    """The softmax cross-entropy of logits split over the vocabulary, without gathering them.
    Use: loss = VocabParallelCrossEntropy.apply(logits, targets, group, start, denom)."""

    def forward(self, logits, targets, group, start, denom=None):
        """logits: (B, t, Vp/tp) float, this rank's columns [start, start + Vp/tp) of the
        logits, padded columns -inf; targets: int (B, t) in [0, V), the same on every rank;
        denom: the divisor (None: the number of rows N = B*t). Returns a 0-d array of the
        logits' dtype, the same on every rank:

            sum over rows n of ( log sum_v exp(z[n, v]) - z[n, target[n]] ) / denom

        computed as minipar does, with exactly three all-reduces of N numbers, kind
        "cross_entropy": the global row max (op "max"; subtract it before any exp, logits
        may be +-1e4), the target logit (op "sum": only the rank owning the target adds
        it, the others 0) and the sum of exp (op "sum"). Keep the local softmax for
        backward; never modify logits or targets."""
        raise NotImplementedError("lab 06: the vocabulary-parallel cross-entropy, see labs/06_vocab_parallel/README.md")

    def backward(self, grad):
        """grad: dL/dloss, a 0-d array. Returns (dL/dlogits, None, None, None, None) with
        dL/dlogits (B, t, Vp/tp) = (softmax - onehot(target)) * grad / denom on this rank's
        columns: local, no communication; exactly 0 in padded columns."""
        raise NotImplementedError("lab 06: the cross-entropy's backward, see labs/06_vocab_parallel/README.md")


def vocab_parallel_cross_entropy(logits, targets, group, vocab_start, denom=None):
    """logits: Tensor (B, t, Vp/tp); targets: int array (B, t); vocab_start: this rank's first
    column. Returns the scalar loss Tensor of VocabParallelCrossEntropy (with targets as a
    NumPy array), as TensorParallelGPT.loss calls it."""
    raise NotImplementedError("lab 06: apply your cross-entropy Function, see labs/06_vocab_parallel/README.md")
