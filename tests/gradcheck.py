"""Central finite differences against minipar's hand-written backward, in float64.

    errs = gradcheck(lambda x, w: ops.linear(x, w), x, w, name="linear")

For a random weight array `w` of the output's shape, the scalar L = sum(f(*inputs) * w) is
differentiated twice: analytically (`out.backward(w)`) and by central differences
(L(x + eps) - L(x - eps)) / 2 eps on every input element. The error of one input is the
largest absolute difference divided by the largest analytic gradient entry (a norm-wise
relative error, so elements whose gradient is almost zero do not blow it up). The largest
error per op name is kept in ERRORS and printed at the end of the pytest session.

The helper also checks that neither forward nor backward modifies its inputs or the
incoming gradient in place.
"""
from __future__ import annotations

import numpy as np
import pytest

from minipar.autograd.tensor import Tensor, no_grad

EPS = 1e-6
TOL = 1e-7
ERRORS: dict = {}          # op name -> largest relative error seen in this session


def record(name: str, err: float):
    ERRORS[name] = max(ERRORS.get(name, 0.0), float(err))


def numerical_grad(objective, a: np.ndarray, eps: float) -> np.ndarray:
    """d objective / d a by central differences, one element of `a` at a time (in place)."""
    num = np.zeros_like(a)
    for j in range(a.size):
        old = a.flat[j]
        a.flat[j] = old + eps
        fp = objective()
        a.flat[j] = old - eps
        fm = objective()
        a.flat[j] = old
        num.flat[j] = (fp - fm) / (2 * eps)
    return num


def rel_err(analytic: np.ndarray, numeric: np.ndarray, scale: float | None = None) -> float:
    scale = float(np.max(np.abs(analytic))) if scale is None else scale
    scale = max(scale, float(np.max(np.abs(numeric))), 1e-12)
    return float(np.max(np.abs(analytic - numeric))) / scale


def gradcheck(f, *arrays, eps=EPS, tol=TOL, name="op", seed=0):
    """Check every input of f (float arrays, passed as Tensors that require grad).
    Returns the list of per-input errors; asserts each is below tol."""
    rng = np.random.default_rng(seed)
    arrays = [np.array(a, dtype=np.float64) for a in arrays]
    originals = [a.copy() for a in arrays]
    ts = [Tensor(a, requires_grad=True) for a in arrays]
    out = f(*ts)
    assert isinstance(out, Tensor), f"{name}: f must return a Tensor"
    w = rng.standard_normal(out.shape)
    w_copy = w.copy()
    out.backward(w)
    for i, (a, a0) in enumerate(zip(arrays, originals)):
        np.testing.assert_array_equal(a, a0, err_msg=f"{name}: input {i} modified in place")
    np.testing.assert_array_equal(w, w_copy, err_msg=f"{name}: backward modified its output gradient")

    def objective():
        with no_grad():
            return float(np.sum(f(*[Tensor(a) for a in arrays]).data * w))

    errs = []
    for i, (a, t) in enumerate(zip(arrays, ts)):
        assert t.grad is not None, f"{name}: input {i} got no gradient"
        assert t.grad.shape == a.shape, f"{name}: input {i} grad shape {t.grad.shape} != {a.shape}"
        e = rel_err(t.grad, numerical_grad(objective, a, eps))
        record(name, e)
        errs.append(e)
        assert e < tol, (f"{name}: input {i} shape {a.shape}: max relative error {e:.3e} >= {tol:.0e}\n"
                         f"analytic:\n{t.grad}\nnumeric:\n{num}")
    print(f"gradcheck {name}: errors {['%.2e' % e for e in errs]}")
    return errs


class _Summary:
    """A pytest plugin registered at run time: prints ERRORS in the terminal summary."""

    def pytest_terminal_summary(self, terminalreporter):
        if not ERRORS:
            return
        terminalreporter.section("finite-difference check: largest relative error per op")
        for k in sorted(ERRORS):
            terminalreporter.write_line(f"{k:40s} {ERRORS[k]:.2e}")
        worst = max(ERRORS, key=ERRORS.get)
        terminalreporter.write_line(f"{'largest overall: ' + worst:40s} {ERRORS[worst]:.2e}")


_SUMMARY = _Summary()


@pytest.fixture(scope="session", autouse=True)
def fd_summary(pytestconfig):
    """Import this fixture into a test module to get the error table at the end."""
    pm = pytestconfig.pluginmanager
    if not pm.is_registered(_SUMMARY):
        pm.register(_SUMMARY, "minipar-fd-summary")
    yield
