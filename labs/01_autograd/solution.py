"""Lab 01, solved by hand as a student would: LayerNorm's backward walked one forward line at a
time, back through the product, the variance and the mean (minipar's own, in minipar/autograd/ops.py,
is the closed form rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)))."""
import numpy as np


def layernorm_backward(dout, x, w, eps=1e-5):
    C = x.shape[1]
    mu = x.sum(axis=1, keepdims=True) / C                  # (N, 1)
    xc = x - mu                                            # (N, C)
    var = (xc * xc).sum(axis=1, keepdims=True) / C         # (N, 1), biased
    istd = 1.0 / np.sqrt(var + eps)                        # (N, 1)
    xhat = xc * istd                                       # (N, C)

    db = dout.sum(axis=0)                                  # out = xhat * w + b: sum over rows
    dw = (dout * xhat).sum(axis=0)
    dxhat = dout * w                                       # (N, C)

    # xhat = xc * istd: both factors depend on xc
    dxc = dxhat * istd
    distd = (dxhat * xc).sum(axis=1, keepdims=True)        # (N, 1)
    dvar = distd * -0.5 * istd ** 3                        # istd = (var + eps)^(-1/2)
    dxc = dxc + dvar * (2.0 / C) * xc                      # var = sum(xc^2) / C
    # xc = x - mu, mu = sum(x) / C: every x_j moves mu by 1/C
    dx = dxc - dxc.sum(axis=1, keepdims=True) / C
    return dx, dw, db


def softmax_backward(dout, y):
    # J = diag(y) - y y^T, so J^T dout = y * dout - y * <y, dout>
    inner = np.einsum("...k,...k->...", y, dout)[..., None]
    return y * (dout - inner)


def cross_entropy_backward(logits, targets, dloss, loss_denom):
    N, V = logits.shape
    shifted = logits - logits.max(axis=1, keepdims=True)   # softmax(z) = softmax(z - max): no overflow
    e = np.exp(shifted)
    probs = e / e.sum(axis=1, keepdims=True)
    onehot = np.zeros_like(probs)
    onehot[np.arange(N), targets] = 1.0
    # d/dz_i of (logsumexp(z) - z_t) = softmax(z)_i - [i == t]
    return (probs - onehot) * (dloss / loss_denom)
