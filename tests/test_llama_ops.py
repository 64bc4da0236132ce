"""The Llama family's ops (autograd/llama_ops.py) and grouped-query attention (autograd/attention.py):
each plain reference against central differences, each tuned op against its reference at 1e-12
in float64, and the properties that pin down the convention independently of both (grouped-query
attention is multi-head attention with repeated key heads; the rotary embedding turns pairs by
angles that make q(m).k(n) depend on m - n only; Meta's interleaved pairs equal Hugging Face's
halves after the documented permutation)."""
import numpy as np
import pytest

from gradcheck import fd_summary, gradcheck  # noqa: F401 - fd_summary is a fixture
from test_ops import assert_fast_matches_reference, reference_gradcheck, rnd
from minipar.autograd import attention, llama_ops, ops
from minipar.autograd.tensor import Tensor


def packed(B, T, H, Hkv, hs, seed):
    return rnd(B, T, (H + 2 * Hkv) * hs, seed=seed)


# --- grouped-query attention ---------------------------------------------------------------------

GQA = [(4, 4, 2), (4, 2, 3), (4, 1, 2), (6, 3, 2), (6, 2, 4), (1, 1, 4)]      # (H, Hkv, hs)


@pytest.mark.parametrize("H,Hkv,hs", GQA)
def test_gqa_reference_against_finite_differences(H, Hkv, hs):
    reference_gradcheck(attention.CausalSelfAttentionReference, packed(2, 4, H, Hkv, hs, 1),
                        args=(H, Hkv), name="CausalSelfAttentionReference")


@pytest.mark.parametrize("H,Hkv,hs", GQA)
@pytest.mark.parametrize("recompute", [False, True])
def test_gqa_fast_equals_reference(H, Hkv, hs, recompute):
    qkv = packed(2, 5, H, Hkv, hs, 2)
    out, cache = attention.CausalSelfAttentionReference.forward(qkv, H, Hkv)
    dout = rnd(*out.shape, seed=3)
    want = attention.CausalSelfAttentionReference.backward(dout, cache)
    t = Tensor(qkv, requires_grad=True)
    y = ops.causal_self_attention(t, H, recompute, Hkv)
    y.backward(dout)
    np.testing.assert_allclose(y.data, out, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(t.grad, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("H,Hkv,hs", GQA)
def test_gqa_gradcheck(H, Hkv, hs):
    gradcheck(lambda t: ops.causal_self_attention(t, H, n_kv_head=Hkv), packed(1, 4, H, Hkv, hs, 4),
              name="causal_self_attention")


@pytest.mark.parametrize("H,Hkv,hs", GQA)
def test_gqa_is_multi_head_attention_with_each_key_head_repeated(H, Hkv, hs):
    """Query head h reads key/value head h // (H / Hkv) (Hugging Face's repeat_kv): multi-head
    attention on explicitly repeated heads gives the same output, and the key heads' gradient
    is the sum over their copies."""
    B, T, g = 2, 6, H // Hkv
    qkv = packed(B, T, H, Hkv, hs, 5)
    q, k, v = np.split(qkv, [H * hs, (H + Hkv) * hs], axis=-1)

    def repeat(a):
        return np.repeat(a.reshape(B, T, Hkv, hs), g, axis=2).reshape(B, T, H * hs)

    mha = Tensor(np.concatenate([q, repeat(k), repeat(v)], -1), requires_grad=True)
    gqa = Tensor(qkv, requires_grad=True)
    dy = rnd(B, T, H * hs, seed=6)
    y_mha, y_gqa = ops.causal_self_attention(mha, H), ops.causal_self_attention(gqa, H, n_kv_head=Hkv)
    y_mha.backward(dy)
    y_gqa.backward(dy)
    np.testing.assert_allclose(y_gqa.data, y_mha.data, rtol=1e-12, atol=1e-14)
    dq, dk, dv = np.split(mha.grad, 3, axis=-1)

    def fold(a):
        return a.reshape(B, T, Hkv, g, hs).sum(3).reshape(B, T, Hkv * hs)

    np.testing.assert_allclose(gqa.grad, np.concatenate([dq, fold(dk), fold(dv)], -1), rtol=1e-12, atol=1e-14)


def test_gqa_is_causal():
    H, Hkv, hs, B, T = 4, 2, 3, 1, 6
    qkv = packed(B, T, H, Hkv, hs, 7)
    y = ops.causal_self_attention(Tensor(qkv), H, n_kv_head=Hkv).data
    for t in range(T - 1):
        changed = qkv.copy()
        changed[:, t + 1:] *= 10
        y2 = ops.causal_self_attention(Tensor(changed), H, n_kv_head=Hkv).data
        np.testing.assert_allclose(y2[:, :t + 1], y[:, :t + 1], rtol=0, atol=1e-14)
        assert not np.allclose(y2[:, t + 1:], y[:, t + 1:])


@pytest.mark.parametrize("width,H,Hkv", [(20, 4, 3), (19, 4, 2), (24, 4, 0)])
def test_gqa_refuses_head_counts_that_do_not_fit(width, H, Hkv):
    with pytest.raises(ValueError, match="n_kv_head|n_head"):
        ops.causal_self_attention(Tensor(rnd(1, 2, width)), H, n_kv_head=Hkv)


# --- RMSNorm, the rotary embedding, SwiGLU: references and tuned ops ---------------------------

X_BIG = rnd(3, 300, 96, seed=82)        # 900 rows of 96: two row blocks of the tuned loops, the last ragged
POS = np.array([3, 0, 7, 8, 1])         # a context-parallel rank's positions are neither 0.. nor sorted

# name -> (tuned op on Tensors, its reference, float64 inputs, non-differentiable arguments)
CASES = {
    "rms_norm": (llama_ops.rms_norm, llama_ops.RMSNormReference, [rnd(2, 3, 5, seed=83) * 2 + 0.7, rnd(5, seed=84)], ()),
    "rms_norm eps": (llama_ops.rms_norm, llama_ops.RMSNormReference, [rnd(2, 4, seed=86) * 0.1, rnd(4, seed=87)], (0.3,)),
    "rope": (llama_ops.rope, llama_ops.RoPEReference, [packed(2, 5, 2, 2, 4, 88)], (POS, 2, 2, 10000.0)),
    "rope gqa": (llama_ops.rope, llama_ops.RoPEReference, [packed(1, 5, 4, 1, 6, 89)], (POS, 4, 1, 500.0)),
    "swiglu": (llama_ops.swiglu, llama_ops.SwiGLUReference,
               [np.concatenate([rnd(3, 8, seed=90) * 3, [[-30.0, -3.0, 0.0, 20.0, 1.0, 2.0, 3.0, 4.0]]])], ()),
}
BIG = {
    "rms_norm rows in blocks": (llama_ops.rms_norm, llama_ops.RMSNormReference, [X_BIG, rnd(96)], ()),
    "swiglu rows in blocks": (llama_ops.swiglu, llama_ops.SwiGLUReference, [X_BIG * 3], ()),
    "rope T=64": (llama_ops.rope, llama_ops.RoPEReference, [packed(2, 64, 8, 2, 16, 91)],
                  (np.arange(64), 8, 2, 10000.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_reference_against_finite_differences(case):
    _, ref, arrays, args = CASES[case]
    reference_gradcheck(ref, *arrays, args=args, name=ref.__name__)


@pytest.mark.parametrize("case", list(CASES) + list(BIG))
def test_tuned_op_equals_reference(case):
    assert_fast_matches_reference(case, *{**CASES, **BIG}[case])


@pytest.mark.parametrize("case", list(CASES))
def test_tuned_op_gradcheck(case):
    fast, _, arrays, args = CASES[case]
    gradcheck(lambda *ts: fast(*ts, *args), *arrays, name=fast.__name__)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
def test_ops_on_no_rows(dtype):
    """A Mixtral expert that no token reached runs on 0 rows: each op gives an empty output and
    an empty gradient (the tuned loops have no row block to size their scratch from)."""
    cases = [(llama_ops.swiglu, [np.zeros((0, 2, 8))]),
             (lambda x, w: llama_ops.rms_norm(x, w), [np.zeros((0, 3, 4)), np.ones(4)]),
             (lambda x: llama_ops.rope(x, np.arange(3), 2, 1), [np.zeros((0, 3, 16))])]
    for op, arrays in cases:
        ts = [Tensor(a.astype(dtype), requires_grad=True) for a in arrays]
        y = op(*ts)
        assert y.data.shape[0] == 0 and y.data.dtype == dtype
        y.backward(np.zeros_like(y.data))
        assert ts[0].grad.shape == arrays[0].shape


def test_rms_norm_is_x_over_its_root_mean_square():
    x, w = rnd(4, 6, seed=1), rnd(6, seed=2)
    want = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(llama_ops.rms_norm(Tensor(x), Tensor(w), 1e-5).data, want, rtol=1e-14)


def test_rope_keeps_v_and_lengths_and_scores_depend_on_distance_only():
    """Each pair (x_j, x_{j+hs/2}) is turned, not stretched; v passes untouched; and the score
    of query position m with key position n depends on m - n only (RoPE's point)."""
    H, hs, theta = 1, 8, 100.0
    qkv = packed(1, 1, H, H, hs, 3)
    q, k = qkv[..., :hs], qkv[..., hs:2 * hs]

    def turned(pos):
        return llama_ops.rope(Tensor(qkv), [pos], H, H, theta).data

    for m in range(6):
        out = turned(m)
        np.testing.assert_array_equal(out[..., 2 * hs:], qkv[..., 2 * hs:])
        pair = lambda a: a[..., :hs // 2] ** 2 + a[..., hs // 2:hs] ** 2   # noqa: E731
        np.testing.assert_allclose(pair(out[..., :hs]), pair(q), rtol=1e-12)
    score = lambda m, n: float(np.sum(turned(m)[..., :hs] * turned(n)[..., hs:2 * hs]))   # noqa: E731
    for d in range(4):
        np.testing.assert_allclose([score(n + d, n) for n in range(5)], score(d, 0), rtol=1e-12)
    assert not np.isclose(score(1, 0), score(2, 0))
    assert np.allclose(turned(0)[..., :2 * hs], np.concatenate([q, k], -1))        # position 0: no turn


def test_meta_interleaved_pairs_equal_hugging_face_halves_after_the_permutation():
    """Meta's Llama turns adjacent pairs (x0, x1), (x2, x3), ...; Hugging Face turns halves.
    With each head's projection rows permuted by pairs_to_halves (docs/llama.md), the two give
    the same scores: the documented conversion is right."""
    C, H, hs, theta, T = 8, 2, 4, 10000.0, 5
    x = rnd(1, T, C, seed=8)
    wq, wk = rnd(C, H * hs, seed=9), rnd(C, H * hs, seed=10)         # Meta's layout, stored (in, out)
    angles = llama_ops.rope_angles(np.arange(T), hs, theta)          # (T, hs/2)

    def meta(w):                                                     # complex multiply of pairs
        a = (x @ w).reshape(1, T, H, hs // 2, 2)
        z = (a[..., 0] + 1j * a[..., 1]) * np.exp(1j * angles)[None, :, None, :]
        return np.stack([z.real, z.imag], -1).reshape(1, T, H, hs)

    def pairs_to_halves(w):                                          # each head's columns: evens, then odds
        return w.reshape(C, H, hs // 2, 2).transpose(0, 1, 3, 2).reshape(C, H * hs)

    hf_q, hf_k = pairs_to_halves(wq), pairs_to_halves(wk)
    qkv = np.concatenate([x @ hf_q, x @ hf_k, x @ hf_k], -1)
    turned = llama_ops.rope(Tensor(qkv), np.arange(T), H, H, theta).data
    q_hf, k_hf = turned[..., :H * hs].reshape(1, T, H, hs), turned[..., H * hs:2 * H * hs].reshape(1, T, H, hs)
    np.testing.assert_allclose(np.einsum("bthd,bshd->bhts", q_hf, k_hf),
                               np.einsum("bthd,bshd->bhts", meta(wq), meta(wk)), rtol=1e-12, atol=1e-12)


def test_rope_refuses_an_odd_head_size():
    with pytest.raises(ValueError, match="odd"):
        llama_ops.rope(Tensor(packed(1, 2, 1, 1, 3, 1)), [0, 1], 1, 1)


@pytest.mark.parametrize("name", ["rms_norm", "rope", "swiglu"])
def test_float32_stays_float32(name):
    fast, _, arrays, args = CASES[name]
    ts32 = [Tensor(a.astype(np.float32), requires_grad=True) for a in arrays]
    ts64 = [Tensor(a, requires_grad=True) for a in arrays]
    out32, out64 = fast(*ts32, *args), fast(*ts64, *args)
    assert out32.dtype == np.float32
    g = rnd(*out32.shape, seed=70)
    out32.backward(g.astype(np.float32))
    out64.backward(g)
    np.testing.assert_allclose(out32.data, out64.data, rtol=2e-5, atol=2e-6)
    for t32, t64 in zip(ts32, ts64):
        assert t32.grad.dtype == np.float32
        np.testing.assert_allclose(t32.grad, t64.grad, rtol=2e-4, atol=2e-5)


def test_every_public_llama_op_is_checked():
    api = {n for n in dir(llama_ops) if not n.startswith("_") and n[0].islower()
           and callable(getattr(llama_ops, n)) and getattr(getattr(llama_ops, n), "__module__", None) == llama_ops.__name__}
    assert api - {"rope_angles"} == {c.split(" ")[0] for c in CASES}
