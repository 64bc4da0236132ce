# criterion: against minipar's reference formulas
"""Mutant: layernorm_backward by central finite differences of the forward, not by the formula:
right to about 1e-10, which passes a finite-difference check, but not to the 1e-12 of the closed form."""
import numpy as np


def layernorm_forward(x, w, b, eps):
    mu = x.mean(axis=1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def numerical(f, a, h):
    """d f / d a by central differences, one element at a time."""
    grad = np.zeros_like(a)
    for i in range(a.size):
        up, down = a.copy(), a.copy()
        up.flat[i] += h
        down.flat[i] -= h
        grad.flat[i] = (f(up) - f(down)) / (2 * h)
    return grad


def layernorm_backward(dout, x, w, eps=1e-5):
    b = np.zeros_like(w)
    h = 1e-5 * max(float(np.abs(x).max()), 1e-300)

    def loss(x_, w_, b_):
        return float((layernorm_forward(x_, w_, b_, eps) * dout).sum())

    dx = numerical(lambda v: loss(v, w, b), x, h)
    dw = numerical(lambda v: loss(x, v, b), w, 1e-5)
    db = numerical(lambda v: loss(x, w, v), b, 1e-5)
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
