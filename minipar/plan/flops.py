"""FLOPs per device, by formula.

FLOPs of a forward pass over one sequence of T tokens, the count of Hoffmann et al.
2022 (arXiv:2203.15556, "Chinchilla", appendix F), C channels, H heads, V vocabulary, 4C MLP width:
    embeddings 2TVC;  per layer: K,Q,V projections 2*3TCC, key-query logits 2TTC,
    softmax 3HTT, softmax-value reduction 2TTC, final linear 2TCC, dense block 2T(4CC + 4CC);
    final logits 2TCV.   backward = 2 x forward;  6ND beside it (N params, D = B*T).
A Llama block (--arch llama) is the same count with its own matrices: K and V have Hkv heads
of hs = C/H channels (grouped-query attention), so the projections are 2TC(C + 2 Hkv hs), and
the dense block is SwiGLU's gate, up and down, 2T(3CF) for an MLP F wide (mlp_weights).
All but the embeddings (a row lookup in minipar) and the softmax are matmuls that minipar
runs exactly so (the T x T products in full, masked afterwards); 3x their sum is
model.train_flops_per_token. Per device: the stage's layers (all its chunks' with
--virtual-stages: schedules.rank_layers; embeddings on the first, logits on the last), / tp
(heads, MLP columns, Vp/tp vocabulary rows; a tp rank's key/value heads are
context_parallel.kv_width's, one head copied on each rank when tp > Hkv), B/dp sequences.
"""
from __future__ import annotations

import dataclasses
import math

from minipar.autograd import recompute
from minipar.model.gpt import GPTConfig, param_specs
from minipar.parallel.context import context_parallel
from minipar.plan.layout import rank_layer_count, rank_moe_count


def mlp_weights(cfg: GPTConfig) -> int:
    """Elements of a dense block's MLP matrices (param_specs): GPT-2's c_fc and c_proj, 2CF
    (8C^2), Llama's gate, up and down, 3CF."""
    block = cfg.family.block_prefix(0) + "mlp."
    one = dataclasses.replace(cfg, n_layer=1, moe_experts=0)
    return sum(math.prod(shape) for name, shape, _ in param_specs(one) if name.startswith(block) and len(shape) == 2)


def expert_weights(cfg: GPTConfig) -> int:
    """Elements of one expert's matrices (its family's expert_specs): GPT-2's MLP, 8C^2;
    Llama's w1, w3, w2, 3 C F_e (F_e = expert_hidden)."""
    return sum(math.prod(shape) for _, shape, _ in cfg.family.expert_specs(cfg, "") if len(shape) == 2)


def flop_components(cfg: GPTConfig, tp: int = 1, stage: int = 0, pp: int = 1, n_chunks: int = 1,
                    cp: int = 1) -> dict:
    """The Chinchilla appendix F forward FLOPs of one sequence, by component, on one device of
    `stage` (with n_chunks: its chunks' blocks; rank 0 holds virtual stage 0, rank pp-1 pV-1).
    cp: the device's Tq = T/cp query rows of each product, against all T keys.
    A MoE block's dense block is its K active experts' (each token through K expert MLPs;
    Llama's also through its moe_shared_experts, every expert F_e wide: expert_weights)
    plus the router's logits, 2 T C E: replicated over tp, so not divided by it; with --ep a
    device runs K experts' rows per token on average (balanced routing), the same count."""
    T, C, H, V = cfg.block_size, cfg.n_embd, cfg.n_head, cfg.vocab_size
    Tq = T // cp                                          # this device's tokens (queries)
    Vl = V if tp == 1 else -(-V // tp)                    # vocabulary rows on this device
    L = rank_layer_count(cfg, stage, pp, n_chunks)
    n_moe = rank_moe_count(cfg, stage, pp, n_chunks)
    first, last = stage == 0, stage == pp - 1
    q, kv = C // tp, context_parallel.kv_width(cfg, tp)   # the device's query and key (value) channels
    mlp = 2 * Tq * mlp_weights(cfg)                       # one MLP on the device's tokens
    out = {
        "embeddings": 2 * Tq * Vl * C if first else 0,
        "kqv_projections": L * 2 * Tq * C * (q + 2 * kv),
        "key_query_logits": L * 2 * Tq * T * C // tp,
        "softmax": L * 3 * (H // tp) * Tq * T,
        "softmax_value": L * 2 * Tq * T * C // tp,
        "final_linear": L * 2 * Tq * q * C,
        "dense": (L - n_moe) * mlp // tp,
    }
    if cfg.moe_experts:                                   # K routed + the shared experts, each expert_weights
        active = cfg.moe_top_k + cfg.moe_shared_experts
        out.update(experts=n_moe * active * 2 * Tq * expert_weights(cfg), router=n_moe * 2 * Tq * C * cfg.moe_experts)
    out["logits"] = 2 * Tq * C * Vl if last else 0
    return out


def flops(components: dict, sequences: int) -> dict:
    """Forward, backward (2x forward) and total FLOPs of `sequences` sequences; the matmul
    part of the forward (all but the embeddings and the softmax); the components."""
    fwd = sequences * sum(components.values())
    matmul = fwd - sequences * (components["embeddings"] + components["softmax"])
    return {"forward": fwd, "backward": 2 * fwd, "total": 3 * fwd, "matmul_forward": matmul,
            "components": {k: sequences * v for k, v in components.items()}}


def recompute_flops(cfg: GPTConfig, lay) -> int:
    """What --recompute runs again in one step: selective the Q K^T of every layer
    (recompute.added_flops), full every block's forward: the blocks' matmuls of
    flop_components (a MoE block's K experts and router included) for the B sequences."""
    if lay.recompute != "full":
        return recompute.added_flops(cfg.n_layer, lay.batch_size, cfg.block_size, cfg.n_embd, lay.recompute)
    blocks = {k: v for k, v in flop_components(cfg).items() if k not in ("embeddings", "softmax", "logits")}
    return lay.batch_size * sum(blocks.values())
