"""Lab 01's seam and criteria (labs/framework.py says what a lab is).

Seam: the backward of minipar.ops.LayerNorm, ops.CrossEntropy and ops.Softmax. minipar's fast
forwards save what their own backward wants (xhat and rstd; the probabilities), not the
inputs the student's functions start from, so install() wraps each forward to keep its input
too (the forward itself is minipar's, untouched: the loss is bit for bit the same) and replaces
each backward by one that calls the student's function on plain (N, C) / (N, V) arrays.
Oracles: central finite differences of the forwards (ops.LayerNormReference.forward,
ops.CrossEntropyReference.forward, and the softmax written here); minipar's plain reference
backwards (ops.LayerNormReference, ops.CrossEntropyReference; ops.Softmax's own for the
softmax), called directly, never through the seam; and a whole GPT's gradients from minipar's
own backwards, taken before install() swaps them.
"""
import numpy as np

from labs.framework import Criterion, first_difference
from minipar import ops
from minipar.model import GPT, GPTConfig
from minipar.precision import compute, store

TITLE = "autograd: the backward of LayerNorm, softmax and cross-entropy"
EPS = 1e-5                                      # minipar's LayerNorm eps (docs/design.md §1)


def rng_for(*key):
    return np.random.default_rng([1, *key])


def expect(got, want, what, rtol, atol=0.0):
    diff = first_difference(got, want, rtol=rtol, atol=atol)
    assert diff is None, f"{what}: {diff}"


def untouched(arrays, kept, what):
    for (name, a), k in zip(arrays.items(), kept):
        assert np.array_equal(a, k), f"{what}: the input {name} was modified"


def returned(result, count, what, names):
    """The student's result as a tuple of `count` arrays (a helpful message if not)."""
    if count == 1:
        assert isinstance(result, np.ndarray), f"{what}: returned {type(result).__name__}, not an array"
        return (result,)
    assert isinstance(result, (tuple, list)) and len(result) == count, \
        f"{what}: returned {type(result).__name__}, want a tuple ({', '.join(names)})"
    return result


# --- the forwards, and their derivatives by finite differences ----------------------------

def softmax(x):
    """softmax over the last axis, stably: exp(x - max) / sum exp(x - max)."""
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def numerical_grad(f, x, h):
    """dL/dx for the scalar L = f(x), one element at a time, by the 4-point central stencil
    (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h: error O(h^4) plus L's rounding / h
    (and exactly 0 where L does not move).
    h is a power of two, so x +- h is exact wherever h is a multiple of x's last bit."""
    x = x.copy()
    grad = np.zeros_like(x)
    for i in range(x.size):
        keep = x.flat[i]
        values = []
        for k in (2, 1, -1, -2):
            x.flat[i] = keep + k * h
            values.append(f(x))
        x.flat[i] = keep
        grad.flat[i] = (8 * (values[1] - values[2]) - (values[0] - values[3])) / (12 * h)
    return grad


def power_of_two(scale):
    """2^-10 of `scale`, rounded to a power of two: the finite-difference step."""
    return 2.0 ** (np.round(np.log2(scale)) - 10)


def fd_close(got, want, what):
    """Agreement with a finite difference: 1e-7 relative, and 1e-7 of the largest entry
    absolute (an entry near 0 is a difference of two large terms)."""
    size = float(np.abs(want).max()) if want.size and np.abs(want).max() > 0 else 1.0
    expect(got, want, what, rtol=1e-7, atol=1e-7 * size)


def ref_close(got, want, what):
    """Agreement with minipar's formula in float64: 1e-12 relative, and 1e-12 of the largest
    entry absolute (the same sums, added in another order)."""
    size = float(np.abs(want).max()) if want.size and np.abs(want).max() > 0 else 1.0
    expect(got, want, what, rtol=1e-12, atol=1e-12 * size)


# --- the cases ----------------------------------------------------------------------------

# (label, N, C, x scale, x offset, eps): rows of C channels, x = offset + scale * N(0, 1)
LAYERNORM_FD = [
    ("N=3 C=5", 3, 5, 1.0, 0.0, EPS),
    ("N=4 C=1 (one channel: variance 0)", 4, 1, 1.0, 0.0, EPS),
    ("N=2 C=16 x ~ 1e3", 2, 16, 1e3, 0.0, EPS),
    ("N=5 C=8 x ~ 1e-3 (variance below eps)", 5, 8, 1e-3, 0.0, EPS),
    ("N=1 C=7 x ~ 3 + N(0,1)", 1, 7, 1.0, 3.0, EPS),
    ("N=3 C=6 eps=1e-3", 3, 6, 0.1, 0.0, 1e-3),
]

# (label, shape, scale): softmax over the last axis of x = scale * N(0, 1)
SOFTMAX_FD = [
    ("shape (4, 6)", (4, 6), 2.0),
    ("shape (2, 3, 5)", (2, 3, 5), 1.0),
    ("shape (3, 4) x ~ 10 (nearly one-hot)", (3, 4), 10.0),
]

# (label, N, V, logit scale, row offset, loss_denom, dloss); offset "+-" puts each row at +1e4 or -1e4
CROSS_ENTROPY_FD = [
    ("N=4 V=5 loss_denom=4", 4, 5, 2.0, 0.0, 4.0, 1.0),
    ("N=3 V=7 loss_denom=10 dloss=2.5", 3, 7, 2.0, 0.0, 10.0, 2.5),
    ("N=4 V=6 logits +-1e4 loss_denom=8", 4, 6, 3.0, "+-", 8.0, 1.0),
    ("N=6 V=3 repeated targets loss_denom=2.5 dloss=0.5", 6, 3, 1.0, 0.0, 2.5, 0.5),
]


def layernorm_case(N, C, scale, offset, seed):
    r = rng_for(seed, N, C)
    x = offset + scale * r.standard_normal((N, C))
    w, b = 1.0 + 0.5 * r.standard_normal(C), r.standard_normal(C)
    dout = r.standard_normal((N, C))
    return x, w, b, dout


def cross_entropy_case(N, V, scale, offset, seed):
    r = rng_for(seed, N, V)
    logits = scale * r.standard_normal((N, V))
    if offset == "+-":
        logits += r.choice([-1e4, 1e4], size=(N, 1))
    targets = r.integers(0, V, size=N)
    if N >= 3:
        targets[1] = targets[2] = targets[0]                  # rows sharing a target
    return logits, targets


# --- the criteria -------------------------------------------------------------------------

def check_layernorm_fd(student):
    for label, N, C, scale, offset, eps in LAYERNORM_FD:
        x, w, b, dout = layernorm_case(N, C, scale, offset, seed=0)
        what = f"layernorm_backward, {label}, float64"
        inputs = {"dout": dout, "x": x, "w": w}
        kept = [a.copy() for a in inputs.values()]
        dx, dw, db = returned(student.layernorm_backward(dout, x, w, eps), 3, what, ["dx", "dw", "db"])
        untouched(inputs, kept, what)

        def loss(x_, w_=w, b_=b):                             # L = sum(out * dout): dL/dout = dout
            return float((ops.LayerNormReference.forward(x_, w_, b_, eps)[0] * dout).sum())

        fd_close(dx, numerical_grad(lambda v: loss(v), x, power_of_two(scale)), f"{what}: dx")
        fd_close(dw, numerical_grad(lambda v: loss(x, v), w, power_of_two(1.0)), f"{what}: dw")
        fd_close(db, numerical_grad(lambda v: loss(x, w, v), b, power_of_two(1.0)), f"{what}: db")


def check_softmax_fd(student):
    for label, shape, scale in SOFTMAX_FD:
        r = rng_for(1, *shape)
        x, dout = scale * r.standard_normal(shape), r.standard_normal(shape)
        y = softmax(x)
        what = f"softmax_backward, {label}, float64"
        inputs = {"dout": dout, "y": y}
        kept = [a.copy() for a in inputs.values()]
        (dx,) = returned(student.softmax_backward(dout, y), 1, what, ["dx"])
        untouched(inputs, kept, what)
        fd_close(dx, numerical_grad(lambda v: float((softmax(v) * dout).sum()), x, power_of_two(1.0)),
                 f"{what}: dx")


def check_cross_entropy_fd(student):
    for label, N, V, scale, offset, denom, dloss in CROSS_ENTROPY_FD:
        logits, targets = cross_entropy_case(N, V, scale, offset, seed=2)
        what = f"cross_entropy_backward, {label}, float64"
        inputs = {"logits": logits, "targets": targets}
        kept = [a.copy() for a in inputs.values()]
        (d,) = returned(student.cross_entropy_backward(logits, targets, dloss, denom), 1, what, ["dlogits"])
        untouched(inputs, kept, what)

        def objective(z):                                     # dloss * loss
            return dloss * float(ops.CrossEntropyReference.forward(z, targets, denom)[0])

        fd_close(d, numerical_grad(objective, logits, power_of_two(1.0)), f"{what}: dlogits")


def check_reference(student):
    """Bigger cases, against minipar's own formulas (called directly: the seam is not
    installed in this process) at 1e-12."""
    for label, N, C, scale, offset in [("N=24 C=32", 24, 32, 1.0, 0.0), ("N=6 C=1", 6, 1, 1.0, 0.0),
                                       ("N=64 C=96 x ~ 2 + 1e3 N(0,1)", 64, 96, 1e3, 2.0),
                                       ("N=10 C=7 x ~ 1e-3", 10, 7, 1e-3, 0.0)]:
        x, w, b, dout = layernorm_case(N, C, scale, offset, seed=3)
        want = ops.LayerNormReference.backward(dout, ops.LayerNormReference.forward(x, w, b, EPS)[1])
        what = f"layernorm_backward, {label}, float64, vs ops.LayerNormReference"
        got = returned(student.layernorm_backward(dout, x, w, EPS), 3, what, ["dx", "dw", "db"])
        for name, g, wnt in zip(("dx", "dw", "db"), got, want):
            ref_close(g, wnt, f"{what}: {name}")

    for label, shape in [("shape (8, 16, 16)", (8, 16, 16)), ("shape (5, 300)", (5, 300))]:
        r = rng_for(4, *shape)
        y, dout = softmax(3.0 * r.standard_normal(shape)), r.standard_normal(shape)
        node = ops.Softmax()                                  # minipar's own backward, on a node holding y
        node.save(y)
        node.axis, node.dtype = -1, y.dtype
        what = f"softmax_backward, {label}, float64, vs ops.Softmax.backward"
        (got,) = returned(student.softmax_backward(dout, y), 1, what, ["dx"])
        ref_close(got, node.backward(dout)[0], f"{what}: dx")

    for label, N, V, scale, offset, denom, dloss in [
            ("N=32 V=50 loss_denom=32", 32, 50, 2.0, 0.0, 32.0, 1.0),
            ("N=16 V=256 logits +-1e4 loss_denom=64 dloss=0.5", 16, 256, 3.0, "+-", 64.0, 0.5),
            ("N=5 V=3 loss_denom=2.5 dloss=3", 5, 3, 1.0, 0.0, 2.5, 3.0)]:
        logits, targets = cross_entropy_case(N, V, scale, offset, seed=5)
        cache = ops.CrossEntropyReference.forward(logits, targets, denom)[1]
        want = ops.CrossEntropyReference.backward(dloss, cache)
        what = f"cross_entropy_backward, {label}, float64, vs ops.CrossEntropyReference"
        (got,) = returned(student.cross_entropy_backward(logits, targets, dloss, denom), 1, what, ["dlogits"])
        ref_close(got, want, f"{what}: dlogits")


GPT_CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def check_gpt(student):
    """A tiny GPT in float64: every parameter's gradient with the student's backwards at the
    seam, against minipar's own gradients taken before the swap."""
    cfg, B = GPT_CONFIG, 3
    T, denom = cfg.block_size, 4.0 * 3 * cfg.block_size     # loss_denom as with 4 micro-batches
    r = rng_for(6)
    idx, targets = r.integers(0, cfg.vocab_size, size=(B, T)), r.integers(0, cfg.vocab_size, size=(B, T))
    model = GPT(cfg, seed=7, dtype=np.float64)

    def gradients():
        for p in model.params.values():
            p.grad = None
        loss = model(idx, targets, loss_denom=denom)
        loss.backward()
        return loss.item(), {name: p.grad.copy() for name, p in model.params.items()}

    want_loss, want = gradients()                             # minipar's own backwards
    calls = install(student)
    got_loss, got = gradients()                               # the student's, at the seam
    case = (f"GPT L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd} V={cfg.vocab_size}, B={B} T={T}, "
            f"loss_denom={denom:g}, float64")
    ran = 2 * cfg.n_layer + 2                                 # 2L + 1 LayerNorms and the loss
    assert calls() == ran, f"{case}: the seam ran the student's backward {calls()} times, want {ran} (a lab bug)"
    assert got_loss == want_loss, f"{case}: the loss changed, {got_loss!r} != {want_loss!r} (a lab bug)"
    bad = []
    for name in reversed(list(model.params)):                 # walking back from the loss
        size = float(np.abs(want[name]).max()) or 1.0
        diff = first_difference(got[name], want[name], rtol=1e-12, atol=1e-12 * size)
        if diff is not None:
            bad.append((name, diff))
    if bad:
        name, diff = bad[0]
        others = f"; {len(bad) - 1} more parameter(s) wrong" if len(bad) > 1 else ""
        raise AssertionError(f"{case}: gradient of {name} (the first wrong one walking back from the loss): "
                             f"{diff}{others}")


# --- the seam -----------------------------------------------------------------------------

def install(student):
    """ops.LayerNorm, ops.CrossEntropy and ops.Softmax compute their backward with the
    student's functions, on this process; the forwards stay minipar's. -> calls()."""
    calls = [0]
    ln_forward, ce_forward = ops.LayerNorm.forward, ops.CrossEntropy.forward

    def layer_norm_forward(self, x, w, b, eps=EPS):
        self.lab_input = (x, eps)                             # the fast op saves xhat and rstd, not x
        return ln_forward(self, x, w, b, eps)

    def layer_norm_backward(self, g):
        calls[0] += 1
        (x, eps), (_, w, _) = self.lab_input, self.saved      # w as the forward computed with it
        C = x.shape[-1]
        dx, dw, db = student.layernorm_backward(compute(g).reshape(-1, C), compute(x).reshape(-1, C), w, eps)
        return store(dx.reshape(g.shape), self.dtype), store(dw, self.dtype), store(db, self.dtype), None

    def cross_entropy_forward(self, logits, targets, denom=None):
        self.lab_logits = logits                              # the fast op saves the probabilities
        return ce_forward(self, logits, targets, denom)

    def cross_entropy_backward(self, g):
        calls[0] += 1
        (_, t), V = self.saved, self.shape[-1]
        d = student.cross_entropy_backward(compute(self.lab_logits).reshape(-1, V), t, float(g), self.denom)
        return store(d.reshape(self.shape), self.dtype), None, None

    def softmax_backward(self, g):
        calls[0] += 1
        (y,) = self.saved
        dx = student.softmax_backward(np.moveaxis(compute(g), self.axis, -1), np.moveaxis(y, self.axis, -1))
        return store(np.moveaxis(dx, -1, self.axis), self.dtype), None

    ops.LayerNorm.forward, ops.LayerNorm.backward = layer_norm_forward, layer_norm_backward
    ops.CrossEntropy.forward, ops.CrossEntropy.backward = cross_entropy_forward, cross_entropy_backward
    ops.Softmax.backward = softmax_backward
    return lambda: calls[0]


CRITERIA = [
    Criterion("layernorm by finite differences", check=check_layernorm_fd, timeout=30,
              hint="x reaches xhat three ways: directly, through the mean and through the variance; "
                   "work one row (N=1, C=3) by hand first; the variance is biased (divided by C) and "
                   "ops.LayerNormReference.forward is the forward"),
    Criterion("softmax by finite differences", check=check_softmax_fd, timeout=30,
              hint="dx_i = sum_j dout_j dy_j/dx_i with dy_j/dx_i = y_j (delta_ij - y_i): write the "
                   "Jacobian for 3 entries by hand, then vectorise"),
    Criterion("cross-entropy by finite differences", check=check_cross_entropy_fd, timeout=30,
              hint="subtract each row's max before exp (exp(1e4) overflows); the loss is divided by "
                   "loss_denom and scaled by dloss; ops.CrossEntropyReference.forward is the forward"),
    Criterion("against minipar's reference formulas", check=check_reference, timeout=30,
              hint="right to 1e-7 but not to 1e-12 is a numerical gradient or a float32 step: "
                   "write the closed form, in float64 throughout"),
    Criterion("whole GPT gradients, float64", check=check_gpt, timeout=60,
              hint="return new arrays each call: the autograd engine (minipar.tensor.backward) keeps "
                   "a gradient you return, and adds to it later"),
]
