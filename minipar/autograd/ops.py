"""Differentiable operations: each a Function with a hand-written forward and backward.

Letters as in nanoGPT: B batch, T time, C channels, nh heads, hs = C/nh head size, V vocab,
N = B*T rows. Every op keeps its input dtype (float32 or float64): constants are Python
floats, which NumPy never lets upcast an array. Backward formulas are checked against
central finite differences in tests/test_ops.py.

Plain maths beside fast code: every op tuned for speed (Linear, LayerNorm, GELU, causal
attention, cross-entropy) has a class `<Op>Reference` right above it with the textbook
forward and backward in plain NumPy: `forward(...) -> (out, cache)` and
`backward(dout, cache) -> one gradient per differentiable input`. Read those for the maths.
tests/test_ops.py checks each reference against finite differences and each fast op against
its reference (float64, rtol 1e-12), so the formula you read is the one that checks the code.

Mixed precision (minipar/optim/mixed_precision.py): with float16 or bfloat16 inputs an op computes in
float32 and rounds its outputs and input gradients back to the input's 2-byte dtype:
`compute(...)` widens the inputs (float32 and float64 pass through as the same objects),
`store(y, dtype)` rounds. Pure data movement (reshape, slice, concat, the embedding
lookup) and elementwise add and mul stay in the storage dtype, which rounds each result once.
The loss is the exception: cross_entropy returns it in float32 (as autocast does).

The functions at the bottom (`linear`, `layer_norm`, ...) are the public entry points.
"""
from __future__ import annotations

import math

import numpy as np

from minipar.autograd.attention import CausalSelfAttention, CausalSelfAttentionReference  # noqa: F401
from minipar.autograd.dtypes import compute, store
from minipar.autograd.tensor import Function, Tensor


def _unbroadcast(g: np.ndarray, shape) -> np.ndarray:
    """Sum a broadcast gradient back down to `shape` (numpy broadcasting rules)."""
    if g.shape == tuple(shape):
        return g
    extra = g.ndim - len(shape)
    axes = tuple(range(extra)) + tuple(i + extra for i, n in enumerate(shape) if n == 1 and g.shape[i + extra] != 1)
    if not axes:
        return g.reshape(shape)
    return store(compute(g).sum(axis=axes, keepdims=True).reshape(shape), g.dtype)   # sum in fp32


def _as_tensor(x, like: Tensor) -> Tensor:
    if isinstance(x, Tensor):
        return x
    return Tensor(np.asarray(x, dtype=like.dtype))


# --- elementwise and shape ------------------------------------------------------------------

class Add(Function):
    def forward(self, a, b):
        self.shapes = (a.shape, b.shape)
        return a + b

    def backward(self, g):
        sa, sb = self.shapes
        return _unbroadcast(g, sa), _unbroadcast(g, sb)


class Mul(Function):
    def forward(self, a, b):
        self.save(a, b)
        return a * b

    def backward(self, g):
        a, b = self.saved
        da = _unbroadcast(g * b, a.shape) if self.needs_input_grad[0] else None
        db = _unbroadcast(g * a, b.shape) if self.needs_input_grad[1] else None
        return da, db


class Reshape(Function):
    def forward(self, x, shape):
        self.in_shape = x.shape
        return x.reshape(shape)

    def backward(self, g):
        return g.reshape(self.in_shape), None


class Transpose(Function):
    def forward(self, x, axes):
        self.axes = axes
        return x.transpose(axes)

    def backward(self, g):
        return g.transpose(np.argsort(self.axes)), None


class Slice(Function):
    """x[index] for a tuple of slices; backward scatters into zeros."""

    def forward(self, x, index):
        self.in_shape, self.index = x.shape, index
        return x[index]

    def backward(self, g):
        dx = np.zeros(self.in_shape, dtype=g.dtype)
        dx[self.index] = g
        return dx, None


class Concat(Function):
    def forward(self, axis, *xs):
        self.axis, self.sizes = axis, [x.shape[axis] for x in xs]
        return np.concatenate(xs, axis=axis)

    def backward(self, g):
        cuts = np.cumsum(self.sizes)[:-1]
        return (None, *np.split(g, cuts, axis=self.axis))


class Sum(Function):
    def forward(self, x, axis, keepdims):
        self.in_shape, self.axis, self.keepdims = x.shape, axis, keepdims
        return store(np.asarray(compute(x).sum(axis=axis, keepdims=keepdims)), x.dtype)

    def backward(self, g):
        if not self.keepdims and self.axis is not None:
            g = np.expand_dims(g, self.axis)
        return np.broadcast_to(g, self.in_shape).copy(), None, None


# --- dense layers ---------------------------------------------------------------------------

class MatMul(Function):
    """a @ b with numpy's batched broadcasting. A 2-D b (a weight) takes the fast path:
    its gradient is one GEMM over all rows, a.reshape(N, K).T @ g.reshape(N, M); the
    maths without the flattening is LinearReference's (below) without the bias."""

    def forward(self, a, b):
        self.save(a, b)                                    # in the storage dtype
        dtype, (a, b) = a.dtype, compute(a, b)             # fp16/bf16: multiply in fp32
        if b.ndim == 2 and a.ndim > 2:                     # one GEMM over all rows
            return store((a.reshape(-1, a.shape[-1]) @ b).reshape(*a.shape[:-1], b.shape[1]), dtype)
        return store(a @ b, dtype)

    def backward(self, g):
        a, b = self.saved
        da, db = self._backward(compute(g), *compute(a, b))
        return store(da, a.dtype), store(db, b.dtype)

    def _backward(self, g, a, b):
        da = db = None
        if self.needs_input_grad[0] and b.ndim == 2 and a.ndim > 2:
            da = (g.reshape(-1, g.shape[-1]) @ b.T).reshape(a.shape)
        elif self.needs_input_grad[0]:
            da = _unbroadcast(g @ np.swapaxes(b, -1, -2), a.shape)
        if self.needs_input_grad[1]:
            if b.ndim == 2 and a.ndim >= 2:
                db = a.reshape(-1, a.shape[-1]).T @ g.reshape(-1, g.shape[-1])
            else:
                db = _unbroadcast(np.swapaxes(a, -1, -2) @ g, b.shape)
        return da, db


class LinearReference:
    """y = x @ w + b, as written. x (B, T, Cin), w (Cin, Cout), b (Cout,) or None."""

    @staticmethod
    def forward(x, w, b=None):
        out = x @ w                                        # (B, T, Cout)
        if b is not None:
            out = out + b
        return out, (x, w, b is not None)

    @staticmethod
    def backward(dout, cache):
        x, w, has_bias = cache
        dx = dout @ w.T                                    # (B, T, Cin)
        dw = np.einsum("bti,btj->ij", x, dout)             # (Cin, Cout): sum over b, t of x[b,t] dout[b,t]^T
        db = dout.sum((0, 1)) if has_bias else None        # (Cout,)
        return dx, dw, db


class Linear(Function):
    """y = x @ w + b with x (..., Cin), w (Cin, Cout), b (Cout,) or None. Rows are
    flattened to one (N, Cin) @ (Cin, Cout) GEMM: numpy would otherwise loop over B.
    A weight may come in column pieces, linear(x, [w1, w2, ...]): y = x @ [w1 | w2 | ...],
    one GEMM (Llama's fused [q | k | v] and [gate | up]). The concatenation is made for the
    forward and again in backward, never kept: only x and the pieces (the parameters
    themselves) are saved, and each piece gets its columns of the one weight gradient.
    The maths without the flattening: LinearReference above."""

    def forward(self, x, w, b=None, *pieces):
        x2 = x.reshape(-1, x.shape[-1])                    # (N, Cin)
        self.save(x2, w, *pieces)                          # in the storage dtype
        w = _joined(w, pieces)
        y = np.matmul(*compute(x2, w))                     # (N, Cout), fp32 for fp16/bf16
        if b is not None:
            y += compute(b)
        return store(y, x.dtype).reshape(*x.shape[:-1], w.shape[1])

    def backward(self, g):
        x2, w, *pieces = self.saved
        dtype, need = x2.dtype, self.needs_input_grad
        x2, w_all = compute(x2, _joined(w, pieces))
        g2 = compute(g).reshape(-1, g.shape[-1])           # (N, Cout)
        dx = (g2 @ w_all.T).reshape(*g.shape[:-1], w_all.shape[0]) if need[0] else None
        dws = [None] * (1 + len(pieces))
        if need[1] or any(need[3:]):
            dw = x2.T @ g2                                 # (Cin, Cout): each piece takes its columns
            cuts = np.cumsum([w.shape[1]] + [p.shape[1] for p in pieces])[:-1]
            dws = [store(d, dtype) for d in np.split(dw, cuts, axis=1)]
        if len(need) == 2:                                 # called without a bias
            return store(dx, dtype), dws[0]
        db = store(g2.sum(0), dtype) if need[2] else None
        return (store(dx, dtype), dws[0], db, *dws[1:])


def _joined(w, pieces):
    """[w | pieces...] along the columns (w itself when there are no pieces)."""
    return np.concatenate([w, *pieces], axis=1) if pieces else w


class Embedding(Function):
    """w[idx]: idx int array (...), w (V, C) -> (..., C). Backward scatters rows with
    np.add.at, which sums repeated ids correctly (fancy-index += would not)."""

    def forward(self, idx, w):
        self.save(idx)
        self.w_shape = w.shape
        return w[idx]

    def backward(self, g):
        (idx,) = self.saved
        g32 = compute(g)                                   # repeated ids sum in fp32
        dw = np.zeros(self.w_shape, dtype=g32.dtype)
        np.add.at(dw, idx.reshape(-1), g32.reshape(-1, self.w_shape[1]))
        return None, store(dw, g.dtype)


# --- normalisation and nonlinearity ---------------------------------------------------------

def _row_blocks(n_rows: int, row_len: int, target: int = 65536):
    """Row ranges of about `target` elements. An elementwise chain run block by block keeps
    its intermediates in L2 cache instead of streaming each one through memory (~1.5x
    faster for GELU and LayerNorm on the benchmark shapes)."""
    step = max(1, target // max(1, row_len))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


class LayerNormReference:
    """(x - mean) / sqrt(var + eps) * w + b over the last axis, biased variance, as written."""

    @staticmethod
    def forward(x, w, b, eps=1e-5):
        mean = x.mean(-1, keepdims=True)                   # (B, T, 1)
        var = ((x - mean) ** 2).mean(-1, keepdims=True)    # (B, T, 1), biased: divide by C
        rstd = 1.0 / np.sqrt(var + eps)                    # (B, T, 1)
        xhat = (x - mean) * rstd                           # (B, T, C)
        out = xhat * w + b                                 # (B, T, C)
        return out, (xhat, w, rstd)

    @staticmethod
    def backward(dout, cache):
        xhat, w, rstd = cache
        C = xhat.shape[-1]
        db = dout.reshape(-1, C).sum(0)                    # (C,)
        dw = (dout * xhat).reshape(-1, C).sum(0)           # (C,)
        dxhat = dout * w                                   # (B, T, C)
        # x reaches xhat directly and through mean and rstd; the two indirect paths
        # subtract the mean of dxhat and the part of dxhat along xhat
        dx = rstd * (dxhat - dxhat.mean(-1, keepdims=True)
                     - xhat * (dxhat * xhat).mean(-1, keepdims=True))   # (B, T, C)
        return dx, dw, db


class LayerNorm(Function):
    """(x - mean) / sqrt(var + eps) * w + b over the last axis, biased variance.
    Tuned: rows in cache-sized blocks, row means as a GEMV, every temporary in an `out=`
    buffer. The same maths in a few plain lines: LayerNormReference above."""

    def forward(self, x, w, b, eps=1e-5):
        self.dtype, (x, w, b) = x.dtype, compute(x, w, b)  # fp16/bf16: normalise in fp32
        C = x.shape[-1]
        x2 = x.reshape(-1, C)                              # (N, C)
        inv_c = np.full(C, 1.0 / C, dtype=x2.dtype)         # row means as one GEMV: 4x a .mean(-1)
        xhat = np.empty_like(x2)
        rstd = np.empty((x2.shape[0], 1), dtype=x.dtype)   # (N, 1)
        y = np.empty_like(x2)
        for r in _row_blocks(*x2.shape):
            xc = np.subtract(x2[r], (x2[r] @ inv_c)[:, None], out=xhat[r])   # x - mean
            var = np.einsum("ni,ni->n", xc, xc)[:, None] * (1.0 / C)
            np.sqrt(var + eps, out=rstd[r])
            np.divide(1.0, rstd[r], out=rstd[r])
            xc *= rstd[r]                                  # xhat
            np.multiply(xc, w, out=y[r])
            y[r] += b
        self.save(xhat, w, rstd)
        return store(y.reshape(x.shape), self.dtype)

    def backward(self, g):
        xhat, w, rstd = self.saved
        C = xhat.shape[1]
        g2 = compute(g).reshape(-1, C)                     # (N, C)
        need_x, need_w, need_b = self.needs_input_grad[:3]  # backward_split asks for some only
        dw = store(np.einsum("ni,ni->i", xhat, g2), self.dtype) if need_w else None
        db = store(g2.sum(0), self.dtype) if need_b else None
        if not need_x:
            return None, dw, db, None
        inv_c = np.full(C, 1.0 / C, dtype=g2.dtype)
        dx = np.empty_like(g2)
        for r in _row_blocks(*g2.shape):
            # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = g * w
            d = np.multiply(g2[r], w, out=dx[r])
            c1 = (d @ inv_c)[:, None]                      # mean(dxhat)
            c2 = np.einsum("ni,ni->n", d, xhat[r])[:, None] * (1.0 / C)
            d -= c1
            d -= xhat[r] * c2
            d *= rstd[r]
        return store(dx.reshape(g.shape), self.dtype), dw, db, None


_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


class GELUReference:
    """0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3): GPT-2's tanh form, as written."""

    @staticmethod
    def forward(x):
        u = _GELU_K * (x + _GELU_A * x ** 3)               # (B, T, 4C)
        th = np.tanh(u)
        out = 0.5 * x * (1.0 + th)                         # (B, T, 4C)
        return out, (x, th)

    @staticmethod
    def backward(dout, cache):
        x, th = cache
        du = _GELU_K * (1.0 + 3.0 * _GELU_A * x ** 2)      # du/dx
        # product rule on 0.5 x (1 + tanh(u)), and tanh' = 1 - tanh^2
        return dout * (0.5 * (1.0 + th) + 0.5 * x * (1.0 - th ** 2) * du)   # (B, T, 4C)


class GELU(Function):
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's tanh form, computed as
    x * s with s = sigmoid(2u) = 0.5 (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3):
    one exp instead of a tanh, and s is all that backward needs besides x. Rows in
    cache-sized blocks, temporaries in `out=` buffers. The tanh form as written:
    GELUReference above."""

    def forward(self, x):
        self.dtype = x.dtype
        x2 = compute(x).reshape(-1, x.shape[-1])           # (N, 4C)
        s = np.empty_like(x2)
        y = np.empty_like(x2)
        for r in _row_blocks(*x2.shape):
            c, u = x2[r], s[r]
            np.multiply(c, c, out=u)
            u *= -2.0 * _GELU_K * _GELU_A
            u -= 2.0 * _GELU_K
            u *= c                                         # -2u
            np.exp(u, out=u)
            u += 1.0
            np.divide(1.0, u, out=u)                       # s = 1 / (1 + exp(-2u)); not np.reciprocal: slower
            np.multiply(c, u, out=y[r])
        self.save(x2, s)
        return store(y.reshape(x.shape), self.dtype)

    def backward(self, g):
        x2, s = self.saved
        g2 = compute(g).reshape(x2.shape)
        dx = np.empty_like(x2)
        for r in _row_blocks(*x2.shape):
            # d/dx [x s] = s + x s (1 - s) * 2 du/dx,  2 du/dx = 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2)
            c, sr, d = x2[r], s[r], dx[r]
            np.multiply(c, c, out=d)
            d *= 2.0 * _GELU_K * 3.0 * _GELU_A
            d += 2.0 * _GELU_K
            d *= c
            one_minus = np.subtract(1.0, sr)
            one_minus *= sr
            d *= one_minus
            d += sr
            d *= g2[r]
        return store(dx.reshape(g.shape), self.dtype)


class Softmax(Function):
    def forward(self, x, axis=-1):
        self.dtype, x = x.dtype, compute(x)
        y = x - x.max(axis=axis, keepdims=True)
        np.exp(y, out=y)
        y /= y.sum(axis=axis, keepdims=True)
        self.save(y)
        self.axis = axis
        return store(y, self.dtype)

    def backward(self, g):
        (y,) = self.saved
        g = compute(g)
        dx = g - (g * y).sum(axis=self.axis, keepdims=True)
        dx *= y
        return store(dx, self.dtype), None


# --- attention: autograd/attention.py (multi-head and grouped-query) -------------------------

# --- loss -----------------------------------------------------------------------------------

class CrossEntropyReference:
    """loss = -sum over rows of log softmax(logits)[target], divided by denom (default: the
    number of rows), as written. logits (B, T, V), targets int (B, T)."""

    @staticmethod
    def forward(logits, targets, denom=None):
        V = logits.shape[-1]
        z = logits.reshape(-1, V)                          # (N, V)
        t = targets.reshape(-1)                            # (N,)
        denom = t.shape[0] if denom is None else denom
        z = z - z.max(-1, keepdims=True)                   # softmax is shift invariant; exp cannot overflow
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))   # (N, V) log softmax
        loss = -logp[np.arange(t.shape[0]), t].sum() / denom
        return loss, (np.exp(logp), t, denom, logits.shape)

    @staticmethod
    def backward(dloss, cache):
        probs, t, denom, shape = cache
        dlogits = probs.copy()                             # (N, V)
        dlogits[np.arange(t.shape[0]), t] -= 1.0           # softmax - onehot(target), per row
        return (dlogits * (dloss / denom)).reshape(shape)  # (B, T, V)


class CrossEntropy(Function):
    """sum over rows of -log softmax(logits)[target], divided by `denom`.
    logits (..., V), targets int (...). Stable for large logits: log-sum-exp after
    subtracting the row max. denom defaults to the number of rows (the mean); a
    data-parallel or micro-batched caller passes the global row count instead.
    fp16/bf16 logits: computed in fp32, and the loss stays fp32. The softmax is normalised
    in place and kept for backward; the same maths, step by step: CrossEntropyReference above."""

    def forward(self, logits, targets, denom=None):
        self.dtype, logits = logits.dtype, compute(logits)
        V = logits.shape[-1]
        z = logits.reshape(-1, V) - logits.reshape(-1, V).max(-1, keepdims=True)   # (N, V)
        t = targets.reshape(-1)
        n = t.shape[0]
        denom = float(n if denom is None else denom)
        p = np.exp(z)
        s = p.sum(-1, keepdims=True)                       # (N, 1)
        lse = np.log(s)
        loss = (lse[:, 0] - z[np.arange(n), t]).sum() / denom
        p /= s                                             # softmax probabilities
        self.save(p, t)
        self.denom, self.shape = denom, logits.shape
        return np.asarray(loss, dtype=logits.dtype)

    def backward(self, g):
        p, t = self.saved
        d = p.copy()                                       # (N, V)
        d[np.arange(t.shape[0]), t] -= 1.0
        d *= g * (1.0 / self.denom)
        return store(d.reshape(self.shape), self.dtype), None, None


# --- public functional API ------------------------------------------------------------------

def add(a, b):
    a = _as_tensor(a, b) if not isinstance(a, Tensor) else a
    return Add.apply(a, _as_tensor(b, a))


def mul(a, b):
    a = _as_tensor(a, b) if not isinstance(a, Tensor) else a
    return Mul.apply(a, _as_tensor(b, a))


def matmul(a: Tensor, b: Tensor) -> Tensor:
    return MatMul.apply(a, b)


def linear(x: Tensor, w, b: Tensor | None = None) -> Tensor:
    """x @ w + b; w a Tensor, or a list of column pieces [w1, w2, ...] of one weight."""
    if isinstance(w, (list, tuple)):
        return Linear.apply(x, w[0], b, *w[1:])
    return Linear.apply(x, w, b) if b is not None else Linear.apply(x, w)


def reshape(x: Tensor, shape) -> Tensor:
    return Reshape.apply(x, tuple(shape))


def transpose(x: Tensor, axes=None) -> Tensor:
    axes = tuple(range(x.ndim))[::-1] if axes is None else tuple(axes)
    return Transpose.apply(x, axes)


def split(x: Tensor, sections, axis: int = -1) -> list:
    """np.split semantics: an int number of equal parts, or a list of cut points."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if isinstance(sections, int) and (sections <= 0 or n % sections):
        raise ValueError(f"split: axis {axis} of size {n} does not divide into {sections} equal parts")
    cuts = list(range(0, n, n // sections))[1:] if isinstance(sections, int) else list(sections)
    bounds = [0, *cuts, n]
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        index = (slice(None),) * axis + (slice(lo, hi),)
        out.append(Slice.apply(x, index))
    return out


def concat(xs, axis: int = -1) -> Tensor:
    return Concat.apply(axis, *xs)


def sum(x: Tensor, axis=None, keepdims=False) -> Tensor:  # noqa: A001 - mirrors numpy
    return Sum.apply(x, axis, keepdims)


def mean(x: Tensor, axis=None, keepdims=False) -> Tensor:
    n = x.size if axis is None else int(np.prod([x.shape[a] for a in np.atleast_1d(axis)]))
    return mul(Sum.apply(x, axis, keepdims), 1.0 / n)


def embedding(idx, w: Tensor) -> Tensor:
    return Embedding.apply(np.asarray(idx), w)


def layer_norm(x: Tensor, w: Tensor, b: Tensor, eps: float = 1e-5) -> Tensor:
    return LayerNorm.apply(x, w, b, eps)


def gelu(x: Tensor) -> Tensor:
    return GELU.apply(x)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    return Softmax.apply(x, axis)


def causal_self_attention(qkv: Tensor, n_head: int, recompute: bool = False, n_kv_head: int | None = None) -> Tensor:
    """qkv (B, T, (H + 2 Hkv) hs) -> (B, T, H hs); n_kv_head Hkv None: H (multi-head).
    recompute: keep q, k, v only and compute the softmax again in backward (selective)."""
    return CausalSelfAttention.apply(qkv, n_head, recompute, n_kv_head)


def cross_entropy(logits: Tensor, targets, denom=None) -> Tensor:
    return CrossEntropy.apply(logits, np.asarray(targets), denom)
