"""Storage and compute dtypes, as every op uses them (docs/precision.md): float16 and
bfloat16 arrays are widened to float32 for the arithmetic (`compute`) and the result is
rounded back to the storage dtype (`store`); float32 and float64 arrays pass through as
the same objects. What is stored in which precision, and why, is in
minipar/optim/mixed_precision.py (the optimizer's side: master weights, loss scaling).
"""
from __future__ import annotations

import numpy as np


def bfloat16() -> np.dtype:
    """ml_dtypes' bfloat16, imported when a run first asks for it: ml_dtypes 0.7 takes 1.4 s
    to import (measured), which every rank of every fp32 run would otherwise pay."""
    import ml_dtypes                                    # noqa: PLC0415
    return np.dtype(ml_dtypes.bfloat16)


def is_low(dtype) -> bool:
    """float16 or bfloat16: a dtype that ops widen to float32 for compute."""
    return np.dtype(dtype).itemsize == 2


def compute(*arrays):
    """The arrays an op computes on: float16/bfloat16 ones widened to float32, any other
    (float32, float64, ints) returned as it is -- the same object, so fp32 and fp64 runs
    are untouched. One array in, one out; several in, a tuple out."""
    out = tuple(a.astype(np.float32) if isinstance(a, np.ndarray) and is_low(a.dtype) else a
                for a in arrays)
    return out[0] if len(out) == 1 else out


def store(x: np.ndarray, dtype) -> np.ndarray:
    """x rounded to the storage dtype (round to nearest even); no copy when it already is."""
    return x if x is None or x.dtype == dtype else x.astype(dtype)
