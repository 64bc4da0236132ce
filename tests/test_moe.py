"""The MoE layer (minipar/model/moe.py) on one process: against a token-by-token reference written
from the module's rules (router, top-k, renormalised weights, capacity claimed choice by
choice then token by token, per routing group), and its gradients, the auxiliary losses'
included, against central differences in float64."""
import math

import numpy as np
import pytest

from minipar.model import moe
from minipar.model.gpt import FAMILY as GPT2
from minipar.autograd.tensor import Tensor

C, E = 6, 4


def params(rng, E=E, C=C):
    P = {"h.0.mlp.router.weight": rng.standard_normal((C, E))}
    for e in range(E):
        p = f"h.0.mlp.experts.{e}."
        P[p + "c_fc.weight"] = rng.standard_normal((C, 4 * C)) * 0.5
        P[p + "c_fc.bias"] = rng.standard_normal(4 * C) * 0.1
        P[p + "c_proj.weight"] = rng.standard_normal((4 * C, C)) * 0.5
        P[p + "c_proj.bias"] = rng.standard_normal(C) * 0.1
    return P


def gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def reference(P, x, s: moe.MoESettings):
    """Token by token, group by group: -> y, and the objective's extra terms
    aux_coef * mean_g aux_g + z_coef * mean_g zloss_g (over this call's groups)."""
    B, t, _ = x.shape
    xs = x.reshape(B * t, C)
    G = (s.group_rows or B) * t
    y = np.zeros_like(xs)
    extra = 0.0
    for a in range(0, B * t, G):
        used, load, P_mean, lse2 = np.zeros(E), np.zeros(E), np.zeros(E), 0.0
        cap = math.inf if s.capacity_factor == 0 else math.ceil(s.capacity_factor * G * s.top_k / E)
        routes = []
        for n in range(a, a + G):
            z = xs[n] @ P["h.0.mlp.router.weight"]
            p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
            top = sorted(range(E), key=lambda e: (-p[e], e))[:s.top_k]
            routes.append((n, top, p[top] / p[top].sum() if s.top_k > 1 else p[top]))
            for e in top:
                load[e] += 1
            P_mean += p / G
            lse2 += (np.log(np.exp(z - z.max()).sum()) + z.max()) ** 2 / G
        for k in range(s.top_k):                       # slots: choice by choice, token by token
            for n, top, w in routes:
                e = top[k]
                if used[e] < cap:
                    used[e] += 1
                    q = f"h.0.mlp.experts.{e}."
                    h = gelu(xs[n] @ P[q + "c_fc.weight"] + P[q + "c_fc.bias"])
                    y[n] += w[k] * (h @ P[q + "c_proj.weight"] + P[q + "c_proj.bias"])
        extra += (s.aux_coef * E * (load / (G * s.top_k) * P_mean).sum() + s.z_coef * lse2) / s.groups_total
    return y.reshape(x.shape), extra


SETTINGS = {
    "top2": dict(top_k=2),
    "top1 capacity 1.0": dict(top_k=1, capacity_factor=1.0),
    "top2 capacity 0.5, groups of 2": dict(top_k=2, capacity_factor=0.5, group_rows=2),
    "top2 aux + z, groups of 1": dict(top_k=2, aux_coef=0.3, z_coef=0.05, group_rows=1, capacity_factor=1.25),
}


def settings(name, B):
    kw = SETTINGS[name]
    return moe.MoESettings(experts=E, groups_total=B // (kw.get("group_rows") or B), **kw)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_forward_equals_the_token_by_token_reference(name):
    rng = np.random.default_rng(1)
    P = params(rng)
    x = rng.standard_normal((4, 5, C))
    s = settings(name, 4)
    s.stats = stats = []
    y = moe.moe_mlp({k: Tensor(v, requires_grad=True) for k, v in P.items()}, 0, Tensor(x), s, GPT2)
    want, _ = reference(P, x, s)
    np.testing.assert_allclose(y.data, want, rtol=0, atol=1e-12)
    d = stats[0][1]
    if s.capacity_factor:
        assert sum(d.dropped) > 0, "the case is meant to drop some assignments"
    assert all(load.sum() == (s.group_rows or 4) * 5 * s.top_k for load in d.load)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_gradients_equal_central_differences(name):
    """Objective sum(y R) + the auxiliary terms: every input's gradient (x, router, each
    expert's weights and biases) by backward and by central differences."""
    rng = np.random.default_rng(2)
    P = params(rng)
    x = rng.standard_normal((4, 3, C))
    R = rng.standard_normal(x.shape)
    s = settings(name, 4)

    def objective():
        y, extra = reference(P, x, s)
        return float((y * R).sum() + extra)

    ts = {k: Tensor(v, requires_grad=True) for k, v in P.items()}
    xt = Tensor(x, requires_grad=True)
    moe.moe_mlp(ts, 0, xt, s, GPT2).backward(R)
    for name_, a, grad in [("x", x, xt.grad)] + [(k, P[k], ts[k].grad) for k in P]:
        assert grad is not None, name_
        some = rng.choice(a.size, min(a.size, 12), replace=False)      # 12 elements of each
        num = np.zeros(len(some))
        for m, j in enumerate(some):
            old = a.flat[j]
            a.flat[j] = old + 1e-6
            fp = objective()
            a.flat[j] = old - 1e-6
            fm = objective()
            a.flat[j] = old
            num[m] = (fp - fm) / 2e-6
        err = np.abs(grad.flat[some] - num).max() / max(np.abs(grad).max(), 1e-12)
        assert err < 1e-6, (name_, err)


def test_claim_slots_by_choice_then_token():
    """cap 1 per expert: the first choices claim first, in token order; a second choice
    finds its expert taken."""
    choice = np.array([[0, 1], [0, 2], [1, 0]])
    kept = moe.claim_slots(choice, 3, 1)
    assert kept.tolist() == [[True, False], [False, True], [True, False]]
    assert moe.capacity(10, 2, 4, 1.0) == 5 and moe.capacity(10, 2, 4, 0) is None


def test_top_k_ties_and_router_modes():
    """Equal logits: the lower expert id first; k = 1 keeps p (Switch) or renormalises to 1
    (Mixtral); k > 1 renormalises over the chosen."""
    z = np.array([[0.0, 1.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    choice, w = moe.top_k(z, 2)
    assert choice.tolist() == [[1, 2], [0, 1]] and np.allclose(w, 0.5, rtol=0, atol=1e-15)
    p = np.exp(z[0]) / np.exp(z[0]).sum()
    choice, w = moe.top_k(z, 1)
    assert choice.tolist() == [[1], [0]] and abs(w[0, 0] - p[1]) < 1e-15 and abs(w[1, 0] - 0.25) < 1e-15
    assert np.array_equal(moe.top_k(z, 1, "mixtral")[1], np.ones((2, 1)))
    choice, w = moe.top_k(z, 4)
    assert choice.tolist() == [[1, 2, 0, 3], [0, 1, 2, 3]] and np.allclose(w.sum(1), 1, rtol=0, atol=1e-15)


def test_combine_adds_the_kept_outputs_weighted():
    """y[token] += w out, from the (token, slot) of each kept assignment; a token with none stays 0."""
    rng = np.random.default_rng(0)
    n, K = 4, 2
    weights = rng.random((n, K))
    tokens, ks = np.array([2, 0, 2, 1]), np.array([0, 1, 1, 0])
    out = rng.standard_normal((4, C))
    y = moe.combine(Tensor(out), tokens, tokens * K + ks, Tensor(weights), n).data
    want = np.zeros((n, C))
    for m in range(4):
        want[tokens[m]] += weights[tokens[m], ks[m]] * out[m]
    assert np.allclose(y, want, rtol=1e-14, atol=0) and not y[3].any()
