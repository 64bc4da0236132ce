"""Lab 01 answered by minipar's own code (python -m labs.grade 01 --solution): the backward
of the tuned ops in minipar/autograd/ops.py (ops.LayerNorm, ops.Softmax, ops.CrossEntropy), run on a
fresh node of each, behind the lab's signatures. The methods are taken when this file is
loaded, before lab.install() puts the student's functions in their place."""
import numpy as np

from minipar.autograd import ops

LAYER_NORM = ops.LayerNorm.forward, ops.LayerNorm.backward
SOFTMAX_BACKWARD = ops.Softmax.backward
CROSS_ENTROPY = ops.CrossEntropy.forward, ops.CrossEntropy.backward


def layernorm_backward(dout, x, w, eps=1e-5):
    forward, backward = LAYER_NORM
    node = ops.LayerNorm()
    forward(node, x, w, np.zeros_like(w), eps)               # saves xhat, w, rstd
    dx, dw, db, _ = backward(node, dout)
    return dx, dw, db


def softmax_backward(dout, y):
    node = ops.Softmax()
    node.save(y)                                             # all that the backward needs
    node.axis, node.dtype = -1, y.dtype
    return SOFTMAX_BACKWARD(node, dout)[0]


def cross_entropy_backward(logits, targets, dloss, loss_denom):
    forward, backward = CROSS_ENTROPY
    node = ops.CrossEntropy()
    forward(node, logits, targets, loss_denom)               # saves the probabilities
    return backward(node, np.asarray(dloss, dtype=logits.dtype))[0]
