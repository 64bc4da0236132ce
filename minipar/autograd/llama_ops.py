"""The three ops the Llama family adds to GPT-2's: RMSNorm, the rotary position embedding and
SwiGLU. Each tuned op has its plain reference right above it, as in ops.py: `forward(...) ->
(out, cache)`, `backward(dout, cache)`; tests/test_llama_ops.py holds every reference to
central differences and every tuned op to its reference at 1e-12 in float64.

    rms_norm(x, w, eps)      x / sqrt(mean(x^2) + eps) * w over the last axis (no mean taken
                             away, no bias: Zhang and Sennrich 2019, arXiv:1910.07467)
    rope(qkv, pos, H, Hkv)   the q and k heads of a packed projection turned by their
                             positions (Su et al. 2021, arXiv:2104.09864), v left alone
    swiglu(gu)               silu(gate) * up of the packed [gate | up] (Shazeer 2020,
                             arXiv:2002.05202), silu(a) = a sigmoid(a)

The rotary convention is Hugging Face's "rotate half": a head's hs channels are two halves
(x1, x2), channel j of each half turned by the angle pos * theta^(-2j/hs):

    rope(x) = x cos + rotate_half(x) sin,   rotate_half(x1, x2) = (-x2, x1)
    i.e.  y1 = x1 cos - x2 sin,  y2 = x2 cos + x1 sin          (cos, sin: (t, hs/2) tables)

Meta's original Llama code turns adjacent pairs (x0, x1), (x2, x3), ... instead (complex
numbers). The two agree once the rows of each head of q_proj and k_proj are permuted from
pairs to halves, which is what Hugging Face's conversion script does (docs/llama.md).
fp16/bf16: each op computes in fp32 and rounds its outputs and gradients back (dtypes.py).
"""
from __future__ import annotations

import numpy as np

from minipar.autograd.attention import head_counts
from minipar.autograd.dtypes import compute, store
from minipar.autograd.ops import _row_blocks
from minipar.autograd.tensor import Function


# --- RMSNorm ---------------------------------------------------------------------------------

class RMSNormReference:
    """x / sqrt(mean(x^2) + eps) * w over the last axis, as written."""

    @staticmethod
    def forward(x, w, eps=1e-6):
        rstd = 1.0 / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps)     # (B, T, 1)
        xhat = x * rstd                                                  # (B, T, C)
        return xhat * w, (xhat, w, rstd)

    @staticmethod
    def backward(dout, cache):
        xhat, w, rstd = cache
        C = xhat.shape[-1]
        dw = (dout * xhat).reshape(-1, C).sum(0)                         # (C,)
        dxhat = dout * w
        # x reaches xhat directly and through rstd: subtract the part of dxhat along xhat
        dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdims=True))
        return dx, dw


class RMSNorm(Function):
    """x / sqrt(mean(x^2) + eps) * w. Tuned as ops.LayerNorm is: rows in cache-sized blocks,
    temporaries in `out=` buffers. The maths in a few plain lines: RMSNormReference above."""

    def forward(self, x, w, eps=1e-6):
        self.dtype, (x, w) = x.dtype, compute(x, w)        # fp16/bf16: normalise in fp32
        C = x.shape[-1]
        x2 = x.reshape(-1, C)                              # (N, C)
        xhat = np.empty_like(x2)
        rstd = np.empty((x2.shape[0], 1), dtype=x2.dtype)  # (N, 1)
        y = np.empty_like(x2)
        for r in _row_blocks(*x2.shape):
            ms = np.einsum("ni,ni->n", x2[r], x2[r])[:, None] * (1.0 / C)
            np.sqrt(ms + eps, out=rstd[r])
            np.divide(1.0, rstd[r], out=rstd[r])
            np.multiply(x2[r], rstd[r], out=xhat[r])
            np.multiply(xhat[r], w, out=y[r])
        self.save(xhat, w, rstd)
        return store(y.reshape(x.shape), self.dtype)

    def backward(self, g):
        xhat, w, rstd = self.saved
        C = xhat.shape[1]
        g2 = compute(g).reshape(-1, C)                     # (N, C)
        need_x, need_w = self.needs_input_grad[:2]         # backward_split asks for some only
        dw = store(np.einsum("ni,ni->i", xhat, g2), self.dtype) if need_w else None
        if not need_x:
            return None, dw, None
        dx = np.empty_like(g2)
        for r in _row_blocks(*g2.shape):
            # dx = rstd * (dxhat - xhat * mean(dxhat * xhat)),  dxhat = g * w
            d = np.multiply(g2[r], w, out=dx[r])
            c = np.einsum("ni,ni->n", d, xhat[r])[:, None] * (1.0 / C)
            d -= xhat[r] * c
            d *= rstd[r]
        return store(dx.reshape(g.shape), self.dtype), dw, None


# --- the rotary position embedding -----------------------------------------------------------

def rope_angles(positions, hs: int, theta: float) -> np.ndarray:
    """(t, hs/2) angles pos * theta^(-2j/hs), j = 0 .. hs/2 - 1, in float64 (Hugging Face
    builds the same table in float32)."""
    if hs % 2:
        raise ValueError(f"the rotary embedding turns pairs of channels: head size {hs} is odd")
    inv_freq = 1.0 / theta ** (np.arange(0, hs, 2, dtype=np.float64) / hs)     # (hs/2,)
    return np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]


_TABLES: dict = {}


def _tables(positions, hs: int, n: int, theta: float, dtype):
    """RoPE's tables for n heads side by side, each (t, n hs) in the compute dtype, and the
    swap of each head's halves, cached per positions and shape: cos repeated on both halves,
    sin with the first half negated (so that x cos + swap(x) sin is the turn), and the index
    that swaps a head's halves (rotate_half without its sign)."""
    key = (np.asarray(positions).tobytes(), len(positions), hs, n, float(theta), np.dtype(dtype))
    if key not in _TABLES:
        if len(_TABLES) > 64:                              # a few layouts per process at most
            _TABLES.clear()
        a = rope_angles(positions, hs, theta)
        cos, sin = np.cos(a), np.sin(a)
        cos_full = np.tile(np.concatenate([cos, cos], -1), n).astype(dtype)            # (t, n hs)
        sin_signed = np.tile(np.concatenate([-sin, sin], -1), n).astype(dtype)
        h = hs // 2
        swap = np.concatenate([np.arange(h, hs), np.arange(h)])
        _TABLES[key] = (cos_full, sin_signed, (np.arange(n)[:, None] * hs + swap).ravel())
    return _TABLES[key]


class RoPEReference:
    """q and k of the packed qkv (B, t, (H + 2 Hkv) hs) turned by `positions` (t,), as written:
    x cos + rotate_half(x) sin with the (t, hs) tables cat(cos, cos), cat(sin, sin)."""

    @staticmethod
    def forward(qkv, positions, n_head, n_kv_head=None, theta=10000.0):
        B, t, width = qkv.shape
        H, Hkv, hs = head_counts(width, n_head, n_kv_head)
        a = rope_angles(positions, hs, theta)
        cos = np.concatenate([np.cos(a), np.cos(a)], -1)[:, None, :]      # (t, 1, hs)
        sin = np.concatenate([np.sin(a), np.sin(a)], -1)[:, None, :]

        def rotate_half(x):                                               # (x1, x2) -> (-x2, x1)
            return np.concatenate([-x[..., hs // 2:], x[..., :hs // 2]], -1)

        qk = qkv[..., :(H + Hkv) * hs].reshape(B, t, H + Hkv, hs)
        out = qkv.copy()
        out[..., :(H + Hkv) * hs] = (qk * cos + rotate_half(qk) * sin).reshape(B, t, -1)
        return out, (cos, sin, H + Hkv, hs)

    @staticmethod
    def backward(dout, cache):
        cos, sin, n, hs = cache
        B, t, _ = dout.shape
        g = dout[..., :n * hs].reshape(B, t, n, hs)
        gs = g * sin
        # rotate_half is a signed permutation; its transpose maps (y1, y2) -> (y2, -y1)
        dqk = g * cos + np.concatenate([gs[..., hs // 2:], -gs[..., :hs // 2]], -1)
        dx = dout.copy()
        dx[..., :n * hs] = dqk.reshape(B, t, -1)
        return dx


class RoPE(Function):
    """The rotary embedding on the packed projection, all q and k heads at once on contiguous
    rows: y = x cos + swap(x) sin, with per-head tables (t, n hs) cached per positions (sin's
    first half negated, swap the halves of each head). It is linear, y = A x with A = cos +
    sin_signed swap, and swap is its own transpose, so backward is dx = g cos + swap(g sin_signed):
    dx1 = g1 cos + g2 sin, dx2 = g2 cos - g1 sin, the turn by minus the angle. Plain: RoPEReference."""

    def forward(self, qkv, positions, n_head, n_kv_head=None, theta=10000.0):
        self.dtype, qkv = qkv.dtype, compute(qkv)
        B, t, width = qkv.shape
        H, Hkv, hs = head_counts(width, n_head, n_kv_head)
        if hs % 2:
            raise ValueError(f"the rotary embedding turns pairs of channels: head size {hs} is odd")
        self.tables, self.m = _tables(positions, hs, H + Hkv, theta, qkv.dtype), (H + Hkv) * hs
        cos, sin, swap = self.tables
        out = np.empty_like(qkv)
        out[..., self.m:] = qkv[..., self.m:]                             # v passes through
        x, y = qkv[..., :self.m], out[..., :self.m]
        np.multiply(x, cos, out=y)
        turned = np.take(x, swap, axis=-1)
        turned *= sin
        y += turned
        return store(out, self.dtype)

    def backward(self, g):
        g = compute(g)
        cos, sin, swap = self.tables
        dx = np.empty_like(g)
        dx[..., self.m:] = g[..., self.m:]
        x, y = g[..., :self.m], dx[..., :self.m]
        np.multiply(x, cos, out=y)
        y += np.take(x * sin, swap, axis=-1)
        return store(dx, self.dtype), None, None, None, None


# --- SwiGLU ----------------------------------------------------------------------------------

class SwiGLUReference:
    """silu(a) * b of the packed [a | b] (..., 2F) -> (..., F), silu(a) = a / (1 + e^-a)."""

    @staticmethod
    def forward(gu):
        a, b = np.split(gu, 2, axis=-1)
        s = 1.0 / (1.0 + np.exp(-a))                                      # sigmoid(a)
        return a * s * b, (a, b, s)

    @staticmethod
    def backward(dout, cache):
        a, b, s = cache
        da = dout * b * (s + a * s * (1.0 - s))                           # silu'(a) = s (1 + a (1 - s))
        db = dout * a * s
        return np.concatenate([da, db], axis=-1)


class SwiGLU(Function):
    """silu(gate) * up of the packed projection (..., 2F) = [gate | up] -> (..., F): one GEMM
    made both halves (the fused gate/up of Megatron-LM), this op is the rest. Rows in
    cache-sized blocks, temporaries in `out=` buffers; keeps the input and sigmoid(gate).
    Plain: SwiGLUReference above."""

    def forward(self, gu):
        self.dtype = gu.dtype
        F = gu.shape[-1] // 2
        x2 = compute(gu).reshape(-1, 2 * F)                                # (N, 2F)
        s = np.empty((x2.shape[0], F), dtype=x2.dtype)
        y = np.empty_like(s)
        for r in _row_blocks(x2.shape[0], 2 * F):
            a, b, sr = x2[r, :F], x2[r, F:], s[r]
            np.negative(a, out=sr)
            np.exp(sr, out=sr)
            sr += 1.0
            np.reciprocal(sr, out=sr)                                      # sigmoid(a)
            np.multiply(a, sr, out=y[r])
            y[r] *= b
        self.save(x2, s)
        return store(y.reshape(*gu.shape[:-1], F), self.dtype)

    def backward(self, g):
        x2, s = self.saved
        F = s.shape[1]
        g2 = compute(g).reshape(-1, F)
        d = np.empty_like(x2)
        for r in _row_blocks(x2.shape[0], 2 * F):
            a, b, sr, gr = x2[r, :F], x2[r, F:], s[r], g2[r]
            da, db = d[r, :F], d[r, F:]
            np.multiply(a, sr, out=db)                                     # silu(a)
            np.subtract(1.0, sr, out=da)
            da *= db                                                       # a s (1 - s)
            da += sr                                                       # silu'(a)
            da *= b
            da *= gr
            db *= gr
        return store(d.reshape(*g.shape[:-1], 2 * F), self.dtype)


# --- the functional API ----------------------------------------------------------------------

def rms_norm(x, w, eps: float = 1e-6):
    return RMSNorm.apply(x, w, eps)


def rope(qkv, positions, n_head: int, n_kv_head: int | None = None, theta: float = 10000.0):
    """qkv (B, t, (H + 2 Hkv) hs) with q and k turned by positions (t,) (global positions:
    a context-parallel rank passes its own)."""
    return RoPE.apply(qkv, np.asarray(positions), n_head, n_kv_head, theta)


def swiglu(gu):
    return SwiGLU.apply(gu)
