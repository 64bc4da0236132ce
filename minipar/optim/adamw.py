"""AdamW (PyTorch's), global-norm gradient clipping and the learning-rate schedule.

The update itself is a function on plain arrays, `adamw_update`, so that later mechanisms
(ZeRO's flat shards, mixed precision's fp32 master weights) apply exactly the same
arithmetic to whatever slice of the parameters a rank owns. Per parameter p with
gradient g, at step t = 1, 2, ...:

    p -= lr * wd * p                         decoupled weight decay (only ndim >= 2)
    m = b1 m + (1 - b1) g ;  v = b2 v + (1 - b2) g^2
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
"""
from __future__ import annotations

import math

import numpy as np


def adamw_update(p, g, m, v, step: int, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay=0.0, chunk: int = 65536, grad_scale: float = 1.0):
    """One AdamW step in place on contiguous arrays p, m, v (g any layout). step counts
    from 1. weight_decay is a float, or an array broadcastable to p (0 where a parameter is
    not decayed). grad_scale multiplies g (gradient clipping's factor, mixed precision's
    unscaling) inside the two passes that read g, instead of in a pass of its own.

    The arrays are walked in chunks of `chunk` elements so that the elementwise passes of
    each chunk run in cache (2-3x faster on large models). The bias corrections are folded
    into two scalars, the same quantity as the module docstring's:
        lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps) = k * m / (sqrt(v) + eps * sqrt(bc2)),
        k = lr * sqrt(bc2) / bc1."""
    b1, b2 = betas
    bc1 = 1.0 - b1 ** step
    bc2 = 1.0 - b2 ** step
    k, eps_hat = lr * math.sqrt(bc2) / bc1, eps * math.sqrt(bc2)
    gm, gv = (1.0 - b1) * grad_scale, (1.0 - b2) * grad_scale * grad_scale
    pf, mf, vf = p.reshape(-1), m.reshape(-1), v.reshape(-1)
    gf = np.ascontiguousarray(g).reshape(-1)
    wdf = np.broadcast_to(weight_decay, p.shape).reshape(-1) if np.ndim(weight_decay) else None
    t1 = np.empty(min(chunk, pf.size), dtype=pf.dtype)     # scratch, reused by every chunk
    t2 = np.empty_like(t1)
    for lo in range(0, pf.size, chunk):
        r = slice(lo, lo + chunk)
        pc, gc, mc, vc = pf[r], gf[r], mf[r], vf[r]
        a, b = t1[:pc.size], t2[:pc.size]
        if wdf is not None:
            pc *= 1.0 - lr * wdf[r]
        elif weight_decay:
            pc *= 1.0 - lr * weight_decay
        mc *= b1
        mc += np.multiply(gc, gm, out=a)                    # m = b1 m + (1 - b1) s g
        vc *= b2
        np.multiply(gc, gc, out=a)
        a *= gv
        vc += a                                             # v = b2 v + (1 - b2) s^2 g^2
        np.sqrt(vc, out=b)
        b += eps_hat
        np.divide(mc, b, out=b)
        b *= k
        pc -= b


class AdamW:
    """torch.optim.AdamW on minipar Tensors. Weight decay applies to parameters with two or
    more dimensions (weights and embeddings), never to biases or LayerNorm gains. One step
    count serves every parameter (PyTorch keeps one per parameter; they differ only for a
    parameter that sometimes has no gradient, which never happens in GPT)."""

    scaler = None             # no loss scaling (MixedPrecisionAdamW has one)

    def __init__(self, params, lr: float = 3e-4, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1):
        self.params = list(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.step_count = 0
        self.m = [np.zeros_like(p.data) for p in self.params]
        self.v = [np.zeros_like(p.data) for p in self.params]

    def step(self, grad_scale: float = 1.0):
        """grad_scale: every gradient counts as grad_scale * p.grad (the clip factor: the
        trainer clips here, in AdamW's own passes, instead of rewriting p.grad)."""
        self.step_count += 1
        for p, m, v in zip(self.params, self.m, self.v):
            if p.grad is None:
                continue
            wd = self.weight_decay if p.data.ndim >= 2 else 0.0
            adamw_update(p.data, p.grad, m, v, self.step_count, self.lr, self.betas, self.eps, wd,
                         grad_scale=grad_scale)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def state_bytes(self) -> int:
        return sum(a.nbytes for a in self.m) + sum(a.nbytes for a in self.v)

    def state_dict(self) -> dict:
        """{'step': n, 'm.{i}': ..., 'v.{i}': ...} in parameter order (names added by the caller)."""
        out = {"step": np.asarray(self.step_count)}
        for i, (m, v) in enumerate(zip(self.m, self.v)):
            out[f"m.{i}"], out[f"v.{i}"] = m.copy(), v.copy()
        return out

    def load_state_dict(self, state: dict):
        for i, (m, v) in enumerate(zip(self.m, self.v)):
            for key, dst in ((f"m.{i}", m), (f"v.{i}", v)):
                if key not in state:
                    raise ValueError(f"optimizer state has no {key!r}")
                if state[key].shape != dst.shape:
                    raise ValueError(f"optimizer state {key}: shape {state[key].shape} != {dst.shape}")
        self.step_count = int(state["step"])
        for i, (m, v) in enumerate(zip(self.m, self.v)):
            m[...], v[...] = state[f"m.{i}"], state[f"v.{i}"]


def sum_of_squares(g: np.ndarray, chunk: int = 65536) -> float:
    """sum(g**2) in float64, chunk by chunk: a float32 gradient is widened one cache-sized
    piece at a time instead of as a whole float64 copy (2x its size in memory traffic)."""
    flat = np.ascontiguousarray(g).reshape(-1)
    if flat.dtype == np.float64:
        return float(flat @ flat)
    total = 0.0
    for i in range(0, flat.size, chunk):
        c = flat[i:i + chunk].astype(np.float64)
        total += float(c @ c)
    return total


def grad_norm(grads) -> float:
    """Global L2 norm of a list of gradient arrays (None entries skipped)."""
    return math.sqrt(sum(sum_of_squares(g) for g in grads if g is not None))


def clip_coef(total_norm: float, max_norm: float) -> float:
    """PyTorch's clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def clip_grad_norm(params, max_norm: float) -> float:
    """Clip the gradients of `params` in place to global norm max_norm (0 disables);
    returns the norm before clipping."""
    total = grad_norm([p.grad for p in params])
    c = clip_coef(total, max_norm)
    if c < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad *= c
    return total


def lr_at(step: int, base_lr: float, schedule: str = "constant", warmup: int = 0,
          total_steps: int = 1, min_lr: float = 0.0) -> float:
    """Learning rate for 0-based `step`: linear warm-up over `warmup` steps, then constant
    or cosine decay from base_lr to min_lr at total_steps."""
    if warmup > 0 and step < warmup:
        return base_lr * (step + 1) / warmup
    if schedule == "constant":
        return base_lr
    if schedule != "cosine":
        raise ValueError(f"unknown lr schedule {schedule!r} (constant, cosine)")
    span = max(1, total_steps - warmup)
    frac = min(1.0, max(0.0, (step - warmup) / span))
    return min_lr + 0.5 * (base_lr - min_lr) * (1.0 + math.cos(math.pi * frac))
