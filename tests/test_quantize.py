"""ZeRO++'s block quantization (minipar/parallel/zero/quantize.py): every number comes back
within half its block's scale, the scale is never rounded below max|x|/127 (no code clips),
all-zero blocks come back exactly, and a message is n + 4 ceil(n/B) bytes."""
import numpy as np
import pytest

from minipar.parallel.zero import quantize as q


def roundtrip(x, B):
    msg = q.pack(x, B)
    assert msg.dtype == np.uint8 and msg.size == q.wire_bytes(x.size, B) == x.size + 4 * -(-x.size // B)
    return q.unpack(msg, x.size, B, x.dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("n,B", [(1, 1), (7, 4), (256, 256), (1000, 256), (513, 64), (4096, 1), (3, 1024)])
def test_every_number_within_half_its_blocks_scale(dtype, n, B):
    rng = np.random.default_rng(n * B)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4, n)).astype(dtype)
    y = roundtrip(x, B)
    err = np.abs(x.astype(np.float64) - y.astype(np.float64))
    rounding = np.finfo(dtype).eps * np.abs(x.astype(np.float64))     # the decoded value's own rounding to dtype
    assert (err <= q.bound(x, B) * (1 + 1e-12) + rounding).all(), float((err - q.bound(x, B)).max())
    codes, s = q.quantize(x, B)
    assert np.abs(codes.astype(int)).max() <= 127
    peak = np.abs(np.pad(x.astype(np.float64), (0, -n % B))).reshape(-1, B).max(axis=1)
    assert (s.astype(np.float64) * 127 >= peak).all(), "a scale rounded below max|x|/127: its largest code clips"


def test_zero_blocks_and_exact_multiples_come_back_exactly():
    x = np.zeros(300)
    x[256:] = np.arange(44) - 22.0                       # the second block: integers up to 22
    y = roundtrip(x, 256)
    assert (y[:256] == 0).all()
    s = q.scales(x, 256)
    assert s[0] == 0 and np.abs(y[256:] - x[256:]).max() <= s[1] / 2


def test_the_bound_is_reached_not_loose():
    """Half a code step is the worst case: a number midway between two codes."""
    x = np.array([127.0, 0.5, 1.5, -0.5])
    s = q.scales(x, 4)[0]
    assert s >= 1.0 and np.abs(roundtrip(x, 4) - x).max() >= 0.45 * s


def test_a_message_is_four_times_smaller_than_float32_at_large_blocks():
    n = 1 << 16
    assert 4 * n / q.wire_bytes(n, 256) == pytest.approx(4 / (1 + 4 / 256))
    assert 8 * n / q.wire_bytes(n, 256) > 7.8
