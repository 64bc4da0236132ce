"""Every op of minipar.ops against central finite differences in float64; the plain references
beside the tuned ops (ops.LayerNormReference, ...) against finite differences too, and every
tuned op's forward and backward against its reference; float32 kept float32 end to end."""
import numpy as np
import pytest

from gradcheck import fd_summary, gradcheck  # noqa: F401 - fd_summary is a fixture
from gradcheck import EPS, TOL, numerical_grad, record, rel_err
from minipar.autograd import ops
from minipar.autograd.tensor import Tensor


def rnd(*shape, seed=0, scale=1.0):
    return np.random.default_rng(seed).standard_normal(shape) * scale


# --- add / mul: broadcasting ----------------------------------------------------------------

BROADCAST_CASES = [
    ((3, 4), (3, 4)),             # same shape
    ((2, 3, 4), (4,)),            # right side gets leading dims
    ((4,), (2, 3, 4)),            # left side gets leading dims
    ((2, 1, 4), (1, 3, 1)),       # both sides broadcast
    ((2, 3, 1, 5), (3, 4, 1)),    # both, with a leading dim on one side only
    ((3, 1), (1,)),
    ((), (2, 3)),                 # 0-d against a matrix
]


@pytest.mark.parametrize("sa,sb", BROADCAST_CASES)
def test_add_broadcast(sa, sb):
    a, b = rnd(*sa, seed=1), rnd(*sb, seed=2)
    out = ops.add(Tensor(a), Tensor(b))
    np.testing.assert_array_equal(out.data, a + b)
    gradcheck(ops.add, a, b, name="add")


@pytest.mark.parametrize("sa,sb", BROADCAST_CASES)
def test_mul_broadcast(sa, sb):
    a, b = rnd(*sa, seed=3), rnd(*sb, seed=4)
    out = ops.mul(Tensor(a), Tensor(b))
    np.testing.assert_array_equal(out.data, a * b)
    gradcheck(ops.mul, a, b, name="mul")


def test_add_mul_python_scalars():
    x = rnd(2, 3, seed=5)
    gradcheck(lambda t: ops.add(t, 2.5), x, name="add")
    gradcheck(lambda t: ops.add(-1.5, t), x, name="add")
    gradcheck(lambda t: ops.mul(t, 3.0), x, name="mul")
    gradcheck(lambda t: 0.5 * t + t * t, x, name="mul")      # operator sugar, t used twice


# --- matmul / linear --------------------------------------------------------------------------

@pytest.mark.parametrize("sa,sb", [
    ((3, 4), (4, 5)),              # 2-D
    ((2, 3, 4), (2, 4, 5)),        # batched 3-D
    ((2, 2, 3, 4), (2, 2, 4, 5)),  # batched 4-D
    ((2, 3, 4), (4, 5)),           # activations @ weight (the fast path)
    ((2, 2, 3, 4), (4, 5)),
    ((2, 1, 3, 4), (1, 3, 4, 5)),  # both batch dims broadcast
    ((3, 4), (2, 4, 5)),           # a broadcast over b's batch
    ((2, 3, 3, 4), (3, 4, 5)),     # b broadcast over a leading dim
])
def test_matmul(sa, sb):
    a, b = rnd(*sa, seed=6), rnd(*sb, seed=7)
    np.testing.assert_allclose(ops.matmul(Tensor(a), Tensor(b)).data, a @ b, rtol=1e-14)
    gradcheck(ops.matmul, a, b, name="matmul")


def test_matmul_transposed_weight():
    """logits = x @ wte.T, the tied GPT head."""
    x, w = rnd(2, 3, 4, seed=8), rnd(5, 4, seed=9)
    np.testing.assert_allclose(ops.matmul(Tensor(x), ops.transpose(Tensor(w))).data, x @ w.T, rtol=1e-14)
    gradcheck(lambda x, w: ops.matmul(x, ops.transpose(w)), x, w, name="matmul")


def test_matmul_vector_operand_not_silently_dropped():
    """a (3, 4) @ b (4,): if the op accepts a 1-D operand, both gradients must be right
    (or it must refuse it); a missing gradient is silently wrong training."""
    a, b = rnd(3, 4, seed=10), rnd(4, seed=11)
    try:
        at, bt = Tensor(a, requires_grad=True), Tensor(b, requires_grad=True)
        ops.matmul(at, bt).backward(np.ones(3))
    except Exception:
        return                                                  # refused: fine
    assert at.grad is not None and bt.grad is not None, "matmul with a 1-D operand lost a gradient"
    gradcheck(ops.matmul, a, b, name="matmul 1-D")


@pytest.mark.parametrize("sx", [(4, 3), (2, 3, 3), (2, 2, 1, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(sx, bias):
    x, w, b = rnd(*sx, seed=12), rnd(3, 5, seed=13), rnd(5, seed=14)
    if bias:
        np.testing.assert_allclose(ops.linear(Tensor(x), Tensor(w), Tensor(b)).data, x @ w + b, rtol=1e-14)
        gradcheck(ops.linear, x, w, b, name="linear")
    else:
        np.testing.assert_allclose(ops.linear(Tensor(x), Tensor(w)).data, x @ w, rtol=1e-14)
        gradcheck(ops.linear, x, w, name="linear (no bias)")


@pytest.mark.parametrize("op", ["matmul", "linear"])
def test_partial_requires_grad(op):
    """Only the weight requires grad (data x), then only x (frozen weight): the grads that
    are computed equal those of the all-requires-grad run; the others stay None."""
    x, w = rnd(2, 3, 4, seed=15), rnd(4, 5, seed=16)
    g = rnd(2, 3, 5, seed=17)
    f = ops.matmul if op == "matmul" else ops.linear
    xt, wt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
    f(xt, wt).backward(g)
    for x_rg, w_rg in ((False, True), (True, False)):
        xs, ws = Tensor(x, requires_grad=x_rg), Tensor(w, requires_grad=w_rg)
        f(xs, ws).backward(g)
        for t, full, rg in ((xs, xt.grad, x_rg), (ws, wt.grad, w_rg)):
            if rg:
                np.testing.assert_allclose(t.grad, full, rtol=1e-14)
            else:
                assert t.grad is None


# --- shape ops -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(6, 4), (2, 3, 4), (24,), (-1, 2, 3)])
def test_reshape(shape):
    x = rnd(2, 12, seed=18)
    np.testing.assert_array_equal(ops.reshape(Tensor(x), shape).data, x.reshape(shape))
    gradcheck(lambda t: ops.reshape(t, shape), x, name="reshape")
    gradcheck(lambda t: t.reshape(*shape), x, name="reshape")


@pytest.mark.parametrize("axes", [None, (1, 0, 2), (2, 0, 1), (0, 2, 1)])
def test_transpose(axes):
    x = rnd(2, 3, 4, seed=19)
    np.testing.assert_array_equal(ops.transpose(Tensor(x), axes).data, np.transpose(x, axes))
    gradcheck(lambda t: ops.transpose(t, axes), x, name="transpose")


@pytest.mark.parametrize("sections,axis", [(3, -1), (2, 0), ([1, 4], -1), ([2], 1), ([0, 3, 3], 2)])
def test_split(sections, axis):
    x = rnd(4, 3, 6, seed=20)
    pieces = ops.split(Tensor(x), sections, axis=axis)
    ref = np.split(x, sections, axis=axis)
    assert len(pieces) == len(ref)
    for p, r in zip(pieces, ref):
        np.testing.assert_array_equal(p.data, r)
    # weight each piece differently so that a piece landing in the wrong place is caught
    gradcheck(lambda t: ops.concat([p * float(i + 1) for i, p in enumerate(ops.split(t, sections, axis=axis))],
                                   axis=axis), x, name="split")


def test_split_unused_pieces_get_zero_grad():
    x = rnd(2, 6, seed=21)
    gradcheck(lambda t: ops.split(t, 3, axis=1)[1], x, name="split")


def test_split_int_needs_equal_division():
    """np.split semantics: an int that does not divide the axis is an error, never a
    different number of pieces."""
    x = Tensor(rnd(2, 7, seed=22))
    with pytest.raises(ValueError):
        ops.split(x, 2, axis=1)   # np.split raises here; minipar returns 3 pieces (3, 3, 1)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(axis):
    shapes = {0: [(1, 3, 2), (2, 3, 2), (3, 3, 2)], 1: [(2, 1, 2), (2, 4, 2), (2, 2, 2)],
              -1: [(2, 3, 1), (2, 3, 3), (2, 3, 2)]}[axis]
    xs = [rnd(*s, seed=23 + i) for i, s in enumerate(shapes)]
    np.testing.assert_array_equal(ops.concat([Tensor(a) for a in xs], axis=axis).data,
                                  np.concatenate(xs, axis=axis))
    gradcheck(lambda *ts: ops.concat(list(ts), axis=axis), *xs, name="concat")


def test_concat_with_constant_input():
    x, c = rnd(2, 3, seed=26), rnd(2, 2, seed=27)
    gradcheck(lambda t: ops.concat([t, Tensor(c)], axis=1), x, name="concat")


@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2), (-1, 0), (0, 1, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_sum_mean(axis, keepdims):
    x = rnd(2, 3, 4, seed=28)
    np.testing.assert_allclose(ops.sum(Tensor(x), axis, keepdims).data, x.sum(axis=axis, keepdims=keepdims),
                               rtol=1e-14)
    np.testing.assert_allclose(ops.mean(Tensor(x), axis, keepdims).data, x.mean(axis=axis, keepdims=keepdims),
                               rtol=1e-14)
    gradcheck(lambda t: ops.sum(t, axis, keepdims), x, name="sum")
    gradcheck(lambda t: ops.mean(t, axis, keepdims), x, name="mean")
    gradcheck(lambda t: t.mean(axis=axis, keepdims=keepdims), x, name="mean")


# --- embedding ---------------------------------------------------------------------------------

def test_embedding_repeated_ids():
    w = rnd(5, 3, seed=29)
    idx = np.array([[1, 1, 3, 1], [0, 3, 1, 1]])            # id 1 five times, id 3 twice, 2 and 4 never
    np.testing.assert_array_equal(ops.embedding(idx, Tensor(w)).data, w[idx])
    gradcheck(lambda t: ops.embedding(idx, t), w, name="embedding")
    # the gradient is one-hot(idx)^T @ g: compare exactly with that, row by row
    g = rnd(2, 4, 3, seed=30)
    wt = Tensor(w, requires_grad=True)
    ops.embedding(idx, wt).backward(g)
    onehot = np.eye(5)[idx.reshape(-1)]                        # (8, 5)
    np.testing.assert_allclose(wt.grad, onehot.T @ g.reshape(-1, 3), rtol=1e-14)
    assert np.all(wt.grad[[2, 4]] == 0)


def test_embedding_1d_and_3d_ids():
    w = rnd(4, 2, seed=31)
    for idx in (np.array([2, 2, 0]), np.array([[[3, 3], [3, 1]], [[0, 0], [2, 3]]])):
        gradcheck(lambda t: ops.embedding(idx, t), w, name="embedding")


# --- layer_norm, gelu, softmax --------------------------------------------------------------------

@pytest.mark.parametrize("sx", [(3, 6), (2, 3, 5), (1, 1, 4)])
def test_layer_norm(sx):
    C = sx[-1]
    x, w, b = rnd(*sx, seed=32) * 2 + 0.7, rnd(C, seed=33), rnd(C, seed=34)
    np.testing.assert_allclose(ops.layer_norm(Tensor(x), Tensor(w), Tensor(b)).data,
                               ops.LayerNormReference.forward(x, w, b)[0], rtol=1e-12, atol=1e-13)
    gradcheck(ops.layer_norm, x, w, b, name="layer_norm")


def test_layer_norm_eps_argument():
    x, w, b = rnd(2, 4, seed=35) * 1e-3, rnd(4, seed=36), rnd(4, seed=37)  # var ~ eps: eps matters
    np.testing.assert_allclose(ops.layer_norm(Tensor(x), Tensor(w), Tensor(b), eps=1e-3).data,
                               ops.LayerNormReference.forward(x, w, b, eps=1e-3)[0], rtol=1e-12, atol=1e-13)
    gradcheck(lambda x, w, b: ops.layer_norm(x, w, b, eps=1e-3), x * 1e3, w, b, name="layer_norm")


def test_gelu():
    x = np.concatenate([rnd(3, 4, seed=38) * 2, [[-8.0, -3.0, 0.0, 6.0]]])
    np.testing.assert_allclose(ops.gelu(Tensor(x)).data, ops.GELUReference.forward(x)[0], rtol=1e-14, atol=1e-16)
    gradcheck(ops.gelu, x, name="gelu")


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax(axis):
    x = rnd(3, 4, 5, seed=39) * 2
    y = ops.softmax(Tensor(x), axis=axis).data
    e = np.exp(x - x.max(axis, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(axis, keepdims=True), rtol=1e-14)
    gradcheck(lambda t: ops.softmax(t, axis=axis), x, name="softmax")


def test_softmax_large_inputs_stable():
    x = np.array([[1e4, 1e4 - 1.0, -1e4], [-5e3, -5e3, -5e3]])
    y = ops.softmax(Tensor(x)).data
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, ops.softmax(Tensor(x - x.max(-1, keepdims=True))).data, rtol=1e-15)


# --- causal self-attention ---------------------------------------------------------------------

@pytest.mark.parametrize("B,T,C,nh", [(2, 4, 8, 1), (2, 4, 8, 2), (1, 5, 8, 4), (2, 1, 6, 3), (1, 3, 4, 4)])
def test_causal_self_attention(B, T, C, nh):
    qkv = rnd(B, T, 3 * C, seed=40 + nh)
    np.testing.assert_allclose(ops.causal_self_attention(Tensor(qkv), nh).data,
                               ops.CausalSelfAttentionReference.forward(qkv, nh)[0], rtol=1e-12, atol=1e-14)
    gradcheck(lambda t: ops.causal_self_attention(t, nh), qkv, name="causal_self_attention")


def test_causal_self_attention_is_causal():
    B, T, C, nh = 2, 6, 8, 2
    qkv = rnd(B, T, 3 * C, seed=45)
    y = ops.causal_self_attention(Tensor(qkv), nh).data
    for t in range(T - 1):
        changed = qkv.copy()
        changed[:, t + 1:] = rnd(B, T - t - 1, 3 * C, seed=46 + t) * 10
        y2 = ops.causal_self_attention(Tensor(changed), nh).data
        np.testing.assert_allclose(y2[:, :t + 1], y[:, :t + 1], rtol=0, atol=1e-14,
                                   err_msg=f"output at positions <= {t} depends on later inputs")
        assert not np.allclose(y2[:, t + 1:], y[:, t + 1:])
        # and backward: a gradient on position t reaches no later input
        x = Tensor(qkv, requires_grad=True)
        g = np.zeros((B, T, C))
        g[:, t] = 1.0
        ops.causal_self_attention(x, nh).backward(g)
        assert np.all(x.grad[:, t + 1:] == 0), f"gradient of position {t} leaks to later positions"
        assert np.any(x.grad[:, :t + 1] != 0)


# --- cross entropy -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 7)])
@pytest.mark.parametrize("denom", [None, 17, 2.5])
def test_cross_entropy(shape, denom):
    logits = rnd(*shape, seed=50) * 2
    targets = np.random.default_rng(51).integers(0, shape[-1], size=shape[:-1])
    targets.flat[0] = targets.flat[1]                           # a repeated target
    loss = ops.cross_entropy(Tensor(logits), targets, denom)
    assert loss.shape == ()
    np.testing.assert_allclose(loss.item(), ops.CrossEntropyReference.forward(logits, targets, denom)[0], rtol=1e-13)
    gradcheck(lambda t: ops.cross_entropy(t, targets, denom), logits, name="cross_entropy")


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_cross_entropy_large_logits(dtype, rtol):
    """Logits around 1e4: finite loss, and loss and gradient equal those of the same logits
    shifted per row (cross-entropy is shift invariant), computed with small numbers."""
    rng = np.random.default_rng(52)
    small = rng.standard_normal((3, 2, 6)) * 3
    shift = rng.choice([-1e4, 1e4], size=(3, 2, 1))
    targets = rng.integers(0, 6, size=(3, 2))
    big = Tensor((small + shift).astype(dtype), requires_grad=True)
    loss_big = ops.cross_entropy(big, targets)
    loss_big.backward()
    assert np.isfinite(loss_big.item()) and np.all(np.isfinite(big.grad))
    # reference: the float32-rounded big logits minus the shift, in float64
    ref_logits = big.data.astype(np.float64) - shift
    ref = Tensor(ref_logits, requires_grad=True)
    ops.cross_entropy(ref, targets).backward()
    np.testing.assert_allclose(loss_big.item(), ops.CrossEntropyReference.forward(ref_logits, targets)[0], rtol=rtol)
    np.testing.assert_allclose(big.grad, ref.grad, rtol=rtol, atol=rtol * 1e-2)
    # a row with one logit 1e4 above the rest: probability 1, loss 0 or 1e4
    lg = np.array([[1e4, 0.0, -1e4]], dtype=dtype)
    np.testing.assert_allclose(ops.cross_entropy(Tensor(lg), np.array([0])).item(), 0.0, atol=1e-6)
    np.testing.assert_allclose(ops.cross_entropy(Tensor(lg), np.array([1])).item(), 1e4, rtol=1e-6)


def test_cross_entropy_grad_scales_with_upstream():
    logits, targets = rnd(3, 4, seed=53), np.array([0, 3, 3])
    a = Tensor(logits, requires_grad=True)
    ops.cross_entropy(a, targets).backward(np.array(2.5))
    b = Tensor(logits, requires_grad=True)
    ops.cross_entropy(b, targets).backward()
    np.testing.assert_allclose(a.grad, 2.5 * b.grad, rtol=1e-14)


# --- the plain references beside the tuned ops ------------------------------------------------

def reference_gradcheck(ref, *arrays, args=(), name):
    """Central finite differences on a plain-NumPy reference: for a random w of the output's
    shape, ref.backward(w, cache) must be the gradient of L = sum(ref.forward(...)[0] * w)
    for every array. The references check the fast ops below, so they are checked first."""
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    out, cache = ref.forward(*arrays, *args)
    w = np.random.default_rng(0).standard_normal(np.shape(out))
    grads = ref.backward(w, cache)
    grads = grads if isinstance(grads, tuple) else (grads,)

    def objective():
        return float(np.sum(ref.forward(*arrays, *args)[0] * w))

    for i, a in enumerate(arrays):
        e = rel_err(grads[i], numerical_grad(objective, a, EPS))
        record(name, e)
        assert e < TOL, f"{name}: input {i} shape {a.shape}: max relative error {e:.3e} >= {TOL:.0e}"


X_BIG = rnd(3, 300, 96, seed=82)        # 900 rows of 96: two row blocks of the tuned loops, the last ragged

# name -> (fast op on Tensors, its reference, float64 inputs, non-differentiable arguments)
REFERENCE_CASES = {
    "linear": (ops.linear, ops.LinearReference, [rnd(2, 3, 4, seed=80), rnd(4, 5), rnd(5, seed=81)], ()),
    "linear no bias": (ops.linear, ops.LinearReference, [rnd(2, 4, 3, seed=80), rnd(3, 5)], ()),
    "layer_norm": (ops.layer_norm, ops.LayerNormReference,
                   [rnd(2, 3, 5, seed=83) * 2 + 0.7, rnd(5, seed=84), rnd(5, seed=85)], ()),
    "layer_norm eps": (ops.layer_norm, ops.LayerNormReference,
                       [rnd(2, 4, seed=86), rnd(4, seed=87), rnd(4, seed=88)], (0.3,)),
    "gelu": (ops.gelu, ops.GELUReference, [np.concatenate([rnd(3, 4, seed=89) * 2, [[-8.0, -3.0, 0.0, 6.0]]])], ()),
    "causal_self_attention": (ops.causal_self_attention, ops.CausalSelfAttentionReference,
                              [rnd(2, 4, 3 * 8, seed=90)], (2,)),
    "causal_self_attention one head": (ops.causal_self_attention, ops.CausalSelfAttentionReference,
                                       [rnd(1, 5, 3 * 4, seed=91)], (1,)),
    "cross_entropy": (ops.cross_entropy, ops.CrossEntropyReference, [rnd(2, 3, 7, seed=92) * 2],
                      (np.array([[1, 0, 6], [6, 6, 2]]),)),
    "cross_entropy denom": (ops.cross_entropy, ops.CrossEntropyReference, [rnd(4, 5, seed=93) * 2],
                            (np.array([4, 0, 0, 3]), 17)),
}
# big enough to run several row blocks: compared with the reference only (finite differences
# on 86,400 inputs would take minutes)
BIG_CASES = {
    "layer_norm rows in blocks": (ops.layer_norm, ops.LayerNormReference, [X_BIG, rnd(96), rnd(96, seed=1)], ()),
    "gelu rows in blocks": (ops.gelu, ops.GELUReference, [X_BIG * 3], ()),
    "causal_self_attention T=64": (ops.causal_self_attention, ops.CausalSelfAttentionReference,
                                   [rnd(2, 64, 3 * 32, seed=94)], (4,)),
    "cross_entropy V=300": (ops.cross_entropy, ops.CrossEntropyReference, [rnd(2, 50, 300, seed=95) * 3],
                            (np.random.default_rng(96).integers(0, 300, size=(2, 50)),)),
}


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_reference_against_finite_differences(case):
    _, ref, arrays, args = REFERENCE_CASES[case]
    reference_gradcheck(ref, *arrays, args=args, name=ref.__name__)


@pytest.mark.parametrize("case", list(REFERENCE_CASES) + list(BIG_CASES))
def test_fast_op_matches_reference(case):
    """The tuned op's output and every input gradient equal the plain formula's, in float64."""
    assert_fast_matches_reference(case, *{**REFERENCE_CASES, **BIG_CASES}[case])


def assert_fast_matches_reference(case, fast, ref, arrays, args):
    """fast(*Tensors, *args) and its backward of a random output gradient against ref's
    forward and backward, at 1e-12 in float64."""
    out_ref, cache = ref.forward(*arrays, *args)
    dout = rnd(*np.shape(out_ref), seed=97)
    grads_ref = ref.backward(dout, cache)
    grads_ref = grads_ref if isinstance(grads_ref, tuple) else (grads_ref,)
    ts = [Tensor(a, requires_grad=True) for a in arrays]
    out = fast(*ts, *args)
    out.backward(dout)
    np.testing.assert_allclose(out.data, out_ref, rtol=1e-12, atol=1e-14, err_msg=f"{case}: forward")
    for i, t in enumerate(ts):
        np.testing.assert_allclose(t.grad, grads_ref[i], rtol=1e-12, atol=1e-14,
                                   err_msg=f"{case}: gradient of input {i} of {len(ts)}")


# --- dtypes: float32 stays float32 ---------------------------------------------------------------

IDX = np.array([[1, 0, 1], [2, 2, 3]])
TGT = np.array([[1, 0, 4], [4, 2, 3]])

# name -> (function of Tensors, input shapes)
DTYPE_CASES = {
    "add": (ops.add, [(2, 3), (3,)]),
    "add scalar": (lambda a: a + 2.0, [(2, 3)]),
    "mul": (ops.mul, [(2, 3), (2, 1)]),
    "mul scalar": (lambda a: 3.0 * a, [(2, 3)]),
    "matmul": (ops.matmul, [(2, 3, 4), (4, 5)]),
    "matmul batched": (ops.matmul, [(2, 3, 4), (2, 4, 5)]),
    "matmul transposed": (lambda a, b: ops.matmul(a, ops.transpose(b)), [(2, 3, 4), (5, 4)]),
    "linear": (ops.linear, [(2, 3, 4), (4, 5), (5,)]),
    "linear no bias": (ops.linear, [(2, 3, 4), (4, 5)]),
    "reshape": (lambda a: ops.reshape(a, (3, 2)), [(2, 3)]),
    "transpose": (lambda a: ops.transpose(a, (1, 0, 2)), [(2, 3, 4)]),
    "split": (lambda a: ops.split(a, [1], axis=1)[1], [(2, 3)]),
    "concat": (lambda a, b: ops.concat([a, b], axis=0), [(2, 3), (1, 3)]),
    "sum": (lambda a: ops.sum(a, 1), [(2, 3)]),
    "sum all": (ops.sum, [(2, 3)]),
    "mean": (lambda a: ops.mean(a, (0, 1), True), [(2, 3, 2)]),
    "mean all": (ops.mean, [(2, 3)]),
    "embedding": (lambda w: ops.embedding(IDX, w), [(5, 3)]),
    "layer_norm": (ops.layer_norm, [(2, 3, 4), (4,), (4,)]),
    "gelu": (ops.gelu, [(2, 3)]),
    "softmax": (ops.softmax, [(2, 3)]),
    "causal_self_attention": (lambda a: ops.causal_self_attention(a, 2), [(2, 3, 12)]),
    "cross_entropy": (lambda a: ops.cross_entropy(a, TGT), [(2, 3, 5)]),
    "cross_entropy denom": (lambda a: ops.cross_entropy(a, TGT, 7), [(2, 3, 5)]),
}


@pytest.mark.parametrize("name", list(DTYPE_CASES))
def test_float32_stays_float32(name):
    f, shapes = DTYPE_CASES[name]
    arrays = [rnd(*s, seed=60 + i) for i, s in enumerate(shapes)]
    ts32 = [Tensor(a.astype(np.float32), requires_grad=True) for a in arrays]
    ts64 = [Tensor(a, requires_grad=True) for a in arrays]
    out32, out64 = f(*ts32), f(*ts64)
    assert out32.dtype == np.float32, f"{name}: float32 inputs gave a {out32.dtype} output"
    g = rnd(*out32.shape, seed=70)
    out32.backward(g.astype(np.float32))
    out64.backward(g)
    np.testing.assert_allclose(out32.data, out64.data, rtol=2e-5, atol=2e-6, err_msg=name)
    for i, (t32, t64) in enumerate(zip(ts32, ts64)):
        assert t32.grad.dtype == np.float32, f"{name}: input {i} grad is {t32.grad.dtype}"
        np.testing.assert_allclose(t32.grad, t64.grad, rtol=2e-4, atol=2e-5, err_msg=f"{name} input {i}")


def test_every_public_op_is_gradchecked():
    """A new public function in ops.py without a finite-difference check here fails."""
    import re
    with open(__file__) as f:
        checked = {n.split(" ")[0] for n in re.findall(r'name="([^"]+)"', f.read())}
    api = {n for n in dir(ops) if not n.startswith("_") and n[0].islower() and callable(getattr(ops, n))
           and getattr(getattr(ops, n), "__module__", None) == ops.__name__}
    assert api <= checked, f"ops without a gradcheck in {__file__}: {sorted(api - checked)}"
