"""AdamW against PyTorch's documented algorithm, written out here; clipping with PyTorch's
semantics; the LR schedule; and a tiny model that must overfit one batch."""
import math

import numpy as np
import pytest

from minipar.model.gpt import GPT, GPTConfig
from minipar.optim.adamw import AdamW, adamw_update, clip_coef, clip_grad_norm, grad_norm, lr_at
from minipar.autograd.tensor import Tensor


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


class TorchAdamWReference:
    """torch.optim.AdamW, from the pseudo-code in its documentation (amsgrad=False,
    maximize=False), one parameter, plain loops over nothing clever:

        theta_t = theta_{t-1} - gamma * lambda * theta_{t-1}
        m_t = beta1 m_{t-1} + (1 - beta1) g_t
        v_t = beta2 v_{t-1} + (1 - beta2) g_t^2
        mhat = m_t / (1 - beta1^t);  vhat = v_t / (1 - beta2^t)
        theta_t = theta_t - gamma * mhat / (sqrt(vhat) + eps)
    """

    def __init__(self, theta, lr, betas, eps, wd):
        self.theta, self.lr, self.b1, self.b2, self.eps, self.wd = theta.copy(), lr, *betas, eps, wd
        self.m = np.zeros_like(theta)
        self.v = np.zeros_like(theta)
        self.t = 0

    def step(self, g):
        self.t += 1
        self.theta = self.theta - self.lr * self.wd * self.theta
        self.m = self.b1 * self.m + (1 - self.b1) * g
        self.v = self.b2 * self.v + (1 - self.b2) * g ** 2
        mhat = self.m / (1 - self.b1 ** self.t)
        vhat = self.v / (1 - self.b2 ** self.t)
        self.theta = self.theta - self.lr * mhat / (np.sqrt(vhat) + self.eps)


@pytest.mark.parametrize("lr,betas,eps,wd", [
    (1e-3, (0.9, 0.999), 1e-8, 0.01),     # torch defaults
    (3e-4, (0.9, 0.95), 1e-8, 0.1),       # minipar / GPT-2 defaults
    (1e-2, (0.8, 0.9), 1e-3, 0.0),        # large eps: the eps placement matters
])
def test_adamw_update_matches_reference(lr, betas, eps, wd):
    p0 = rnd(4, 5, seed=1)
    ref = TorchAdamWReference(p0, lr, betas, eps, wd)
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    for step in range(1, 8):
        g = rnd(4, 5, seed=10 + step) * 10.0 ** (step % 3 - 1)   # gradients of changing scale
        adamw_update(p, g, m, v, step, lr, betas, eps, wd)
        ref.step(g)
        np.testing.assert_allclose(p, ref.theta, rtol=1e-14, atol=1e-16, err_msg=f"step {step}")
        np.testing.assert_allclose(m, ref.m, rtol=1e-14, atol=1e-18)
        np.testing.assert_allclose(v, ref.v, rtol=1e-14, atol=1e-20)
    assert not np.allclose(p, p0)


def test_adamw_update_array_weight_decay_and_float32():
    p0, g = rnd(3, 4, seed=2), rnd(3, 4, seed=3)
    wd = np.array([0.1, 0.0, 0.1, 0.0])                       # broadcast mask over columns
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    adamw_update(p, g, m, v, 1, 1e-2, (0.9, 0.95), 1e-8, wd)
    for col, w in enumerate(wd):
        r = TorchAdamWReference(p0[:, col], 1e-2, (0.9, 0.95), 1e-8, w)
        r.step(g[:, col])
        np.testing.assert_allclose(p[:, col], r.theta, rtol=1e-14)
    p32 = p0.astype(np.float32)
    m32, v32 = np.zeros_like(p32), np.zeros_like(p32)
    adamw_update(p32, g.astype(np.float32), m32, v32, 1, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    assert p32.dtype == m32.dtype == v32.dtype == np.float32
    p64, m64, v64 = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    adamw_update(p64, g, m64, v64, 1, 1e-2, (0.9, 0.95), 1e-8, 0.1)
    np.testing.assert_allclose(p32, p64, rtol=1e-6, atol=1e-7)


def test_adamw_decays_only_matrices():
    """With zero gradients Adam's update is 0, so what changes is the decay alone."""
    w, b, e = Tensor(rnd(3, 4, seed=4)), Tensor(rnd(4, seed=5)), Tensor(rnd(2, 3, 4, seed=6))
    params = [w, b, e]
    before = [p.data.copy() for p in params]
    for p in params:
        p.grad = np.zeros_like(p.data)
    opt = AdamW(params, lr=0.1, weight_decay=0.5)
    opt.step()
    np.testing.assert_allclose(w.data, before[0] * (1 - 0.1 * 0.5), rtol=1e-15)
    np.testing.assert_array_equal(b.data, before[1])
    np.testing.assert_allclose(e.data, before[2] * (1 - 0.1 * 0.5), rtol=1e-15)


def test_adamw_class_matches_reference_over_steps():
    shapes = [(3, 4), (4,), (5, 2)]
    params = [Tensor(rnd(*s, seed=20 + i), requires_grad=True) for i, s in enumerate(shapes)]
    refs = [TorchAdamWReference(p.data, 2e-2, (0.9, 0.95), 1e-8, 0.1 if p.ndim >= 2 else 0.0) for p in params]
    opt = AdamW(params, lr=2e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(5):
        for i, (p, r) in enumerate(zip(params, refs)):
            p.grad = rnd(*p.shape, seed=100 * step + i)
            r.step(p.grad)
        opt.step()
        opt.zero_grad()
        assert all(p.grad is None for p in params)
    for p, r in zip(params, refs):
        np.testing.assert_allclose(p.data, r.theta, rtol=1e-14)
    assert opt.step_count == 5
    assert opt.state_bytes() == 2 * sum(p.data.nbytes for p in params)


def test_adamw_skips_params_without_grad():
    a, b = Tensor(rnd(2, 2, seed=7)), Tensor(rnd(2, 2, seed=8))
    a.grad = rnd(2, 2, seed=9)
    b0 = b.data.copy()
    AdamW([a, b], lr=0.1, weight_decay=0.1).step()
    np.testing.assert_array_equal(b.data, b0)


def _params_and_grads(seed):
    ps = [Tensor(rnd(3, 4, seed=seed), requires_grad=True), Tensor(rnd(4, seed=seed + 1), requires_grad=True)]
    return ps


def _set_grads(ps, step):
    for i, p in enumerate(ps):
        p.grad = rnd(*p.shape, seed=1000 + 10 * step + i)


def test_adamw_state_dict_round_trip():
    """Stop after 3 steps, save params and optimizer state, resume in a fresh optimizer:
    the next 3 steps equal those of an uninterrupted run."""
    run = _params_and_grads(0)
    opt = AdamW(run, lr=1e-2)
    for s in range(6):
        _set_grads(run, s)
        opt.step()
    part = _params_and_grads(0)
    o1 = AdamW(part, lr=1e-2)
    for s in range(3):
        _set_grads(part, s)
        o1.step()
    saved_params = [p.data.copy() for p in part]
    sd = {k: np.array(v, copy=True) for k, v in o1.state_dict().items()}
    resumed = [Tensor(d, requires_grad=True) for d in saved_params]
    o2 = AdamW(resumed, lr=1e-2)
    o2.load_state_dict(sd)
    assert o2.step_count == 3
    for s in range(3, 6):
        _set_grads(resumed, s)
        o2.step()
    for p, q in zip(resumed, run):
        np.testing.assert_array_equal(p.data, q.data)
    bad = dict(sd)
    bad["m.0"] = np.zeros((4, 3))
    with pytest.raises(ValueError, match=r"m\.0"):
        AdamW(_params_and_grads(0)).load_state_dict(bad)


def test_adamw_state_dict_is_a_snapshot():
    """state_dict() taken at step 3 must still describe step 3 after more steps (the model's
    state_dict copies too); otherwise an in-memory checkpoint silently moves on."""
    ps = _params_and_grads(0)
    opt = AdamW(ps, lr=1e-2)
    for s in range(3):
        _set_grads(ps, s)
        opt.step()
    sd = opt.state_dict()
    frozen = {k: np.array(v, copy=True) for k, v in sd.items()}
    _set_grads(ps, 3)
    opt.step()
    for k in frozen:
        np.testing.assert_array_equal(sd[k], frozen[k], err_msg=f"state_dict()[{k!r}] changed after a later step")


# --- clipping ---------------------------------------------------------------------------------------

def test_grad_norm():
    gs = [rnd(3, 4, seed=30), None, rnd(5, seed=31), np.zeros((2, 2))]
    flat = np.concatenate([g.ravel() for g in gs if g is not None])
    np.testing.assert_allclose(grad_norm(gs), np.linalg.norm(flat), rtol=1e-14)
    assert grad_norm([None]) == 0.0
    g32 = [np.full(10 ** 5, 1e-3, dtype=np.float32)]
    np.testing.assert_allclose(grad_norm(g32), math.sqrt(1e5) * float(np.float32(1e-3)), rtol=1e-12)
    assert isinstance(grad_norm(g32), float)


def test_clip_coef_is_pytorchs():
    assert clip_coef(10.0, 1.0) == 1.0 / (10.0 + 1e-6)
    assert clip_coef(0.5, 1.0) == 1.0
    assert clip_coef(1.0, 1.0) == 1.0 / (1.0 + 1e-6)           # the 1e-6 is always there, as in torch
    assert clip_coef(100.0, 0.0) == 1.0                        # 0 disables
    assert clip_coef(0.0, 1.0) == 1.0


def test_clip_grad_norm():
    ps = [Tensor(np.zeros((3, 4))), Tensor(np.zeros(5)), Tensor(np.zeros(2))]
    grads = [rnd(3, 4, seed=32) * 3, rnd(5, seed=33) * 3, None]
    for p, g in zip(ps, grads):
        p.grad = None if g is None else g.copy()
    total = np.linalg.norm(np.concatenate([grads[0].ravel(), grads[1].ravel()]))
    assert total > 1.0
    ret = clip_grad_norm(ps, 1.0)
    np.testing.assert_allclose(ret, total, rtol=1e-14)          # the norm before clipping
    coef = 1.0 / (total + 1e-6)
    np.testing.assert_allclose(ps[0].grad, grads[0] * coef, rtol=1e-14)
    np.testing.assert_allclose(ps[1].grad, grads[1] * coef, rtol=1e-14)
    assert ps[2].grad is None
    np.testing.assert_allclose(grad_norm([p.grad for p in ps]), total / (total + 1e-6), rtol=1e-14)
    # below the threshold, and disabled: untouched
    for max_norm in (total * 2, 0.0):
        for p, g in zip(ps, grads):
            p.grad = None if g is None else g.copy()
        np.testing.assert_allclose(clip_grad_norm(ps, max_norm), total, rtol=1e-14)
        np.testing.assert_array_equal(ps[0].grad, grads[0])


# --- learning-rate schedule ---------------------------------------------------------------------------

def test_lr_at():
    assert lr_at(0, 1e-3) == 1e-3 and lr_at(10 ** 6, 1e-3) == 1e-3
    # warm-up: linear, reaching base_lr at the last warm-up step
    assert [lr_at(s, 1.0, warmup=4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    ws = [lr_at(s, 1.0, "cosine", warmup=4, total_steps=24, min_lr=0.1) for s in range(4)]
    np.testing.assert_allclose(ws, [0.25, 0.5, 0.75, 1.0])
    # cosine: base_lr right after warm-up, min_lr at total_steps and after, the mean halfway
    f = lambda s: lr_at(s, 1.0, "cosine", warmup=4, total_steps=24, min_lr=0.1)  # noqa: E731
    np.testing.assert_allclose(f(4), 1.0, rtol=1e-15)
    np.testing.assert_allclose(f(14), 0.55, rtol=1e-15)
    np.testing.assert_allclose(f(24), 0.1, rtol=1e-15)
    np.testing.assert_allclose(f(100), 0.1, rtol=1e-15)
    np.testing.assert_allclose(f(9), 0.1 + 0.45 * (1 + math.cos(math.pi * 5 / 20)), rtol=1e-15)
    vals = [f(s) for s in range(4, 25)]
    assert all(a > b for a, b in zip(vals, vals[1:])), "cosine decay is strictly decreasing"
    np.testing.assert_allclose(lr_at(50, 2.0, "cosine", total_steps=100), 1.0, rtol=1e-15)   # no warm-up
    np.testing.assert_allclose(lr_at(0, 2.0, "cosine", total_steps=100), 2.0, rtol=1e-15)
    with pytest.raises(ValueError, match="linear"):
        lr_at(0, 1.0, "linear")


def test_grad_scale_is_a_scaled_gradient():
    """adamw_update(..., grad_scale=s) applies the reference update to s * g: the clip factor
    and mixed precision's 1/S, folded into AdamW's passes (s in m, s^2 in v)."""
    for s in (1.0, 0.3, 2.0 ** -16, 7.5):
        p0 = rnd(6, 7, seed=3)
        ref = TorchAdamWReference(p0, 1e-2, (0.9, 0.95), 1e-8, 0.1)
        p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
        for step in range(1, 6):
            g = rnd(6, 7, seed=40 + step) * 10.0 ** (step % 3 - 1)
            adamw_update(p, g, m, v, step, 1e-2, (0.9, 0.95), 1e-8, 0.1, grad_scale=s)
            ref.step(s * g)
            np.testing.assert_allclose(p, ref.theta, rtol=1e-14, atol=1e-16, err_msg=f"s={s} step {step}")
            np.testing.assert_allclose(m, ref.m, rtol=1e-14, atol=1e-30, err_msg=f"s={s} m")
            np.testing.assert_allclose(v, ref.v, rtol=1e-14, atol=1e-40, err_msg=f"s={s} v")


def test_trainer_clips_as_clip_grad_norm_then_step():
    """train_step clips inside AdamW (grad_scale = clip_coef) and leaves p.grad alone: the
    same parameters as the textbook clip_grad_norm (which rewrites p.grad) then step()."""
    from minipar.train import data, trainer as train
    args = train.build_parser().parse_args(
        ["--batch-size", "4", "--steps", "4", "--warmup", "0", "--lr", "1e-2", "--lr-schedule", "constant", "--grad-clip", "0.05",
         "--dtype", "float64", "--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "8"])
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=2, n_embd=16)
    tokens = data.load_tokens(None, cfg.block_size)
    model = GPT(cfg, seed=0, dtype=np.float64)
    s = train.Session(args, model, train.build_optimizer(model, args), data.Sampler(tokens, 8, 4, 0), rows=(0, 4))
    rows = list(train.train_steps(s, 0, 4))
    ref = GPT(cfg, seed=0, dtype=np.float64)
    opt = AdamW(ref.parameters(), lr=1e-2, weight_decay=args.weight_decay)
    sampler = data.Sampler(tokens, 8, 4, 0)
    for step, row in enumerate(rows):
        x, y = sampler.batch(step, 0, 4)
        opt.zero_grad()
        ref(x, y).backward()
        norm = clip_grad_norm(ref.parameters(), 0.05)
        assert norm > 0.05, "clipping must be active for this test to mean anything"
        opt.step()
        np.testing.assert_allclose(row["grad_norm"], norm, rtol=1e-12)
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        np.testing.assert_allclose(a.data, b.data, rtol=1e-12, atol=1e-14, err_msg=n)


# --- end to end --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_tiny_model_overfits_one_batch(dtype):
    cfg = GPTConfig(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=16)
    m = GPT(cfg, seed=0, dtype=dtype)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 16, size=(4, 8))
    tgt = rng.integers(0, 16, size=(4, 8))
    opt = AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(50):
        loss = m(idx, tgt)
        losses.append(loss.item())
        loss.backward()
        clip_grad_norm(m.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        for p in m.parameters():
            assert p.dtype == dtype
    assert losses[-1] < 0.5 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in 50 steps"
