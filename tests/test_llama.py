"""The Llama family on one process (model/llama.py), held to a straight-line NumPy forward written
here from the published maths (nothing of minipar's ops): logits and loss at 1e-12 in float64,
every parameter's gradient against central differences of that forward; its names and shapes;
Llama's width rule and the published parameter counts; the configs it refuses."""
import math

import numpy as np
import pytest

from minipar.model import moe
from minipar.model.config import GPTConfig, llama_hidden
from minipar.model.gpt import GPT, param_specs
from minipar.parallel.parallelize import parts
from minipar.autograd.tensor import Tensor  # noqa: F401 - the model's own


def small(**kw):
    base = dict(arch="llama", vocab_size=37, block_size=8, n_layer=2, n_head=4, n_kv_head=2, n_embd=16,
                multiple_of=8, rope_theta=50.0, norm_eps=1e-5)
    return GPTConfig(**{**base, **kw})


# --- the straight-line forward ---------------------------------------------------------------------

def straight_line_loss(P: dict, cfg: GPTConfig, idx: np.ndarray, targets: np.ndarray, aux_coef: float = 0.0):
    """(logits, mean cross-entropy + aux_coef x Mixtral's load-balancing loss) of a Llama, as
    the papers write it, weights (in, out)."""
    B, T = idx.shape
    pooled = {"p": [], "slots": []}
    C, H, Hkv, eps = cfg.n_embd, cfg.n_head, cfg.kv_heads, cfg.norm_eps
    hs = C // H

    def rmsnorm(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    def rotate(x):                                               # (B, T, n, hs), Hugging Face's halves
        freqs = np.arange(T)[:, None] * cfg.rope_theta ** (-np.arange(0, hs, 2) / hs)[None, :]
        cos = np.cos(np.concatenate([freqs, freqs], -1))[None, :, None, :]
        sin = np.sin(np.concatenate([freqs, freqs], -1))[None, :, None, :]
        half = np.concatenate([-x[..., hs // 2:], x[..., :hs // 2]], -1)
        return x * cos + half * sin

    x = P["embed_tokens.weight"][idx]
    for i in range(cfg.n_layer):
        h = f"layers.{i}."
        a = rmsnorm(x, P[h + "input_layernorm.weight"])
        q = rotate((a @ P[h + "self_attn.q_proj.weight"]).reshape(B, T, H, hs))
        k = rotate((a @ P[h + "self_attn.k_proj.weight"]).reshape(B, T, Hkv, hs))
        v = (a @ P[h + "self_attn.v_proj.weight"]).reshape(B, T, Hkv, hs)
        y = np.zeros((B, T, H, hs))
        for head in range(H):
            kv = head // (H // Hkv)                              # grouped-query: repeat_kv
            s = np.einsum("bid,bjd->bij", q[:, :, head], k[:, :, kv]) / math.sqrt(hs)
            s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            y[:, :, head] = p @ v[:, :, kv]
        x = x + y.reshape(B, T, C) @ P[h + "self_attn.o_proj.weight"]
        m = rmsnorm(x, P[h + "post_attention_layernorm.weight"])
        if cfg.is_moe(i):
            x = x + mixtral_moe(P, h + "block_sparse_moe.", cfg, m.reshape(B * T, C), pooled).reshape(B, T, C)
            continue
        g = m @ P[h + "mlp.gate_proj.weight"]
        x = x + (g / (1 + np.exp(-g)) * (m @ P[h + "mlp.up_proj.weight"])) @ P[h + "mlp.down_proj.weight"]
    x = rmsnorm(x, P["norm.weight"])
    logits = x @ P["embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"].T
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    loss = -np.mean(np.take_along_axis(logp, targets[..., None], -1))
    if not pooled["p"]:
        return logits, loss
    # Mixtral's load-balancing loss, as its reference code pools it: over every MoE layer and
    # token, f_e = the top-k slots routed to e / (L N) (summing to k), P_e the mean probability
    f = np.mean(pooled["slots"], axis=0)                     # (E,): over the L N (token, layer) rows
    P_mean = np.mean(pooled["p"], axis=0)
    return logits, loss + aux_coef * cfg.moe_experts * np.sum(f * P_mean)


def mixtral_moe(P, pre, cfg, x, pooled):
    """Mixtral's sparse MoE block, token by token: softmax over all experts, the top k, their
    weights renormalised, SwiGLU experts (w1 gate, w3 up, w2 down); plus every shared expert."""
    E, K = cfg.moe_experts, cfg.moe_top_k

    def expert(q, v):
        g = v @ P[q + "w1.weight"]
        return (g / (1 + np.exp(-g)) * (v @ P[q + "w3.weight"])) @ P[q + "w2.weight"]

    y = np.zeros_like(x)
    for n in range(x.shape[0]):
        z = x[n] @ P[pre + "gate.weight"]
        p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        top = sorted(range(E), key=lambda e: (-p[e], e))[:K]
        w = p[top] / p[top].sum()
        for k, e in enumerate(top):
            y[n] += w[k] * expert(f"{pre}experts.{e}.", x[n])
        for s in range(cfg.moe_shared_experts):
            y[n] += expert(f"{pre}shared_experts.{s}.", x[n])
        pooled["p"].append(p)
        pooled["slots"].append(np.bincount(top, minlength=E))
    return y


def batch(cfg, B=2, seed=0):
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, cfg.vocab_size, size=(B, cfg.block_size + 1))
    return seq[:, :-1], seq[:, 1:]


CONFIGS = {
    "gqa": {},
    "multi-head": dict(n_kv_head=4),
    "multi-query": dict(n_kv_head=1),
    "tied": dict(tie_embeddings=True),
    "given width, theta 1e4": dict(ffn_hidden=20, rope_theta=10000.0, n_layer=1),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_loss_equal_the_straight_line_forward(name):
    cfg = small(**CONFIGS[name])
    model = GPT(cfg, seed=3)
    idx, targets = batch(cfg)
    P = {n: p.data for n, p in model.named_parameters()}
    logits, loss = straight_line_loss(P, cfg, idx, targets)
    np.testing.assert_allclose(model(idx).data, logits, rtol=1e-12, atol=1e-13)
    assert abs(model(idx, targets).item() - loss) <= 1e-12 * abs(loss)


MOE = {
    "mixtral": dict(moe_experts=4, moe_top_k=2),
    "mixtral top-1, every 2nd block": dict(moe_experts=3, moe_top_k=1, moe_every=2, n_layer=3),
    "deepseek: shared and fine-grained": dict(moe_experts=4, moe_top_k=2, moe_shared_experts=1, moe_ffn_hidden=8),
}
AUX = 0.3


def moe_model(cfg, seed):
    return GPT(cfg, seed=seed, parts=parts(moe=moe.settings_of(cfg, aux_coef=AUX)))


@pytest.mark.parametrize("name", list(MOE))
def test_mixture_of_experts_equals_the_straight_line_forward(name):
    """Mixtral's router (softmax over all experts, top k, renormalised), SwiGLU experts, shared
    experts: logits and loss at 1e-12; the load-balancing loss pooled over every MoE layer is
    checked through the gradients below."""
    cfg = small(**MOE[name])
    model = moe_model(cfg, 3)
    idx, targets = batch(cfg)
    P = {n: p.data for n, p in model.named_parameters()}
    logits, loss = straight_line_loss(P, cfg, idx, targets)
    np.testing.assert_allclose(model(idx).data, logits, rtol=1e-12, atol=1e-13)
    assert abs(model(idx, targets).item() - loss) <= 1e-12 * abs(loss)


@pytest.mark.parametrize("name", ["gqa", "multi-query", "tied", *MOE])
def test_every_gradient_equals_central_differences_of_the_straight_line_forward(name):
    """Every tensor's gradient, at 6 entries each, against (L(w + e) - L(w - e)) / 2e of the
    straight-line forward: the model's backward is the derivative of the published maths (with
    experts: of the cross-entropy plus AUX x Mixtral's pooled load-balancing loss)."""
    cfg = small(**{**CONFIGS.get(name, {}), **MOE.get(name, {})})
    model = moe_model(cfg, 4) if name in MOE else GPT(cfg, seed=4)
    aux = AUX if name in MOE else 0.0
    idx, targets = batch(cfg, seed=1)
    model(idx, targets).backward()
    P = {n: p.data.copy() for n, p in model.named_parameters()}
    rng = np.random.default_rng(5)
    eps = 1e-6
    for n, p in model.named_parameters():
        g = p.grad
        assert g is not None and g.shape == p.data.shape, n
        for j in rng.choice(p.data.size, size=min(6, p.data.size), replace=False):
            old = P[n].flat[j]
            P[n].flat[j] = old + eps
            up = straight_line_loss(P, cfg, idx, targets, aux)[1]
            P[n].flat[j] = old - eps
            down = straight_line_loss(P, cfg, idx, targets, aux)[1]
            P[n].flat[j] = old
            num = (up - down) / (2 * eps)
            assert abs(g.flat[j] - num) <= 1e-7 * max(1.0, np.abs(g).max()), (n, j, g.flat[j], num)


def test_names_and_shapes_are_hugging_faces_without_the_model_prefix():
    """LlamaForCausalLM's state dict names, less `model.`; projections stored (in, out), the
    transpose of Hugging Face's nn.Linear (out, in)."""
    cfg = small(n_layer=1, ffn_hidden=24)
    hf = {"model.embed_tokens.weight": (37, 16), "model.layers.0.input_layernorm.weight": (16,),
          "model.layers.0.self_attn.q_proj.weight": (16, 16), "model.layers.0.self_attn.k_proj.weight": (8, 16),
          "model.layers.0.self_attn.v_proj.weight": (8, 16), "model.layers.0.self_attn.o_proj.weight": (16, 16),
          "model.layers.0.post_attention_layernorm.weight": (16,), "model.layers.0.mlp.gate_proj.weight": (24, 16),
          "model.layers.0.mlp.up_proj.weight": (24, 16), "model.layers.0.mlp.down_proj.weight": (16, 24),
          "model.norm.weight": (16,), "lm_head.weight": (37, 16)}
    ours = {n: s for n, s, _ in param_specs(cfg)}
    want = {n.removeprefix("model."): s[::-1] if len(s) == 2 and "proj" in n else s for n, s in hf.items()}
    assert ours == want


@pytest.mark.parametrize("C,mult,of,F", [(4096, 1.0, 256, 11008),       # Llama 2 7B
                                         (5120, 1.0, 256, 13824),       # Llama 2 13B
                                         (8192, 1.3, 4096, 28672),      # Llama 2 70B, Llama 3 70B
                                         (4096, 1.3, 1024, 14336),      # Llama 3 8B
                                         (16384, 1.2, 4096, 53248)])    # Llama 3 405B
def test_llamas_width_rule_gives_the_published_widths(C, mult, of, F):
    assert llama_hidden(C, mult, of) == F


@pytest.mark.parametrize("shape,published", [
    (dict(vocab_size=32000, n_layer=32, n_embd=4096, n_head=32, n_kv_head=32, multiple_of=256), 6_738_415_616),
    (dict(vocab_size=128256, n_layer=32, n_embd=4096, n_head=32, n_kv_head=8, ffn_multiplier=1.3,
          multiple_of=1024), 8_030_261_248),
    (dict(vocab_size=128256, n_layer=80, n_embd=8192, n_head=64, n_kv_head=8, ffn_multiplier=1.3,
          multiple_of=4096), 70_553_706_496),
])
def test_parameter_counts_equal_the_published_ones(shape, published):
    """Llama 2 7B, Llama 3 8B and Llama 3 70B from their configs: Hugging Face's num_parameters()."""
    cfg = GPTConfig(arch="llama", block_size=4096, **shape)
    assert sum(math.prod(s) for _, s, _ in param_specs(cfg)) == published


@pytest.mark.parametrize("kw,match", [
    (dict(n_kv_head=3), "multiple of n_kv_head"),
    (dict(n_embd=12, n_head=4, n_kv_head=1), "must be even"),
    (dict(arch="gpt2", n_kv_head=2), "Llama's settings"),
    (dict(arch="gpt2", ffn_hidden=7), "Llama's settings"),
    (dict(arch="mistral"), "arch must be one of"),
    (dict(norm_eps=float("nan")), "norm_eps"),
    (dict(rope_theta=1.0), "rope_theta"),
])
def test_configs_it_cannot_build_are_refused_in_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        small(**kw).validate()
    assert "\n" not in str(e.value)


def test_tied_default_follows_the_family():
    assert GPTConfig(arch="llama").tie_embeddings is False
    assert GPTConfig().tie_embeddings is True
    assert GPTConfig(arch="llama", tie_embeddings=True).tie_embeddings is True


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_leaves_every_gradient_of_a_mixtral_model_bit_identical(mode):
    """--recompute full runs each block's forward again in backward: its routers must not add
    their counts to Mixtral's pool twice (the pooled loss would halve), and the gradients stay
    equal, bit for bit, to those without recomputation."""
    cfg = small(**MOE["deepseek: shared and fine-grained"])
    idx, targets = batch(cfg, seed=2)
    grads = []
    for m in ("none", mode):
        model = GPT(cfg, seed=5, parts=parts(m, moe=moe.settings_of(cfg, aux_coef=AUX)))
        model(idx, targets).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        assert model.moe.pool.blocks == {0, 1} and sum(model.moe.pool.counts[0]) == 2 * 2 * idx.size
    for n in grads[0]:
        np.testing.assert_array_equal(grads[1][n], grads[0][n], err_msg=n)
