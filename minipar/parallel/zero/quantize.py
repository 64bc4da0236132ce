"""ZeRO++'s block quantization (Wang et al., "ZeRO++: Extremely Efficient Collective
Communication for Giant Model Training", 2023): a message of n numbers travels as n int8 codes
and one float32 scale per block of B numbers, instead of n x itemsize bytes.

    block b of x:   s_b = max |x_i| / 127   (rounded up to a float32, so that |x_i / s_b| <= 127)
                    q_i = round(x_i / s_b)   an int8 in [-127, 127]
    decoded:        x~_i = q_i * s_b,        |x_i - x~_i| <= s_b / 2   (the block bound)
    on the wire:    n + 4 ceil(n / B) bytes, against n x itemsize: 4 / (1 + 4/B) times fewer
                    for float32 (3.94x at B = 256), 8 / (1 + 4/B) for float64

An all-zero block has s_b = 0 and decodes to zeros exactly. `pack` writes the codes and the
scales into one uint8 message, `unpack` reads one back; `wire_bytes` is the message's size,
the one home of that formula (stage3.py's qwZ gathers and qgz.py's reductions send them).
"""
from __future__ import annotations

import numpy as np

LEVELS = 127                    # codes -127..127: symmetric, no code for -128


def n_blocks(n: int, B: int) -> int:
    return -(-n // B)


def wire_bytes(n: int, B: int) -> int:
    """Bytes of the message that carries n numbers in blocks of B: n codes + a float32 scale a block."""
    return n + 4 * n_blocks(n, B)


def scales(x: np.ndarray, B: int) -> np.ndarray:
    """The float32 scale of each block of x (1-D): max |x| / 127, rounded up."""
    n = x.size
    padded = np.zeros(n_blocks(n, B) * B, dtype=np.float64)
    padded[:n] = np.abs(x)
    peak = padded.reshape(-1, B).max(axis=1)
    s = (peak / LEVELS).astype(np.float32)
    low = s.astype(np.float64) * LEVELS < peak                        # float32 rounded it down
    s[low] = np.nextafter(s[low], np.float32(np.inf))
    return s


def quantize(x: np.ndarray, B: int) -> tuple[np.ndarray, np.ndarray]:
    """(codes int8 (n,), scales float32 (ceil(n/B),)) of x (1-D)."""
    s = scales(x, B)
    per = np.repeat(s.astype(np.float64), B)[:x.size]
    safe = np.where(per > 0, per, 1.0)
    return np.rint(x / safe).astype(np.int8), s


def dequantize(codes: np.ndarray, s: np.ndarray, B: int, dtype) -> np.ndarray:
    """x~ = codes * their block's scale, in dtype."""
    return (codes.astype(np.float64) * np.repeat(s.astype(np.float64), B)[:codes.size]).astype(dtype)


def pack(x: np.ndarray, B: int, out: np.ndarray | None = None) -> np.ndarray:
    """x (1-D) as one uint8 message: its codes, then its scales' bytes (wire_bytes(n, B))."""
    codes, s = quantize(x, B)
    msg = np.empty(wire_bytes(x.size, B), dtype=np.uint8) if out is None else out
    msg[:x.size] = codes.view(np.uint8)
    msg[x.size:] = s.view(np.uint8)
    return msg


def unpack(msg: np.ndarray, n: int, B: int, dtype, out: np.ndarray | None = None) -> np.ndarray:
    """The n numbers a message of pack carries, decoded into out (or a new array)."""
    x = dequantize(msg[:n].view(np.int8), msg[n:].view(np.float32), B, dtype)
    if out is None:
        return x
    out[...] = x
    return out


def bound(x: np.ndarray, B: int) -> np.ndarray:
    """Each number's error bound after a round trip: half its block's scale."""
    return np.repeat(scales(x, B).astype(np.float64) / 2, B)[:x.size]
