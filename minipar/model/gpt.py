"""GPT-2, single process: the model every parallel layout is checked against.

    x = wte[idx] + wpe[0:t]                                  # (B, t, C)
    for each block:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
    logits = ln_f(x) @ wte.T      (untied: @ lm_head.weight.T) # (B, t, V)
    loss = mean cross-entropy over every position of the global batch

Parameters carry the canonical GPT-2 / Hugging Face names and shapes of docs/design.md §2,
weights stored (in, out). Each is drawn from its own generator seeded by (seed, name), so
a shard on any dp/tp/pp layout is a slice of the very same full tensor.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass

import numpy as np

from minipar.model import moe
from minipar.autograd import ops
from minipar.model.contract import Model, Parts
from minipar.autograd.tensor import Tensor, no_grad


@dataclass
class GPTConfig:
    vocab_size: int = 256        # V: byte-level tokens
    block_size: int = 64         # T: longest context
    n_layer: int = 4             # L: transformer blocks
    n_head: int = 4              # H: attention heads
    n_embd: int = 128            # C: channels; head size C/H
    tie_embeddings: bool = True  # logits use wte.T (GPT-2) or a separate lm_head.weight
    moe_experts: int = 0         # E > 0: every moe_every-th block's MLP is E experts (moe.py)
    moe_top_k: int = 2           # K experts per token
    moe_every: int = 1           # block i is a MoE block when (i + 1) % moe_every == 0
    moe_capacity_factor: float = 0.0   # F: slots per expert ceil(F N K / E); 0: no dropping

    def validate(self):
        for field in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}")
        if self.moe_experts < 0 or self.moe_every < 1 or self.moe_capacity_factor < 0:
            raise ValueError(f"moe_experts {self.moe_experts} must be >= 0, moe_every {self.moe_every} >= 1, "
                             f"moe_capacity_factor {self.moe_capacity_factor} >= 0")
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k {self.moe_top_k} must be between 1 and moe_experts {self.moe_experts}")
        return self

    def is_moe(self, i: int) -> bool:
        """Is block i a mixture-of-experts block?"""
        return self.moe_experts > 0 and moe.is_moe_block(i, self.moe_every)

    def to_dict(self) -> dict:
        return asdict(self)


def param_specs(cfg: GPTConfig):
    """[(canonical name, shape, init)] in model order; init is a std, "zeros" or "ones"."""
    V, T, C, L = cfg.vocab_size, cfg.block_size, cfg.n_embd, cfg.n_layer
    proj_std = 0.02 / math.sqrt(2 * L)                     # GPT-2's scaled residual init
    specs = [("wte.weight", (V, C), 0.02), ("wpe.weight", (T, C), 0.02)]
    for i in range(L):
        h = f"h.{i}."
        specs += [
            (h + "ln_1.weight", (C,), "ones"), (h + "ln_1.bias", (C,), "zeros"),
            (h + "attn.c_attn.weight", (C, 3 * C), 0.02), (h + "attn.c_attn.bias", (3 * C,), "zeros"),
            (h + "attn.c_proj.weight", (C, C), proj_std), (h + "attn.c_proj.bias", (C,), "zeros"),
            (h + "ln_2.weight", (C,), "ones"), (h + "ln_2.bias", (C,), "zeros"),
        ]
        mlps = [h + "mlp."] if not cfg.is_moe(i) else [h + f"mlp.experts.{e}." for e in range(cfg.moe_experts)]
        if cfg.is_moe(i):
            specs.append((h + "mlp.router.weight", (C, cfg.moe_experts), 0.02))
        for m in mlps:
            specs += [(m + "c_fc.weight", (C, 4 * C), 0.02), (m + "c_fc.bias", (4 * C,), "zeros"),
                      (m + "c_proj.weight", (4 * C, C), proj_std), (m + "c_proj.bias", (C,), "zeros")]
    specs += [("ln_f.weight", (C,), "ones"), ("ln_f.bias", (C,), "zeros")]
    if not cfg.tie_embeddings:
        specs.append(("lm_head.weight", (V, C), 0.02))
    return specs


def init_param(name: str, shape, init, seed: int, dtype=np.float64) -> np.ndarray:
    """The full canonical tensor `name`, identical on every layout: drawn in float64 from
    a generator seeded by (seed, crc32(name)), then cast."""
    if init == "zeros":
        return np.zeros(shape, dtype=dtype)
    if init == "ones":
        return np.ones(shape, dtype=dtype)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(shape) * init).astype(dtype)


def train_flops_per_token(cfg: GPTConfig, t: int | None = None) -> float:
    """Matmul FLOPs of one training token (forward + backward = 3x forward), the numerator
    of MFU. Forward per token: 2 * (weights of every matmul) + attention's two (t x t)
    products, 2 * 2 * t * C per layer (the full square, as computed here)."""
    t = cfg.block_size if t is None else t
    C, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    per_layer = 2 * (3 * C * C + C * C + 8 * C * C) + 2 * 2 * t * C
    # a MoE block: each token through K experts' MLPs (the active ones) and the router
    moe_extra = sum(2 * (8 * C * C * (cfg.moe_top_k - 1) + C * cfg.moe_experts) for i in range(L) if cfg.is_moe(i))
    return 3.0 * (L * per_layer + moe_extra + 2 * C * V)


class GPT(Model):
    """The single-process model. Parameters are leaf Tensors in `self.params`. It knows
    nothing of how it is split: a layout gives it its Parts (model/contract.py), and holds
    only the parameters Parts.holds names."""

    def __init__(self, cfg: GPTConfig, seed: int = 0, dtype=np.float64, parts: Parts = Parts()):
        self.cfg, self.parts = cfg.validate(), parts
        dtype = np.dtype(dtype)
        self.params = {
            name: Tensor(init_param(name, shape, init, seed, dtype), requires_grad=True, name=name)
            for name, shape, init in param_specs(cfg) if parts.holds(name)
        }
        self.full_shapes = {name: tuple(shape) for name, shape, _ in param_specs(cfg)}

    # The Python API of docs/design.md §4 (parameters, state_dict, load_state_dict, the
    # gradient norm) is interfaces.Model's: this whole model holds every tensor whole.

    # --- forward, in pieces that the pipeline can cut between -----------------------------
    def embed(self, idx) -> Tensor:
        idx = np.asarray(idx)
        positions = self.position_ids(idx.shape[-1])                    # 0..t-1 (--cp: its share)
        P = self.params
        tok = ops.embedding(idx, P["wte.weight"])                       # (B, t, C)
        pos = ops.embedding(positions[None, :], P["wpe.weight"])        # (1, t, C)
        return tok + pos

    def block(self, i: int, x: Tensor) -> Tensor:
        P, h = self.params, f"h.{i}."
        a = ops.layer_norm(x, P[h + "ln_1.weight"], P[h + "ln_1.bias"])
        qkv = ops.linear(a, P[h + "attn.c_attn.weight"], P[h + "attn.c_attn.bias"])   # (B, t, 3C)
        y = self.attend(qkv, self.cfg.n_head)                                         # (B, t, C)
        x = x + ops.linear(y, P[h + "attn.c_proj.weight"], P[h + "attn.c_proj.bias"])
        m = ops.layer_norm(x, P[h + "ln_2.weight"], P[h + "ln_2.bias"])
        if self.cfg.is_moe(i):
            return x + self.moe_layer(i, m)
        m = ops.gelu(ops.linear(m, P[h + "mlp.c_fc.weight"], P[h + "mlp.c_fc.bias"]))  # (B, t, 4C)
        return x + ops.linear(m, P[h + "mlp.c_proj.weight"], P[h + "mlp.c_proj.bias"])

    def head(self, x: Tensor) -> Tensor:
        P = self.params
        x = ops.layer_norm(x, P["ln_f.weight"], P["ln_f.bias"])
        w = P["wte.weight"] if self.cfg.tie_embeddings else P["lm_head.weight"]
        return ops.matmul(x, ops.transpose(w))                          # (B, t, V)

    def generate(self, idx, max_new_tokens: int, temperature: float = 0.8, top_k: int | None = 40,
                 rng: np.random.Generator | None = None) -> np.ndarray:
        """Sample continuations of idx (B, t0); returns (B, t0 + max_new_tokens)."""
        rng = rng or np.random.default_rng(0)
        idx = np.array(idx, dtype=np.int64, ndmin=2)
        with no_grad():
            for _ in range(max_new_tokens):
                logits = self(idx[:, -self.cfg.block_size:]).data[:, -1, :].astype(np.float64)
                logits = logits / max(temperature, 1e-6)
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = np.partition(logits, -top_k, axis=-1)[:, -top_k][:, None]
                    logits = np.where(logits < kth, -np.inf, logits)
                p = np.exp(logits - logits.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                nxt = np.array([rng.choice(p.shape[-1], p=row) for row in p])
                idx = np.concatenate([idx, nxt[:, None]], axis=1)
        return idx
