"""Helpers shared by the algorithms: arguments checked and described, results allocated,
arrays cut into pieces. Reductions are NumPy ufuncs applied in place (OPS).
"""
import functools

import numpy as np

OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def describe(x, **extra):
    """The debug description of an array argument and the other arguments."""
    parts = [f"{x.dtype}", f"shape={tuple(x.shape)}"] if x is not None else []
    parts += [f"{k}={v}" for k, v in extra.items()]
    return ", ".join(parts)


def array(x):
    return x if type(x) is np.ndarray else np.asarray(x)


def shaped(shape: tuple, itemsize: int) -> np.ndarray:
    """An array of this shape and itemsize that occupies no memory (a broadcast zero): for the
    formulas that ask the dispatcher what a call of that size would send (its size and bytes)."""
    return np.broadcast_to(np.zeros((), dtype=f"f{itemsize}"), shape)


def flat(x):
    """x (an ndarray) as a contiguous 1-D array: a view when possible, never written to."""
    return x.ravel()


def result(out, shape, dtype, what):
    """The array a collective writes into: a new one, or the caller's `out` once checked."""
    if out is None:
        return np.empty(shape, dtype)
    if type(out) is np.ndarray and out.shape == shape and out.dtype == dtype:
        flags = out.flags
        if flags.c_contiguous and flags.writeable:
            return out
    if not (type(out) is np.ndarray and out.shape == tuple(shape) and out.dtype == dtype
            and out.flags.c_contiguous and out.flags.writeable):
        got = (f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__)
        raise ValueError(f"{what}: out must be a writeable C-contiguous {np.dtype(dtype)} array "
                         f"of shape {tuple(shape)}, got {got}")
    return out


def reduce_op(op):
    f = OPS.get(op) if isinstance(op, str) else None
    if f is None:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    return f


@functools.lru_cache(maxsize=256)
def split_offsets(n, p):
    """Element offsets of np.array_split(range(n), p): piece i is [off[i], off[i+1]).

    A tuple, cached per (n, p): the same bucket sizes come back every training step, and
    building the list cost more than a small message's whole posting."""
    q, rem = divmod(n, p)
    return tuple(i * q + min(i, rem) for i in range(p + 1))


def check_rank(g, rank, what):
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < g.size:
        raise ValueError(f"{what} must be a rank of the group (0..{g.size - 1}), got {rank!r}")
    return int(rank)
