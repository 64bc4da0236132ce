"""Lab 01: the backward of LayerNorm, softmax and cross-entropy, in plain NumPy.

Write the three functions below (labs/01_autograd/README.md has the pictures and the hints).
Each is the backward of one forward, written out in its docstring: given the gradient of a
scalar objective with respect to the forward's output (dout, or dloss for the loss), return
its gradient with respect to the forward's inputs. No Tensor, no autograd, no minipar: arrays
in, arrays out, float64 or float32 (the grader tries both; training hands you float32), the
inputs never modified, the results new arrays (never an input, nor a view of one) of the
inputs' dtype.

The grader holds each against finite differences of the forward, then against minipar's own
formulas at 1e-12 (and with float32 inputs), then puts them inside minipar.ops (the backward
of ops.LayerNorm, ops.CrossEntropy and ops.Softmax) and compares every gradient of a small GPT
with minipar's.

Check:  make lab L=01        (or: .venv/bin/python -m labs.grade 01 --student this_file.py)
"""
import numpy as np  # noqa: F401 - you will want it


def layernorm_backward(dout, x, w, eps=1e-5):
    """The gradients (dx, dw, db) of LayerNorm over each row of x, for the forward

        mean = x.mean(axis=1)                           (N,)
        var  = ((x - mean)^2).mean(axis=1)              (N,)  biased: divided by C, not C - 1
        rstd = 1 / sqrt(var + eps)                      (N,)
        xhat = (x - mean) * rstd                        (N, C)  mean and rstd broadcast per row
        out  = xhat * w + b                             (N, C)  w, b broadcast per column

    dout (N, C): dL/dout; x (N, C): the forward's input, N rows of C channels (N and C may be
    1); w (C,): the gain; eps: a float, minipar's 1e-5 when the caller leaves it out. b does
    not change the gradients, so it is not an argument. Returns a tuple of three new arrays
    of x's dtype: dx (N, C) = dL/dx, dw (C,) = dL/dw, db (C,) = dL/db. Recompute mean, var,
    rstd and xhat from x yourself. dout, x and w are never modified."""
    raise NotImplementedError("lab 01: layernorm_backward, see labs/01_autograd/README.md")


def softmax_backward(dout, y):
    """dx = dL/dx for the softmax over the last axis,

        y[..., i] = exp(x[..., i] - m) / sum_j exp(x[..., j] - m),   m = max_j x[..., j]

    given its output y (any shape (..., K), 1-D included, each row summing to 1) and
    dout = dL/dy of the same shape. The gradient needs y only, not x. Returns dx, a new
    array like y. dout and y are never modified."""
    raise NotImplementedError("lab 01: softmax_backward, see labs/01_autograd/README.md")


def cross_entropy_backward(logits, targets, dloss, loss_denom):
    """dlogits = d(dloss * loss)/dlogits for the loss

        loss = sum over rows n of -log softmax(logits[n])[targets[n]]  /  loss_denom
             = sum_n ( logsumexp(logits[n]) - logits[n, targets[n]] )  /  loss_denom

    logits (N, V) float, any magnitude (rows around +-1e4 must not overflow: exp(1e4) is inf
    in float64); targets (N,) ints (any integer dtype) in [0, V), one per row (rows may
    share a target); dloss: a float, the gradient of the final objective with respect to the loss (1.0 for
    loss.backward()); loss_denom: a positive float (N for the mean; a micro-batch of a larger
    batch passes the global row count, docs/design.md §1). Returns dlogits (N, V), a new array
    of the logits' dtype. logits and targets are never modified."""
    raise NotImplementedError("lab 01: cross_entropy_backward, see labs/01_autograd/README.md")
