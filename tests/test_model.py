"""The single-process GPT: names and shapes (docs/design.md §2), init (§3), a full-model
finite-difference check, loss conventions, state dicts, config errors, generate, FLOPs."""
import math

import numpy as np
from canonical import design_shapes
import pytest

from gradcheck import EPS, fd_summary, record, rel_err  # noqa: F401 - fd_summary is a fixture
from minipar.autograd import ops
from minipar.model.gpt import GPT, GPTConfig, init_param, param_specs, train_flops_per_token
from minipar.autograd.tensor import no_grad

TINY = dict(vocab_size=11, block_size=5, n_layer=2, n_head=2, n_embd=8)


def cfg_(**kw):
    return GPTConfig(**{**TINY, **kw})


def batch(seed, B=2, t=5, V=11):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, size=(B, t)), rng.integers(0, V, size=(B, t))


def expected_shapes(V, T, L, C, tied):
    return design_shapes(V, T, L, C, tied)


# --- names, shapes, counts -----------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("V,T,L,H,C", [(11, 5, 2, 2, 8), (7, 3, 3, 1, 4)])
def test_names_and_shapes(tied, V, T, L, H, C):
    m = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C, tie_embeddings=tied))
    got = {n: p.shape for n, p in m.named_parameters()}
    assert got == expected_shapes(V, T, L, C, tied)
    assert ("lm_head.weight" in got) == (not tied)
    assert [n for n, _ in m.named_parameters()] == [n for n, _, _ in param_specs(m.cfg)]
    assert [p for _, p in m.named_parameters()] == m.parameters()
    for n, p in m.named_parameters():
        assert p.requires_grad and p.is_leaf and p.name == n and p.dtype == np.float64
    sd = m.state_dict()
    assert {n: a.shape for n, a in sd.items()} == got


@pytest.mark.parametrize("tied", [True, False])
def test_num_params_formula(tied):
    V, T, L, C = 256, 64, 3, 32
    m = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=4, n_embd=C, tie_embeddings=tied))
    expect = V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C + (0 if tied else V * C)
    assert m.num_params() == expect


# --- initialisation ------------------------------------------------------------------------------

def test_init_statistics():
    L, C = 4, 64
    m = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=L, n_head=4, n_embd=C, tie_embeddings=False), seed=3)
    proj = 0.02 / math.sqrt(2 * L)
    for n, p in m.named_parameters():
        a = p.data
        if n.endswith("c_proj.weight"):
            std = proj
        elif n.endswith(".bias"):
            assert np.all(a == 0), n
            continue
        elif "ln_" in n:
            assert np.all(a == 1), n
            continue
        else:
            std = 0.02
        assert abs(a.std() / std - 1) < 0.05, f"{n}: std {a.std():.5f}, want {std:.5f}"
        assert abs(a.mean()) < 4 * std / math.sqrt(a.size), f"{n}: mean {a.mean():.2e}"


def test_init_is_per_parameter():
    """A tensor depends on (seed, name, shape) only: not on n_layer (c_proj only through its
    std), not on the dtype, not on whether the embeddings are tied."""
    m2 = GPT(cfg_(n_layer=2), seed=5)
    m3 = GPT(cfg_(n_layer=3, tie_embeddings=False), seed=5)
    for n, p in m2.named_parameters():
        q = m3.params[n].data
        if n.endswith("c_proj.weight"):
            np.testing.assert_allclose(p.data * math.sqrt(2 * 2), q * math.sqrt(2 * 3), rtol=1e-14, err_msg=n)
        else:
            np.testing.assert_array_equal(p.data, q, err_msg=n)
    m32 = GPT(cfg_(n_layer=2), seed=5, dtype=np.float32)
    for n, p in m32.named_parameters():
        assert p.dtype == np.float32, n
        np.testing.assert_array_equal(p.data, m2.params[n].data.astype(np.float32), err_msg=n)
    for n, shape, init in param_specs(m2.cfg):
        np.testing.assert_array_equal(m2.params[n].data, init_param(n, shape, init, 5), err_msg=n)
    # a shard is a slice of the full tensor, whatever else the model holds
    np.testing.assert_array_equal(init_param("h.0.mlp.c_fc.weight", (8, 32), 0.02, 5)[:, 8:16],
                                  m3.params["h.0.mlp.c_fc.weight"].data[:, 8:16])


def test_init_seeds_and_names_differ():
    a, b, a2 = GPT(cfg_(), seed=0), GPT(cfg_(), seed=1), GPT(cfg_(), seed=0)
    for n, p in a.named_parameters():
        np.testing.assert_array_equal(p.data, a2.params[n].data)
        if p.ndim == 2:
            assert not np.array_equal(p.data, b.params[n].data), n
    # two parameters of the same shape are different draws
    assert not np.array_equal(a.params["h.0.attn.c_proj.weight"].data, a.params["h.1.attn.c_proj.weight"].data)
    u = GPT(cfg_(tie_embeddings=False), seed=0)
    assert not np.array_equal(u.params["lm_head.weight"].data, u.params["wte.weight"].data)


def test_loss_at_init_is_log_vocab():
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=64)
    idx, tgt = batch(0, B=4, t=16, V=256)
    for dtype in (np.float64, np.float32):
        loss = GPT(cfg, seed=0, dtype=dtype)(idx, tgt)
        assert loss.shape == () and loss.dtype == dtype
        assert abs(loss.item() - math.log(256)) < 0.05, f"{dtype.__name__}: loss {loss.item()} vs {math.log(256)}"


# --- full-model finite differences -----------------------------------------------------------------

def randomize(m, seed):
    """Move away from init (biases 0, LN 1) so that every path carries gradient."""
    rng = np.random.default_rng(seed)
    for n, p in m.named_parameters():
        p.data[...] = rng.standard_normal(p.shape) * (0.4 if p.ndim == 2 else 0.2) + ("ln" in n and n.endswith("weight"))


@pytest.mark.parametrize("tied", [True, False])
def test_model_gradcheck(tied):
    """Loss of the tiny model (V=11, T=5, L=2, H=2, C=8) against central differences on 4
    random elements of every parameter; t=4 < T, so wpe's last row gets exactly 0."""
    m = GPT(cfg_(tie_embeddings=tied), seed=0)
    randomize(m, 1)
    idx, tgt = batch(7, B=2, t=4)
    idx[0, :2] = 3                                           # repeated ids
    m(idx, tgt).backward()
    assert np.all(m.params["wpe.weight"].grad[4] == 0)
    rng = np.random.default_rng(2)
    worst = 0.0
    for n, p in m.named_parameters():
        picks = rng.choice(p.size, size=min(4, p.size), replace=False)
        ana, num = [], []
        for j in picks:
            old = p.data.flat[j]
            with no_grad():
                p.data.flat[j] = old + EPS
                fp = m(idx, tgt).item()
                p.data.flat[j] = old - EPS
                fm = m(idx, tgt).item()
            p.data.flat[j] = old
            ana.append(p.grad.flat[j])
            num.append((fp - fm) / (2 * EPS))
        e = rel_err(np.array(ana), np.array(num), scale=float(np.abs(p.grad).max()))
        worst = max(worst, e)
        assert e < 1e-6, f"{n}: relative error {e:.2e}; analytic {ana} numeric {num}"
    record(f"GPT loss ({'tied' if tied else 'untied'})", worst)
    print(f"GPT {'tied' if tied else 'untied'}: largest relative error {worst:.2e}")


def test_model_forward_matches_numpy_reference():
    """An independent NumPy forward of docs/design.md §1 (no minipar ops) gives the same loss."""
    m = GPT(cfg_(tie_embeddings=True), seed=0)
    randomize(m, 3)
    P = {n: p.data for n, p in m.named_parameters()}
    idx, tgt = batch(8, B=2, t=5)
    H, C = 2, 8
    hs = C // H

    def ln(x, w, b):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b

    x = P["wte.weight"][idx] + P["wpe.weight"][:5]
    B, T = idx.shape
    for i in range(2):
        h = f"h.{i}."
        qkv = ln(x, P[h + "ln_1.weight"], P[h + "ln_1.bias"]) @ P[h + "attn.c_attn.weight"] + P[h + "attn.c_attn.bias"]
        q, k, v = (a.reshape(B, T, H, hs).transpose(0, 2, 1, 3) for a in np.split(qkv, 3, -1))
        s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs) + np.triu(np.full((T, T), -np.inf), 1)
        a = np.exp(s - s.max(-1, keepdims=True))
        y = ((a / a.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        x = x + y @ P[h + "attn.c_proj.weight"] + P[h + "attn.c_proj.bias"]
        u = ln(x, P[h + "ln_2.weight"], P[h + "ln_2.bias"]) @ P[h + "mlp.c_fc.weight"] + P[h + "mlp.c_fc.bias"]
        u = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        x = x + u @ P[h + "mlp.c_proj.weight"] + P[h + "mlp.c_proj.bias"]
    logits = ln(x, P["ln_f.weight"], P["ln_f.bias"]) @ P["wte.weight"].T
    np.testing.assert_allclose(m(idx).data, logits, rtol=1e-12, atol=1e-12)
    lp = logits - logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    ref = -np.take_along_axis(lp, tgt[..., None], -1).mean()
    np.testing.assert_allclose(m(idx, tgt).item(), ref, rtol=1e-13)


def test_loss_denom():
    m = GPT(cfg_(), seed=0)
    idx, tgt = batch(9, B=3, t=4)
    logits = m(idx).data
    lp = logits - logits.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    total = -np.take_along_axis(lp, tgt[..., None], -1).sum()
    np.testing.assert_allclose(m(idx, tgt).item(), total / 12, rtol=1e-13)
    loss = m(idx, tgt, loss_denom=40)
    np.testing.assert_allclose(loss.item(), total / 40, rtol=1e-13)
    loss.backward()
    g40 = {n: p.grad.copy() for n, p in m.named_parameters()}
    m.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    m(idx, tgt).backward()
    for n, p in m.named_parameters():
        np.testing.assert_allclose(g40[n], p.grad * 12 / 40, rtol=1e-12, atol=1e-18, err_msg=n)


def test_logits_shape_and_dtype():
    for dtype in (np.float32, np.float64):
        m = GPT(cfg_(), seed=0, dtype=dtype)
        out = m(np.zeros((3, 4), dtype=np.int64))
        assert out.shape == (3, 4, 11) and out.dtype == dtype
        loss = m(*batch(1))
        loss.backward()
        for n, p in m.named_parameters():
            assert p.grad.dtype == dtype and p.grad.shape == p.shape, n


# --- state dicts ------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [True, False])
def test_state_dict_round_trip(tied):
    a, b = GPT(cfg_(tie_embeddings=tied), seed=0), GPT(cfg_(tie_embeddings=tied), seed=1)
    idx, tgt = batch(10)
    assert a(idx, tgt).item() != b(idx, tgt).item()
    sd = a.state_dict()
    sd["wte.weight"][0, 0] += 1.0                            # a copy, not the live weights
    assert a.params["wte.weight"].data[0, 0] != sd["wte.weight"][0, 0]
    b.load_state_dict(a.state_dict())
    assert a(idx, tgt).item() == b(idx, tgt).item()
    for n, p in a.named_parameters():
        np.testing.assert_array_equal(p.data, b.params[n].data)
        assert p.data is not b.params[n].data
    # through an npz file, as checkpoints do, and into float32
    import io
    buf = io.BytesIO()
    np.savez(buf, **a.state_dict())
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as f:
        c = GPT(cfg_(tie_embeddings=tied), seed=2, dtype=np.float32)
        c.load_state_dict(dict(f))
    for n, p in c.named_parameters():
        assert p.dtype == np.float32
        np.testing.assert_array_equal(p.data, a.params[n].data.astype(np.float32))


def test_load_state_dict_errors():
    m = GPT(cfg_(), seed=0)
    sd = m.state_dict()
    bad = dict(sd)
    bad["h.1.mlp.c_fc.weight"] = np.zeros((8, 33))
    with pytest.raises(ValueError, match=r"h\.1\.mlp\.c_fc\.weight.*\(8, 33\).*\(8, 32\)"):
        m.load_state_dict(bad)
    missing = {k: v for k, v in sd.items() if k != "ln_f.bias"}
    with pytest.raises(ValueError, match=r"ln_f\.bias"):
        m.load_state_dict(missing)
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        m.load_state_dict({**sd, "lm_head.weight": np.zeros((11, 8))})   # untied checkpoint into tied


def test_failed_load_leaves_model_unchanged():
    """A checkpoint with one wrong shape must not leave the model half overwritten."""
    m = GPT(cfg_(), seed=0)
    before = m.state_dict()
    other = GPT(cfg_(), seed=1).state_dict()
    other["ln_f.bias"] = np.zeros(9)                          # the last parameter is bad
    with pytest.raises(ValueError):
        m.load_state_dict(other)
    for n, p in m.named_parameters():
        np.testing.assert_array_equal(p.data, before[n], err_msg=f"{n} overwritten by a failed load")


# --- config and input errors --------------------------------------------------------------------------

def test_config_validate_errors():
    with pytest.raises(ValueError, match=r"n_embd 10.*n_head 4"):
        GPTConfig(n_embd=10, n_head=4).validate()
    with pytest.raises(ValueError, match=r"n_embd 10.*n_head 4"):
        GPT(GPTConfig(vocab_size=11, block_size=5, n_layer=1, n_head=4, n_embd=10))
    for field, value in (("vocab_size", 0), ("block_size", -3), ("n_layer", 0), ("n_head", 0), ("n_embd", -8)):
        with pytest.raises(ValueError, match=rf"{field}.*{value}"):
            GPT(cfg_(**{field: value}))
    assert cfg_().validate().n_embd == 8


def test_sequence_longer_than_block_size():
    m = GPT(cfg_(), seed=0)
    with pytest.raises(ValueError, match=r"6.*5"):
        m(np.zeros((1, 6), dtype=np.int64))
    with pytest.raises(ValueError, match=r"6.*5"):
        m(np.zeros((1, 6), dtype=np.int64), np.zeros((1, 6), dtype=np.int64))
    m(np.zeros((1, 5), dtype=np.int64))                       # exactly block_size is fine


# --- generate -----------------------------------------------------------------------------------------

def test_generate_shape_and_determinism():
    m = GPT(cfg_(), seed=0)
    randomize(m, 4)
    prompt = np.array([[1, 2, 3], [4, 5, 6]])
    out = m.generate(prompt, 7, rng=np.random.default_rng(3))        # runs past block_size 5
    assert out.shape == (2, 10) and out.dtype.kind == "i"
    np.testing.assert_array_equal(out[:, :3], prompt)
    assert out.min() >= 0 and out.max() < 11
    again = m.generate(prompt, 7, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(out, again)
    outs = {m.generate(prompt, 7, temperature=2.0, top_k=None, rng=np.random.default_rng(s)).tobytes()
            for s in range(4)}
    assert len(outs) > 1, "different rng seeds never change the sample"
    assert m.generate([1, 2], 2).shape == (1, 4)                      # a 1-D prompt
    # no graph is left behind: parameters got no gradient
    assert all(p.grad is None for p in m.parameters())


def test_generate_top_k_1_is_greedy():
    m = GPT(cfg_(), seed=0)
    randomize(m, 5)
    idx = np.array([[7, 1], [0, 10]])
    out = m.generate(idx, 6, top_k=1, rng=np.random.default_rng(0))
    ref = idx.copy()
    for _ in range(6):
        logits = m(ref[:, -5:]).data[:, -1]
        ref = np.concatenate([ref, logits.argmax(-1)[:, None]], 1)
    np.testing.assert_array_equal(out, ref)
    # temperature -> 0 is greedy too, whatever top_k
    cold = m.generate(idx, 6, temperature=1e-9, top_k=None, rng=np.random.default_rng(1))
    np.testing.assert_array_equal(cold, ref)


def test_generate_top_k_restricts_the_choice():
    m = GPT(cfg_(), seed=0)
    randomize(m, 6)
    out = m.generate(np.array([[2], [9], [4]]), 4, temperature=3.0, top_k=2, rng=np.random.default_rng(5))
    for t in range(1, out.shape[1]):
        logits = m(out[:, max(0, t - 5):t]).data[:, -1]
        top2 = np.argsort(logits, -1)[:, -2:]
        assert all(out[b, t] in top2[b] for b in range(3)), f"position {t}: {out[:, t]} not in top-2 {top2}"


# --- FLOPs ---------------------------------------------------------------------------------------------

def test_train_flops_per_token_hand_count():
    # C=8, L=2, V=11: per layer 2*(3C^2 + C^2 + 4C^2 + 4C^2) + 2*2*t*C, head 2*C*V, x3 for training
    cfg = cfg_()
    assert train_flops_per_token(cfg) == 3 * (2 * (2 * 12 * 64 + 4 * 5 * 8) + 2 * 8 * 11) == 10704
    assert train_flops_per_token(cfg, t=3) == 10320


def test_train_flops_per_token_counts_the_matmuls_that_run(monkeypatch):
    """Count 2*M*N*K of every product the forward actually performs."""
    count = [0]

    def wrap(cls, flops):
        orig = cls.forward

        def forward(self, *args, **kw):
            out = orig(self, *args, **kw)
            count[0] += flops(out, *args)
            return out
        monkeypatch.setattr(cls, "forward", forward)

    wrap(ops.Linear, lambda out, x, w, *r: 2 * out.size * w.shape[0])
    wrap(ops.MatMul, lambda out, a, b: 2 * out.size * a.shape[-1])
    wrap(ops.CausalSelfAttention, lambda out, qkv, nh, *r: 2 * 2 * out.shape[0] * out.shape[1] ** 2 * out.shape[2])
    for tied, t in ((True, 5), (False, 3)):
        cfg = GPTConfig(vocab_size=13, block_size=6, n_layer=3, n_head=2, n_embd=12, tie_embeddings=tied)
        m = GPT(cfg, seed=0)
        count[0] = 0
        B = 2
        with no_grad():
            m(np.zeros((B, t), dtype=np.int64))
        assert 3 * count[0] / (B * t) == train_flops_per_token(cfg, t=t), (tied, t)
