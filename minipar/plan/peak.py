"""Measuring speed honestly: the matmul peak that MFU is taken against.

MFU (model FLOPs utilisation) = (model FLOPs per step / step time) / peak FLOP/s, where
the peak is what this very process reaches on a large square matmul of the run's dtype,
measured in the same run (same BLAS, same thread count, same machine load).
"""
from __future__ import annotations

import time

import numpy as np


def matmul_peak_flops(dtype=np.float32, sizes=(512, 1024), seconds: float = 0.25) -> float:
    """Best FLOP/s over a few square sizes of `a @ b` in `dtype`."""
    best = 0.0
    rng = np.random.default_rng(0)
    for n in sizes:
        a = rng.standard_normal((n, n)).astype(dtype)
        b = rng.standard_normal((n, n)).astype(dtype)
        out = np.empty((n, n), dtype=dtype)
        np.matmul(a, b, out=out)                         # warm up
        reps, t0 = 0, time.perf_counter()
        while True:
            np.matmul(a, b, out=out)
            reps += 1
            dt = time.perf_counter() - t0
            if dt >= seconds:
                break
        best = max(best, 2.0 * n ** 3 * reps / dt)
    return best


def keep_freed_memory() -> bool:
    """Ask glibc malloc to keep freed memory instead of returning it to the OS.

    Every op allocates fresh activation arrays of a few MB. By default glibc serves those
    with mmap or trims the heap after free, so each new array is first touched page by
    page: page faults cost about a third of a small model's step. Raising the mmap and
    trim thresholds makes freed blocks reusable, as PyTorch's caching allocator does.
    Returns False where this is not glibc (nothing changes)."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    ok = mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024)       # glibc's ceiling for this knob
    ok &= mallopt(M_TRIM_THRESHOLD, 1024 * 1024 * 1024)
    ok &= mallopt(M_TOP_PAD, 64 * 1024 * 1024)
    return bool(ok)
