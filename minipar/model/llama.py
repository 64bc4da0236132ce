"""The Llama family (Touvron et al. 2023, arXiv:2302.13971 and 2307.09288; Llama 3, arXiv:2407.21783):
python -m minipar.train --arch llama. docs/llama.md.

    x = embed_tokens[idx]                                           (B, t, C), no position table
    for each block:
        a = rmsnorm(x) * input_layernorm
        q, k, v = a Wq, a Wk, a Wv            H query heads, Hkv key/value heads of hs = C/H
        q, k = rope(q, pos), rope(k, pos)     turned by their positions (llama_ops.rope)
        x = x + attention(q, k, v) Wo         grouped-query: query head h reads kv head h // (H/Hkv)
        m = rmsnorm(x) * post_attention_layernorm
        x = x + (silu(m Wgate) * (m Wup)) Wdown                     SwiGLU, F = cfg.hidden
    logits = (rmsnorm(x) * norm) lm_head^T      (tied: embed_tokens^T)

No biases anywhere. The parameters are Hugging Face's LlamaForCausalLM's without the `model.`
prefix (layers.0.self_attn.q_proj.weight, ...), the projections stored (in, out): the
transpose of Hugging Face's (out, in), which the converter (minipar/convert) undoes.

The forward multiplies by [Wq | Wk | Wv] and by [Wgate | Wup] of the rank's own shards, each one
GEMM after one f of tensor parallelism, as Megatron-LM fuses them (ops.linear on a list of column
pieces: the joined matrix is made for the GEMM and never kept). The trap is the fused qkv's:
cutting a fused [gate | up] into tp contiguous column blocks would give rank 0 all of gate and
rank 1 all of up; a rank's fused matrix must be [gate_r | up_r], its own columns of each
(tests/mpi/test_llama_parallel.py plants the wrong cut).
"""
from __future__ import annotations

from minipar.autograd import llama_ops, ops
from minipar.model.config import llama_hidden
from minipar.model.family import Family


class Llama(Family):
    """Llama: RMSNorm, rotary positions, grouped-query attention, SwiGLU, no biases."""

    name, embedding, positions, block_word = "llama", "embed_tokens.weight", None, "layers"
    final_names = ("norm.weight",)
    moe_word, router_word = "block_sparse_moe", "gate"             # Mixtral's names

    def check(self, cfg):
        if cfg.head_size % 2:
            raise ValueError(f"the rotary embedding turns pairs of channels: head size n_embd/n_head = "
                             f"{cfg.n_embd}/{cfg.n_head} = {cfg.head_size} must be even")

    def describe(self, cfg) -> str:
        return (f"Llama L={cfg.n_layer} H={cfg.n_head} Hkv={cfg.kv_heads} C={cfg.n_embd} F={cfg.hidden} "
                f"theta={cfg.rope_theta:g}")

    def default_hidden(self, cfg) -> int:
        return llama_hidden(cfg.n_embd, cfg.ffn_multiplier, cfg.multiple_of)

    def param_specs(self, cfg):
        V, C, L, F = cfg.vocab_size, cfg.n_embd, cfg.n_layer, cfg.hidden
        q, kv = cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
        specs = [("embed_tokens.weight", (V, C), 0.02)]                   # Hugging Face's init: N(0, 0.02)
        for i in range(L):
            h = self.block_prefix(i)
            specs += [
                (h + "input_layernorm.weight", (C,), "ones"),
                (h + "self_attn.q_proj.weight", (C, q), 0.02), (h + "self_attn.k_proj.weight", (C, kv), 0.02),
                (h + "self_attn.v_proj.weight", (C, kv), 0.02), (h + "self_attn.o_proj.weight", (q, C), 0.02),
                (h + "post_attention_layernorm.weight", (C,), "ones"),
            ]
            specs += self.moe_specs(cfg, i) if cfg.is_moe(i) else [
                (h + "mlp.gate_proj.weight", (C, F), 0.02), (h + "mlp.up_proj.weight", (C, F), 0.02),
                (h + "mlp.down_proj.weight", (F, C), 0.02)]
        specs.append(("norm.weight", (C,), "ones"))
        if not cfg.tie_embeddings:
            specs.append(("lm_head.weight", (V, C), 0.02))
        return specs

    def expert_specs(self, cfg, prefix: str) -> list:
        """A Mixtral expert: w1 (gate) and w3 (up) (C, F_e), w2 (down) (F_e, C), F_e = expert_hidden."""
        C, F = cfg.n_embd, cfg.expert_hidden
        return [(prefix + "w1.weight", (C, F), 0.02), (prefix + "w3.weight", (C, F), 0.02),
                (prefix + "w2.weight", (F, C), 0.02)]

    def expert_mlp(self, P: dict, prefix: str, x):
        """(silu(x w1) * (x w3)) w2: SwiGLU, the fused [w1 | w3] one GEMM."""
        gu = ops.linear(x, [P[prefix + "w1.weight"], P[prefix + "w3.weight"]])
        return ops.linear(llama_ops.swiglu(gu), P[prefix + "w2.weight"])

    def split_kind(self, name: str) -> str:
        """A MoE block's router and experts are replicated over tp, as GPT-2's are (docs/moe.md)."""
        if f".{self.moe_word}." in name:
            return "replicated"
        if name in ("embed_tokens.weight", "lm_head.weight"):
            return "vocab"
        if name.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")):
            return "column"
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            return "kv"
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return "row"
        return "replicated"

    # --- the forward, against the layout's layers (model.split) -----------------------------
    def embed(self, m, idx):
        s = m.split
        return s.tokens(s.check_ids(idx, m.cfg), m.params["embed_tokens.weight"])        # (B, t, C)

    def block(self, m, i: int, x):
        P, h, s, cfg = m.params, self.block_prefix(i), m.split, m.cfg
        r, eps = s.replicated, cfg.norm_eps
        H, Hkv = s.heads(cfg.n_head), s.kv_heads(cfg)
        a = llama_ops.rms_norm(x, r(P[h + "input_layernorm.weight"]), eps)
        w = [P[h + "self_attn.q_proj.weight"], s.kv(P[h + "self_attn.k_proj.weight"]),
             s.kv(P[h + "self_attn.v_proj.weight"])]                                 # [q_r | k_r | v_r]
        qkv = s.column(a, w)                                                          # (B, t, (H' + 2 Hkv') hs)
        qkv = llama_ops.rope(qkv, m.position_ids(qkv.shape[1]), H, Hkv, cfg.rope_theta)
        x = x + s.row(m.attend(qkv, H, Hkv), P[h + "self_attn.o_proj.weight"])
        u = llama_ops.rms_norm(x, r(P[h + "post_attention_layernorm.weight"]), eps)
        if cfg.is_moe(i):
            return x + m.moe_layer(i, u)
        gu = s.column(u, [P[h + "mlp.gate_proj.weight"], P[h + "mlp.up_proj.weight"]])
        return x + s.row(llama_ops.swiglu(gu), P[h + "mlp.down_proj.weight"])       # (B, t, F/tp) inside

    def final(self, m, x):
        s = m.split
        x = llama_ops.rms_norm(x, s.replicated(m.params["norm.weight"]), m.cfg.norm_eps)
        return s.logits(x, m.params[self.head_weight(m.cfg)])

    def train_flops_per_token(self, cfg, t: int | None = None) -> float:
        """Matmul FLOPs of one training token (3x the forward's): per layer 2 x the weights of
        q, k, v, o (k and v Hkv/H of q's) and of SwiGLU's three matrices, and attention's two
        (t x t) products over the H query heads; the head 2 C V. A MoE block: its router, and
        the token's K routed experts and every shared expert (the active ones), of F_e each."""
        t = cfg.block_size if t is None else t
        C, L, V, F, Fe = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.hidden, cfg.expert_hidden
        q, kv = cfg.n_head * cfg.head_size, cfg.kv_heads * cfg.head_size
        attention = 2 * (C * q + 2 * C * kv + q * C) + 2 * 2 * t * q
        mlp = [2 * (C * cfg.moe_experts + (cfg.moe_top_k + cfg.moe_shared_experts) * 3 * C * Fe) if cfg.is_moe(i)
               else 2 * 3 * C * F for i in range(L)]
        return 3.0 * (L * attention + sum(mlp) + 2 * C * V)


FAMILY = Llama()
