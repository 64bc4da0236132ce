"""What the judges of several labs share: reading the arrays a call returned, checking that the
inputs came back untouched and that no result aliases an input, and the scale a tolerance is
relative to. A judge raises AssertionError with a message for the student; these do too.

The child records, for a call under key k: k itself (what it returned), key(k, "after", name)
(each input as it was after the call) and key(k, "shares") (per result, the inputs it shares
memory with).
"""
from __future__ import annotations

import numpy as np

from labs.framework import first_difference
from labs.results import described, key, typename


def scale_of(want) -> float:
    """The largest |entry| of want (1 for an empty or all-zero array): what atol is relative to."""
    m = float(np.abs(want).max()) if np.size(want) else 0.0
    return m if m > 0 else 1.0


def returned(res, k, names, what):
    """The student's result as a tuple of len(names) arrays (a helpful message if not); one
    name: the call returns the array itself."""
    result = res.get(0, k)
    if len(names) == 1:
        assert isinstance(result, np.ndarray), f"{what}: returned {described(result)}, not an array"
        return (result,)
    assert isinstance(result, (tuple, list)) and len(result) == len(names), \
        f"{what}: returned {described(result)}, want a tuple ({', '.join(names)})"
    for name, part in zip(names, result):
        assert isinstance(part, np.ndarray), f"{what}: {name} is {described(part)}, not an array"
    return tuple(result)


def untouched(res, k, inputs: dict, what, advice: str = "compute into new arrays"):
    """Every input as the child saw it after the call equals the input given (same shape,
    dtype and bits)."""
    for name, a in inputs.items():
        after = res.get(0, key(k, "after", name))
        if not (isinstance(after, np.ndarray) and after.shape == a.shape and after.dtype == a.dtype
                and np.array_equal(after, a)):
            diff = first_difference(after, a, rtol=0.0)
            raise AssertionError(f"{what}: the input {name} was modified ({diff}): {advice}")


def fresh(res, k, names, what, why: str):
    """No returned array shares memory with an input; `why` says why that matters here."""
    shares = res.get(0, key(k, "shares"))
    assert isinstance(shares, list), f"{what}: the record of shared memory is {typename(shares)} (tampered with?)"
    for name, inputs in zip(names, shares):
        if inputs:
            raise AssertionError(f"{what}: {name} shares memory with the input {inputs[0]} (a view of it, or the "
                                 f"input itself): return a new array; {why}")
