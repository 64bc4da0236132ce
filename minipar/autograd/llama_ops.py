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


def _tables(positions, hs: int, n: int, width: int, theta: float, dtype):
    """RoPE's tables over a whole packed row, each (t, width) in the compute dtype, cached per
    positions and shape: the n turned heads first, cos repeated on both halves and sin with the
    first half negated (so that x cos + swap(x) sin is the turn, swap exchanging the halves of
    each head: rotate_half without its sign), then cos = 1, sin = 0 on the v columns; and that
    sin with the halves of each head swapped (backward's)."""
    key = (np.asarray(positions).tobytes(), len(positions), hs, n, width, float(theta), np.dtype(dtype))
    if key not in _TABLES:
        if len(_TABLES) > 64:                              # a few layouts per process at most
            _TABLES.clear()
        a = rope_angles(positions, hs, theta)
        cos, sin, rest = np.cos(a), np.sin(a), width - n * hs
        cos_full = np.tile(np.concatenate([cos, cos], -1), n)
        sin_signed = np.tile(np.concatenate([-sin, sin], -1), n)
        cos_full = np.concatenate([cos_full, np.ones((len(a), rest))], -1)
        sin_signed = np.concatenate([sin_signed, np.zeros((len(a), rest))], -1)
        _TABLES[key] = tuple(x.astype(dtype) for x in (cos_full, sin_signed, _swap(sin_signed, hs)))
    return _TABLES[key]


def _swap(x, hs: int):
    """x (..., width) with the two halves of each hs-wide head exchanged, in one copy: each
    half-head is moved whole, as one hs/2-wide item of a void dtype (width % hs == 0)."""
    x = np.ascontiguousarray(x)
    half = np.dtype((np.void, hs // 2 * x.itemsize))
    out = np.empty_like(x)
    pairs = (*x.shape[:-1], x.shape[-1] // hs, 2)                       # (..., heads, halves)
    np.copyto(out.view(half).reshape(pairs), x.view(half).reshape(pairs)[..., ::-1])
    return out


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
    """The rotary embedding on the packed projection, every head at once on whole contiguous
    rows: y = x cos + swap(x) sin, with tables (t, width) cached per positions (sin's first
    half of each head negated; cos 1 and sin 0 on v), swap exchanging the halves of each head.
    It is linear, y = A x with A = cos + sin_signed swap, and swap is its own transpose, so
    backward is dx = g cos + swap(g sin_signed): dx1 = g1 cos + g2 sin, dx2 = g2 cos - g1 sin,
    the turn by minus the angle. Plain: RoPEReference."""

    def forward(self, qkv, positions, n_head, n_kv_head=None, theta=10000.0):
        self.dtype, qkv = qkv.dtype, compute(qkv)
        B, t, width = qkv.shape
        H, Hkv, hs = head_counts(width, n_head, n_kv_head)
        if hs % 2:
            raise ValueError(f"the rotary embedding turns pairs of channels: head size {hs} is odd")
        self.hs, self.m = hs, (H + Hkv) * hs
        self.tables = _tables(positions, hs, H + Hkv, width, theta, qkv.dtype)
        return store(self._turn(qkv, *self.tables[:2]), self.dtype)

    def backward(self, g):
        cos, _, sin_swapped = self.tables
        # A^T = cos + swap sin_signed = cos + sin_swapped swap: the same turn, other tables
        return store(self._turn(compute(g), cos, sin_swapped), self.dtype), None, None, None, None

    def _turn(self, x, cos, sin):
        """x cos + swap(x) sin over whole contiguous rows (v: cos 1, sin 0), then v copied
        exactly (an inf in v stays inf, not inf * 0): four passes and two copies, each with
        long inner loops. (On the q/k columns alone every row is a strided slice, and the
        swap a 4-D view with hs/2-long loops: twice the time.)"""
        x = np.ascontiguousarray(x)
        turned = _swap(x, self.hs)
        turned *= sin
        out = np.multiply(x, cos)
        out += turned
        out[..., self.m:] = x[..., self.m:]                               # v passes through
        return out


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
    made both halves (the fused gate/up of Megatron-LM), this op is the rest. Forward, while
    its input is still in cache, also makes the two factors of the gradient and keeps them,
    silu(gate) and up * silu'(gate) (N x F each, in the storage dtype: the bytes of its input),
    so that backward is two products, d gate = g up silu'(gate), d up = g silu(gate). (Keeping
    the input and making sigmoid(gate) again in backward, as Megatron-LM does on a GPU, costs
    a quarter more here: nine more passes over memory gone cold since the forward.) Rows in
    cache-sized blocks, temporaries in `out=` buffers. Plain: SwiGLUReference above."""

    def forward(self, gu):
        self.dtype = gu.dtype
        F = gu.shape[-1] // 2
        x2 = compute(gu).reshape(-1, 2 * F)                                # (N, 2F)
        N = x2.shape[0]
        y, silu, dsilu = (np.empty((N, F), dtype=x2.dtype) for _ in range(3))
        blocks = _row_blocks(N, F)
        (sig,) = _buffers(blocks, F, x2.dtype, 1)
        for r in blocks:
            a, b, u, t = x2[r, :F], x2[r, F:], silu[r], dsilu[r]
            s = _sigmoid(a, sig[:u.shape[0]])
            np.multiply(a, s, out=u)                                       # silu(a) = a s
            np.multiply(u, b, out=y[r])
            np.subtract(1.0, s, out=t)
            t *= u
            t += s                                                         # silu'(a) = s + a s (1 - s)
            t *= b
        self.save(store(silu, self.dtype), store(dsilu, self.dtype))
        return store(y.reshape(*gu.shape[:-1], F), self.dtype)

    def backward(self, g):
        silu, dsilu = compute(*self.saved)
        N, F = silu.shape
        g2 = compute(g).reshape(-1, F)
        d = np.empty((N, 2 * F), dtype=g2.dtype)
        np.multiply(dsilu, g2, out=d[:, :F])                               # d gate = g up silu'(gate)
        np.multiply(silu, g2, out=d[:, F:])                                # d up = g silu(gate)
        return store(d.reshape(*g.shape[:-1], 2 * F), self.dtype)


def _buffers(blocks, F: int, dtype, k: int):
    """k scratch arrays of one block's rows (none: an expert no token reached has 0 rows)."""
    rows = blocks[0].stop if blocks else 0
    return [np.empty((rows, F), dtype=dtype) for _ in range(k)]


def _sigmoid(a, out):
    """sigmoid(a) = (1 + tanh(a/2)) / 2 into out: NumPy's float32 tanh takes half the time of
    its exp (1 / (1 + e^-a) would need an exp and a division)."""
    np.multiply(a, 0.5, out=out)
    np.tanh(out, out=out)
    out *= 0.5
    out += 0.5
    return out


# --- the functional API ----------------------------------------------------------------------

def rms_norm(x, w, eps: float = 1e-6):
    return RMSNorm.apply(x, w, eps)


def rope(qkv, positions, n_head: int, n_kv_head: int | None = None, theta: float = 10000.0):
    """qkv (B, t, (H + 2 Hkv) hs) with q and k turned by positions (t,) (global positions:
    a context-parallel rank passes its own)."""
    return RoPE.apply(qkv, np.asarray(positions), n_head, n_kv_head, theta)


def swiglu(gu):
    return SwiGLU.apply(gu)
