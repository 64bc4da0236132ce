"""Context parallelism's attention implementations (--cp-impl: context_parallel.ContextSplit)
against the single-process causal attention in float64, on the packed projection as the model
calls them: cp = 2, 3, 4 (the `groups` fixture; a rank left alone runs cp = 1), zig-zag and
contiguous, multi-head, grouped-query and multi-query attention. Each rank's output rows and
its qkv gradient at 1e-12, and the bytes it sent equal to the implementation's formula.
Run under mpirun -n 4."""
import numpy as np
import pytest

from minipar import comm
from minipar.autograd import ops
from minipar.autograd.tensor import Tensor
from minipar.parallel.context import allgather_attention, context_parallel, ring_attention, ulysses

B, HS = 2, 4
# (H, Hkv): multi-head, grouped-query, multi-query; 12 heads: Ulysses on 3 ranks too
HEADS = [(4, 4), (4, 2), (4, 1), (12, 6), (12, 4), (12, 2)]


def whole(qkv, H, Hkv, dy):
    """The single process: y and dqkv of the whole sequence."""
    x = Tensor(qkv, requires_grad=True)
    y = ops.causal_self_attention(x, H, n_kv_head=Hkv)
    y.backward(dy)
    return y.data, x.grad


@pytest.mark.parametrize("impl", ["ring", "ulysses", "allgather"])    # hybrid: below
@pytest.mark.parametrize("layout", ring_attention.LAYOUTS)
@pytest.mark.parametrize("H,Hkv", HEADS)
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_each_implementation_equals_the_single_process(groups, cp, H, Hkv, layout, impl):
    g = groups[cp]
    T = 2 * 3 * 4                                                     # 2C divides it for C = 1..4
    rng = np.random.default_rng(1)
    qkv = rng.standard_normal((B, T, (H + 2 * Hkv) * HS))
    dy = rng.standard_normal((B, T, H * HS))
    y, dqkv = whole(qkv, H, Hkv, dy)
    split = context_parallel.ContextSplit(g, layout, impl)
    mine = split.positions(T)
    x = Tensor(qkv[:, mine].copy(), requires_grad=True)
    comm.reset_traffic()
    if impl == "ulysses" and (H % g.size or (Hkv % g.size and g.size % Hkv)):
        with pytest.raises(ValueError, match="--cp-impl ulysses gives each of the cp"):
            split.attention(x, H, Hkv)
        return
    out = split.attention(x, H, Hkv)
    out.backward(dy[:, mine])
    np.testing.assert_allclose(out.data, y[:, mine], rtol=0, atol=1e-12 * np.abs(y).max())
    np.testing.assert_allclose(x.grad, dqkv[:, mine], rtol=0, atol=1e-12 * np.abs(dqkv).max())
    sent = sum(v.get("bytes_sent", 0) for v in comm.traffic().values())
    n = B * Hkv * (T // g.size) * HS
    if impl == "ring":
        want = ring_attention.ring_traffic(n, g.size, 8)[1]
    elif impl == "allgather":
        want = allgather_attention.allgather_traffic(n, g.size, 8)
    else:
        Hq, kv = ulysses.head_split(H, Hkv, g.size)
        want = ulysses.ulysses_traffic(B * (T // g.size), Hq, kv, HS, g.size, 8)
    assert sent == want, (impl, sent, want)


def test_an_unknown_implementation_is_refused(groups):
    with pytest.raises(ValueError, match="--cp-impl must be one of"):
        context_parallel.ContextSplit(groups[2], "zigzag", "ulisses")


@pytest.mark.parametrize("layout", ring_attention.LAYOUTS)
@pytest.mark.parametrize("H,Hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("U", [1, 2, 4])
def test_hybrid_equals_the_single_process(groups, U, H, Hkv, layout):
    """--cp-impl hybrid on cp 4: Ulysses over U consecutive ranks, the ring over the 4/U groups
    (U = 1: the ring alone; U = 4: Ulysses alone), each rank's rows at 1e-12, and its bytes the
    two formulas' sum: Ulysses' over U, the ring's over 4/U on U t tokens of the heads left."""
    g = groups[4]
    if g.size != 4:
        return
    T = 16
    rng = np.random.default_rng(2)
    qkv = rng.standard_normal((B, T, (H + 2 * Hkv) * HS))
    dy = rng.standard_normal((B, T, H * HS))
    y, dqkv = whole(qkv, H, Hkv, dy)
    split = context_parallel.ContextSplit(g, layout, "hybrid", ulysses=U)
    mine = split.positions(T)
    x = Tensor(qkv[:, mine].copy(), requires_grad=True)
    comm.reset_traffic()
    out = split.attention(x, H, Hkv)
    out.backward(dy[:, mine])
    np.testing.assert_allclose(out.data, y[:, mine], rtol=0, atol=1e-12 * np.abs(y).max())
    np.testing.assert_allclose(x.grad, dqkv[:, mine], rtol=0, atol=1e-12 * np.abs(dqkv).max())
    sent = sum(v.get("bytes_sent", 0) for v in comm.traffic().values())
    t = T // 4
    Hq, kv = ulysses.head_split(H, Hkv, U)
    want = ulysses.ulysses_traffic(B * t, Hq, kv, HS, U, 8) + ring_attention.ring_traffic(B * U * t * kv * HS, 4 // U, 8)[1]
    assert sent == want, (sent, want)


def test_hybrid_needs_a_degree_that_divides_cp(groups):
    with pytest.raises(ValueError, match="--cp-ulysses 3 must divide --cp 4"):
        context_parallel.hybrid_degree(groups[4], 3) if groups[4].size == 4 else context_parallel.hybrid_degree(
            type("G", (), {"size": 4})(), 3)
