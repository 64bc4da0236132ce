"""GPT-2's family, and GPT: the single-process model of either family, the model every
parallel layout is checked against.

    x = wte[idx] + wpe[0:t]                                  # (B, t, C)
    for each block:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
    logits = ln_f(x) @ wte.T      (untied: @ lm_head.weight.T) # (B, t, V)
    loss = mean cross-entropy over every position of the global batch

Parameters carry the canonical GPT-2 / Hugging Face names and shapes of docs/design.md §2,
weights stored (in, out). Each is drawn from its own generator seeded by (seed, name), so
a shard on any dp/tp/pp layout is a slice of the very same full tensor. The Llama family is
model/llama.py; `param_specs` and `train_flops_per_token` below answer for either.
"""
from __future__ import annotations

import math

import numpy as np

from minipar.autograd import ops
from minipar.autograd.tensor import Tensor, no_grad
from minipar.model.config import GPTConfig, init_param  # noqa: F401 - the kept import path
from minipar.model.contract import Model, Parts
from minipar.model.family import Family


class GPT2(Family):
    """GPT-2 (Radford et al. 2019): learned positions, LayerNorm, fused qkv, GELU MLP, biases."""

    name, embedding, positions, block_word = "gpt2", "wte.weight", "wpe.weight", "h"
    final_names = ("ln_f.weight", "ln_f.bias")
    moe_word, router_word = "mlp", "router"

    def check(self, cfg):
        if cfg.kv_heads != cfg.n_head or cfg.ffn_hidden not in (0, 4 * cfg.n_embd):
            raise ValueError(f"gpt2 has n_head key/value heads and an MLP of 4 x n_embd: n_kv_head "
                             f"{cfg.n_kv_head} and ffn_hidden {cfg.ffn_hidden} are Llama's settings")
        if cfg.moe_shared_experts or cfg.moe_ffn_hidden not in (0, 4 * cfg.n_embd):
            raise ValueError(f"gpt2's experts are its MLP: moe_shared_experts {cfg.moe_shared_experts} and "
                             f"moe_ffn_hidden {cfg.moe_ffn_hidden} are the Llama family's (DeepSeekMoE) settings")

    def default_hidden(self, cfg) -> int:
        return 4 * cfg.n_embd

    def param_specs(self, cfg):
        V, T, C, L = cfg.vocab_size, cfg.block_size, cfg.n_embd, cfg.n_layer
        proj_std = 0.02 / math.sqrt(2 * L)                     # GPT-2's scaled residual init
        specs = [("wte.weight", (V, C), 0.02), ("wpe.weight", (T, C), 0.02)]
        for i in range(L):
            h = self.block_prefix(i)
            specs += [
                (h + "ln_1.weight", (C,), "ones"), (h + "ln_1.bias", (C,), "zeros"),
                (h + "attn.c_attn.weight", (C, 3 * C), 0.02), (h + "attn.c_attn.bias", (3 * C,), "zeros"),
                (h + "attn.c_proj.weight", (C, C), proj_std), (h + "attn.c_proj.bias", (C,), "zeros"),
                (h + "ln_2.weight", (C,), "ones"), (h + "ln_2.bias", (C,), "zeros"),
            ]
            specs += self.moe_specs(cfg, i) if cfg.is_moe(i) else self.expert_specs(cfg, h + "mlp.", cfg.hidden)
        specs += [("ln_f.weight", (C,), "ones"), ("ln_f.bias", (C,), "zeros")]
        if not cfg.tie_embeddings:
            specs.append(("lm_head.weight", (V, C), 0.02))
        return specs

    def expert_specs(self, cfg, prefix: str, F: int | None = None) -> list:
        """An MLP (the dense block's, or an expert's) of width F (default: an expert's): c_fc
        (C, F), c_proj (F, C), their biases."""
        C, F = cfg.n_embd, F or cfg.expert_hidden
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        return [(prefix + "c_fc.weight", (C, F), 0.02), (prefix + "c_fc.bias", (F,), "zeros"),
                (prefix + "c_proj.weight", (F, C), proj_std), (prefix + "c_proj.bias", (C,), "zeros")]

    def expert_mlp(self, P: dict, prefix: str, x):
        """c_proj(gelu(c_fc(x))): the dense block's MLP with an expert's own weights."""
        h = ops.gelu(ops.linear(x, P[prefix + "c_fc.weight"], P[prefix + "c_fc.bias"]))
        return ops.linear(h, P[prefix + "c_proj.weight"], P[prefix + "c_proj.bias"])

    def split_kind(self, name: str) -> str:
        """A MoE block's router and experts are replicated: every tp rank runs the whole MoE
        layer on the (replicated) activations, so each computes their full gradient (docs/moe.md)."""
        if ".mlp.experts." in name or name.endswith("mlp.router.weight"):
            return "replicated"
        if name in ("wte.weight", "lm_head.weight"):
            return "vocab"
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
            return "qkv"
        if name.endswith("mlp.c_fc.weight") or name.endswith("mlp.c_fc.bias"):
            return "column"
        if name.endswith("c_proj.weight"):
            return "row"
        return "replicated"

    # --- the forward, against the layout's layers (model.split) -----------------------------
    def embed(self, m, idx):
        s = m.split
        idx = s.check_ids(idx, m.cfg)
        tok = s.tokens(idx, m.params["wte.weight"])                            # (B, t, C)
        return tok + s.positions(m.params["wpe.weight"], m.position_ids(idx.shape[-1]))

    def block(self, m, i: int, x):
        P, h, s, eps = m.params, self.block_prefix(i), m.split, m.cfg.norm_eps
        r = s.replicated                                   # sequence parallelism sums their gradients
        a = ops.layer_norm(x, r(P[h + "ln_1.weight"]), r(P[h + "ln_1.bias"]), eps)
        qkv = s.column(a, P[h + "attn.c_attn.weight"], P[h + "attn.c_attn.bias"])    # (B, t, 3C/tp)
        y = m.attend(qkv, s.heads(m.cfg.n_head))                                      # (B, t, C/tp)
        x = x + s.row(y, P[h + "attn.c_proj.weight"], r(P[h + "attn.c_proj.bias"]))
        u = ops.layer_norm(x, r(P[h + "ln_2.weight"]), r(P[h + "ln_2.bias"]), eps)
        if m.cfg.is_moe(i):
            return x + m.moe_layer(i, u)
        u = ops.gelu(s.column(u, P[h + "mlp.c_fc.weight"], P[h + "mlp.c_fc.bias"]))   # (B, t, 4C/tp)
        return x + s.row(u, P[h + "mlp.c_proj.weight"], r(P[h + "mlp.c_proj.bias"]))

    def final(self, m, x):
        s = m.split
        x = ops.layer_norm(x, s.replicated(m.params["ln_f.weight"]), s.replicated(m.params["ln_f.bias"]),
                           m.cfg.norm_eps)
        return s.logits(x, m.params[self.head_weight(m.cfg)])                        # (B, t, V/tp)

    def train_flops_per_token(self, cfg, t: int | None = None) -> float:
        """Matmul FLOPs of one training token (forward + backward = 3x forward), the numerator
        of MFU. Forward per token: 2 * (weights of every matmul) + attention's two (t x t)
        products, 2 * 2 * t * C per layer (the full square, as computed here)."""
        t = cfg.block_size if t is None else t
        C, L, V, F = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.hidden
        per_layer = 2 * (3 * C * C + C * C + 2 * C * F) + 2 * 2 * t * C
        # a MoE block: each token through K experts' MLPs (the active ones) and the router
        moe_extra = sum(2 * (2 * C * F * (cfg.moe_top_k - 1) + C * cfg.moe_experts) for i in range(L) if cfg.is_moe(i))
        return 3.0 * (L * per_layer + moe_extra + 2 * C * V)


FAMILY = GPT2()


def param_specs(cfg: GPTConfig):
    """[(canonical name, shape, init)] of cfg's family, in model order; init is a std, "zeros" or "ones"."""
    return cfg.family.param_specs(cfg)


def train_flops_per_token(cfg: GPTConfig, t: int | None = None) -> float:
    """Matmul FLOPs of one training token of cfg's family (forward + backward), MFU's numerator."""
    return cfg.family.train_flops_per_token(cfg, t)


class GPT(Model):
    """The single-process model of either family (cfg.arch). Parameters are leaf Tensors in
    `self.params`. It knows nothing of how it is split: a layout gives it its Parts
    (model/contract.py), and holds only the parameters Parts.holds names. The forward is the
    family's (model/family.py), on one process's layers (contract.Whole)."""

    def __init__(self, cfg: GPTConfig, seed: int = 0, dtype=np.float64, parts: Parts = Parts()):
        self.cfg, self.parts = cfg.validate(), parts
        dtype = np.dtype(dtype)
        self.params = {
            name: Tensor(init_param(name, shape, init, seed, dtype), requires_grad=True, name=name)
            for name, shape, init in param_specs(cfg) if parts.holds(name)
        }
        self.full_shapes = {name: tuple(shape) for name, shape, _ in param_specs(cfg)}

    # The Python API of docs/design.md §4 (parameters, state_dict, load_state_dict, the
    # gradient norm) and the forward are contract.Model's: this model holds every tensor whole.

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
