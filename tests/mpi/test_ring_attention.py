"""Ring attention (minipar/parallel/context/ring_attention.py) against the single-process causal
attention in float64, for cp = 2, 3, 4 (the `groups` fixture; a rank left alone runs cp = 1),
zig-zag and contiguous: each rank's output rows and its q, k, v gradients at 1e-12, the mask at
every chunk edge included; the ledger's messages per call; the load balance. Run under
mpirun -n 4."""
import numpy as np
import pytest

from minipar import comm
from minipar.comm.protocol import HEADER_BYTES
from minipar.parallel.context import ring_attention as ra
from minipar.autograd.tensor import Tensor

B, H, HS = 2, 3, 8


def full_attention(q, k, v, do):
    """Causal softmax(q k^T / sqrt(hs)) v and its q, k, v gradients for output gradient do,
    written out (the textbook formulas)."""
    T = q.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(np.triu(np.ones((T, T), bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = p @ v
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(q.shape[-1])
    return o, ds @ k, np.swapaxes(ds, -1, -2) @ q, dv


@pytest.mark.parametrize("layout", ra.LAYOUTS)
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_output_and_gradients_equal_full_attention(groups, cp, layout):
    g = groups[cp]
    T = 2 * 3 * 4                                                     # 2C divides it for C = 1..4
    rng = np.random.default_rng(0)
    q, k, v, do = rng.standard_normal((4, B, H, T, HS))
    want = full_attention(q, k, v, do)
    mine = ra.positions(g.rank, g.size, T, layout)
    local = [Tensor(x[..., mine, :].copy(), requires_grad=True) for x in (q, k, v)]
    comm.reset_traffic()
    ra.BLOCKS.update(forward=0, backward=0)
    out = ra.ring_attention(*local, g, layout)
    out.backward(do[..., mine, :])
    got = [out.data] + [t.grad for t in local]
    for name, w, x in zip(("o", "dq", "dk", "dv"), want, got):
        np.testing.assert_allclose(x, w[..., mine, :], rtol=0, atol=1e-12 * np.abs(w).max(), err_msg=name)
    C = g.size
    sends = comm.traffic().get("send", {})
    # forward: C - 1 messages of K and V; backward: C - 1 of K, V, dK, dV together, then dK, dV home
    assert sends.get("calls", 0) == (C - 1) + (C if C > 1 else 0)
    t = T // C
    # elements: forward 2n(C-1) (K, V), backward 2n(C-1) (K, V) + 2nC (dK, dV), n = B H t hs
    assert sends.get("bytes_sent", 0) == (2 * (C - 1) * 2 + (C if C > 1 else 0) * 2) * B * H * t * HS * 8 \
        + sends.get("calls", 0) * HEADER_BYTES
    assert (sends.get("calls", 0), sends.get("bytes_sent", 0)) == ra.ring_traffic(B * H * t * HS, C, 8)
    # the sub-blocks computed: the fully masked ones skipped, as many in backward as forward
    assert ra.BLOCKS == {"forward": ra.blocks(g.rank, C, T, layout), "backward": ra.blocks(g.rank, C, T, layout)}


def test_the_sequence_must_split_into_2cp_chunks():
    with pytest.raises(ValueError, match="2 x cp = 8 chunks: length 12 is not divisible by 8"):
        ra.positions(0, 4, 12)


@pytest.mark.parametrize("C", [2, 4, 8])
def test_zigzag_balances_the_causal_work(C):
    """Every rank computes the same number of (query, key) pairs with the zig-zag split, T(T+1)/2C;
    with the contiguous split rank r computes 4 r c^2 + c (2c + 1) (c = T/2C: its 2c queries see
    every key before them), so the last rank does 4(C-1)c/(2c+1) + 1 times the first's work."""
    T = 64
    c = T // (2 * C)
    zig = [ra.pairs(r, C, T, "zigzag") for r in range(C)]
    flat = [ra.pairs(r, C, T, "contiguous") for r in range(C)]
    assert zig == [T * (T + 1) // (2 * C)] * C
    assert flat == [4 * r * c * c + c * (2 * c + 1) for r in range(C)]
    assert sum(flat) == sum(zig) == T * (T + 1) // 2


@pytest.mark.parametrize("C", [1, 2, 3, 4, 8])
def test_sub_blocks_computed_per_rank(C):
    """The c x c sub-blocks of scores a rank computes per pass (the rest are fully masked and
    skipped): 2C - 1 below the diagonal and 2 on it under zig-zag, on every rank; 4r + 3 on
    rank r under the contiguous split, so its last rank works (4C - 1)/3 times its first."""
    T = 4 * C
    assert [ra.blocks(r, C, T, "zigzag") for r in range(C)] == [2 * C + 1] * C
    assert [ra.blocks(r, C, T, "contiguous") for r in range(C)] == [4 * r + 3 for r in range(C)]
    assert sum(ra.blocks(r, C, T, "contiguous") for r in range(C)) == C * (2 * C + 1)
