"""Lab 01's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): the backward of minipar.ops.LayerNorm, ops.CrossEntropy and ops.Softmax
becomes a call to the student's function on plain (N, C) / (N, V) arrays; the forwards stay
minipar's.
Oracles, all computed here from the inputs the grader rebuilds from the cases' seeds
(drive.*_case): central finite differences of the forwards (ops.LayerNormReference.forward,
ops.CrossEntropyReference.forward, and the softmax); minipar's plain reference backwards
(ops.LayerNormReference, ops.CrossEntropyReference; ops.Softmax's own for the softmax); and a
tiny GPT's gradients from minipar's own backwards, in this process, where nothing of the
student's is installed. The child only hands back what the student's functions returned, the
inputs as they were afterwards, which inputs each result shares memory with, and (for the
GPT) the loss, the gradients and how many times the seam ran.
"""
import os

import numpy as np

from labs.framework import Criterion, first_difference, load_drive
from labs.results import key, typename
from labs.judging import fresh, returned, scale_of, untouched
from labs.scan import Allowed
from minipar.autograd import ops

TITLE = "autograd: the backward of LayerNorm, softmax and cross-entropy"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
# Plain NumPy: the handout gives no minipar name, so every minipar import (minipar.ops above
# all, whose backwards are the answers) is refused by the scan.
ALLOWED = Allowed()
F32_TOL = 1e-4                  # float32 results: relative to the largest entry (--verify's float32)


def expect(got, want, what, rtol, atol=0.0):
    diff = first_difference(got, want, rtol=rtol, atol=atol)
    assert diff is None, f"{what}: {diff}"


def fd_close(got, want, what):
    """Agreement with a finite difference: 1e-7 relative, and 1e-7 of the largest entry
    absolute (an entry near 0 is a difference of two large terms)."""
    expect(got, want, what, rtol=1e-7, atol=1e-7 * scale_of(want))


def ref_close(got, want, what):
    """Agreement with minipar's formula in float64: 1e-12 relative, and 1e-12 of the largest
    entry absolute (the same sums, added in another order)."""
    expect(got, want, what, rtol=1e-12, atol=1e-12 * scale_of(want))


def f32_close(got, want, what):
    """A float32 result (of float32 inputs) against the formula in float64 on the same inputs:
    float32 itself, then F32_TOL relative and F32_TOL of the largest entry absolute."""
    if isinstance(got, np.ndarray) and got.dtype != np.float32:
        raise AssertionError(f"{what}: dtype {got.dtype}, want float32 (the inputs' dtype: a float64 constant "
                             f"or np.zeros/np.eye without dtype= widens the result)")
    expect(got, want.astype(np.float32), what, rtol=F32_TOL, atol=F32_TOL * scale_of(want))


# --- what came back from one call -----------------------------------------------------------

def result_of(res, family, i, names, inputs, what):
    """The returned arrays of case i of `family`, once the inputs are found untouched and no
    result aliases one."""
    k = key(family, i)
    got = returned(res, k, names, what)
    untouched(res, k, inputs, what)
    fresh(res, k, names, what, "the autograd engine keeps what you return and adds to it later")
    return got


# --- finite differences -----------------------------------------------------------------------

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


# --- the judges -------------------------------------------------------------------------------

def layernorm_want(x, w, b, dout, eps):
    """minipar's reference backward: (dx, dw, db)."""
    return ops.LayerNormReference.backward(dout, ops.LayerNormReference.forward(x, w, b, eps)[1])


def softmax_want(y, dout):
    """minipar's own backward (ops.Softmax's), on a node holding y."""
    node = ops.Softmax()
    node.save(y)
    node.axis, node.dtype = -1, y.dtype
    return node.backward(dout)[0]


def cross_entropy_want(logits, targets, dloss, denom):
    cache = ops.CrossEntropyReference.forward(logits, targets, denom)[1]
    return ops.CrossEntropyReference.backward(dloss, cache)


def judge_layernorm_fd(res):
    for i, (label, N, C, scale, offset, eps) in enumerate(drive.LAYERNORM_FD):
        x, w, b, dout = drive.layernorm_case(N, C, scale, offset, drive.SEED["ln_fd"])
        eps_value = drive.eps_args(eps)[2]
        what = f"layernorm_backward, {label}, float64"
        dx, dw, db = result_of(res, "ln_fd", i, ("dx", "dw", "db"), {"dout": dout, "x": x, "w": w}, what)

        def loss(x_, w_=w, b_=b):                             # L = sum(out * dout): dL/dout = dout
            return float((ops.LayerNormReference.forward(x_, w_, b_, eps_value)[0] * dout).sum())

        fd_close(dx, numerical_grad(lambda v: loss(v), x, power_of_two(scale)), f"{what}: dx")
        fd_close(dw, numerical_grad(lambda v: loss(x, v), w, power_of_two(1.0)), f"{what}: dw")
        fd_close(db, numerical_grad(lambda v: loss(x, w, v), b, power_of_two(1.0)), f"{what}: db")


def judge_softmax_fd(res):
    for i, (label, shape, scale) in enumerate(drive.SOFTMAX_FD):
        x, y, dout = drive.softmax_case(shape, scale, drive.SEED["sm_fd"])
        what = f"softmax_backward, {label}, float64"
        (dx,) = result_of(res, "sm_fd", i, ("dx",), {"dout": dout, "y": y}, what)
        fd_close(dx, numerical_grad(lambda v: float((drive.softmax(v) * dout).sum()), x, power_of_two(1.0)),
                 f"{what}: dx")


def judge_cross_entropy_fd(res):
    for i, (label, N, V, scale, offset, denom, dloss, tdtype) in enumerate(drive.CROSS_ENTROPY_FD):
        logits, targets = drive.cross_entropy_case(N, V, scale, offset, drive.SEED["ce_fd"], tdtype=tdtype)
        what = f"cross_entropy_backward, {label}, float64"
        (d,) = result_of(res, "ce_fd", i, ("dlogits",), {"logits": logits, "targets": targets}, what)

        def objective(z):                                     # dloss * loss
            return dloss * float(ops.CrossEntropyReference.forward(z, targets, denom)[0])

        fd_close(d, numerical_grad(objective, logits, power_of_two(1.0)), f"{what}: dlogits")


def judge_families(res, suffix, dtype, close, source):
    """The layernorm, softmax and cross-entropy cases of one family (ln_<suffix>, ...) against
    minipar's formulas in float64 on the same inputs, compared by close()."""
    for i, (label, N, C, scale, offset, eps) in enumerate(getattr(drive, f"LAYERNORM_{suffix.upper()}")):
        x, w, b, dout = drive.layernorm_case(N, C, scale, offset, drive.SEED[f"ln_{suffix}"], dtype)
        what = f"layernorm_backward, {label}, {dtype}, vs ops.LayerNormReference{source}"
        got = result_of(res, f"ln_{suffix}", i, ("dx", "dw", "db"), {"dout": dout, "x": x, "w": w}, what)
        want = layernorm_want(*(a.astype(np.float64) for a in (x, w, b, dout)), drive.eps_args(eps)[2])
        for name, g, wnt in zip(("dx", "dw", "db"), got, want):
            close(g, wnt, f"{what}: {name}")

    for i, (label, shape, scale) in enumerate(getattr(drive, f"SOFTMAX_{suffix.upper()}")):
        _, y, dout = drive.softmax_case(shape, scale, drive.SEED[f"sm_{suffix}"], dtype)
        what = f"softmax_backward, {label}, {dtype}, vs ops.Softmax.backward{source}"
        (got,) = result_of(res, f"sm_{suffix}", i, ("dx",), {"dout": dout, "y": y}, what)
        close(got, softmax_want(y.astype(np.float64), dout.astype(np.float64)), f"{what}: dx")

    for i, (label, N, V, scale, offset, denom, dloss, tdtype) in \
            enumerate(getattr(drive, f"CROSS_ENTROPY_{suffix.upper()}")):
        logits, targets = drive.cross_entropy_case(N, V, scale, offset, drive.SEED[f"ce_{suffix}"], dtype, tdtype)
        what = f"cross_entropy_backward, {label}, {dtype}, vs ops.CrossEntropyReference{source}"
        (got,) = result_of(res, f"ce_{suffix}", i, ("dlogits",), {"logits": logits, "targets": targets}, what)
        close(got, cross_entropy_want(logits.astype(np.float64), targets, dloss, denom), f"{what}: dlogits")


def judge_reference(res):
    """Bigger cases, against minipar's own formulas at 1e-12."""
    judge_families(res, "ref", "float64", ref_close, "")


def judge_float32(res):
    """float32 inputs: float32 results, within F32_TOL of minipar's formulas in float64."""
    judge_families(res, "32", "float32", f32_close, " in float64")


def judge_gpt(res):
    """Every parameter's gradient of the tiny GPT with the student's backwards at the seam,
    against minipar's own gradients, computed here (nothing of the student's is installed in
    this process)."""
    cfg = drive.GPT_CONFIG
    ran = 2 * cfg.n_layer + 2                                 # 2L + 1 LayerNorms and the loss
    for dtype in drive.GPT_DTYPES:
        _, _, denom = drive.gpt_inputs()
        case = (f"GPT L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd} V={cfg.vocab_size}, B={drive.GPT_B} "
                f"T={cfg.block_size}, loss_denom={denom:g}, {dtype}")
        want_loss, want = drive.gpt_gradients(dtype)
        calls = res.get(0, key("gpt", dtype, "calls"))
        assert calls == ran, f"{case}: the seam ran the student's backward {calls!r} times, want {ran} (a lab bug?)"
        loss = res.get(0, key("gpt", dtype, "loss"))
        rtol = 1e-13 if dtype == "float64" else 1e-6          # the same forward, maybe on other BLAS threads
        assert isinstance(loss, float) and np.isclose(loss, want_loss, rtol=rtol, atol=0.0), \
            f"{case}: the loss changed, {loss!r} != {want_loss!r} (the forwards are minipar's: a lab bug?)"
        got = res.get(0, key("gpt", dtype, "grads"))
        assert isinstance(got, dict), f"{case}: the gradients came back as {typename(got)} (tampered with?)"
        tol = 1e-12 if dtype == "float64" else F32_TOL
        bad = []
        for name in reversed(list(want)):                     # walking back from the loss
            diff = first_difference(got.get(name), want[name], rtol=tol, atol=tol * scale_of(want[name]))
            if diff is not None:
                bad.append((name, diff))
        if bad:
            name, diff = bad[0]
            others = f"; {len(bad) - 1} more parameter(s) wrong" if len(bad) > 1 else ""
            raise AssertionError(f"{case}: gradient of {name} (the first wrong one walking back from the loss): "
                                 f"{diff}{others}")


CRITERIA = [
    Criterion("layernorm by finite differences", run="layernorm_fd", judge=judge_layernorm_fd, timeout=30,
              uses=("layernorm_backward",),
              hint="x reaches xhat three ways: directly, through the mean and through the variance; "
                   "work one row (N=1, C=3) by hand first; the variance is biased (divided by C), eps "
                   "defaults to 1e-5, and ops.LayerNormReference.forward is the forward"),
    Criterion("softmax by finite differences", run="softmax_fd", judge=judge_softmax_fd, timeout=30,
              uses=("softmax_backward",),
              hint="dx_i = sum_j dout_j dy_j/dx_i with dy_j/dx_i = y_j (delta_ij - y_i): write the "
                   "Jacobian for 3 entries by hand, then vectorise over any leading axes (1-D too)"),
    Criterion("cross-entropy by finite differences", run="cross_entropy_fd", judge=judge_cross_entropy_fd,
              timeout=30, uses=("cross_entropy_backward",),
              hint="subtract each row's max before exp (exp(1e4) overflows); the loss is divided by "
                   "loss_denom and scaled by dloss; ops.CrossEntropyReference.forward is the forward"),
    Criterion("against minipar's reference formulas", run="reference", judge=judge_reference, timeout=30,
              uses=("layernorm_backward", "softmax_backward", "cross_entropy_backward"),
              hint="right to 1e-7 but not to 1e-12 is a numerical gradient or a float32 step: "
                   "write the closed form, in float64 throughout"),
    Criterion("float32 inputs", run="float32", judge=judge_float32, timeout=30,
              uses=("layernorm_backward", "softmax_backward", "cross_entropy_backward"),
              hint="float32 in, float32 out: make new arrays with np.zeros_like / np.empty_like or "
                   "dtype=x.dtype, and compute the variance as the mean of (x - mean)^2, not "
                   "mean(x^2) - mean^2 (two large numbers that cancel when the mean is large next to the spread)"),
    Criterion("whole GPT gradients, float64 and float32", run="gpt", judge=judge_gpt, timeout=60,
              uses=("layernorm_backward", "cross_entropy_backward"),
              hint="return new arrays each call: the autograd engine (minipar.tensor.backward) keeps "
                   "a gradient you return, and adds to it later"),
]
