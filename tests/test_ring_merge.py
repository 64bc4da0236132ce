"""The plain math of ring attention's merge (minipar/parallel/context/ring_attention.py:
partial_attention, merge) against one softmax over all the keys, and against RingAttention's
own accumulators on one rank: the merge of the pieces of a split key set is the attention over
the union, in any order and grouping; a piece that saw no key (-inf) changes nothing."""
import math

import numpy as np
import pytest
from mpi4py import MPI

from minipar import comm
from minipar.parallel.context import ring_attention as ra


def softmax_attention(q, k, v, mask=None):
    """The textbook attention with its log-sum-exp, written out."""
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, -np.inf, s)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    return (p @ v) / p.sum(-1, keepdims=True), (m + np.log(p.sum(-1, keepdims=True)))[..., 0]


@pytest.mark.parametrize("scale", [1.0, 60.0])
def test_pieces_merged_equal_one_softmax(scale):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 5, 4)) * scale          # scale 60: scores in the hundreds
    k, v = rng.standard_normal((2, 2, 3, 9, 4))
    want_o, want_lse = softmax_attention(q, k, v)
    pieces = [ra.partial_attention(q, k[..., s, :], v[..., s, :]) for s in (slice(0, 2), slice(2, 7), slice(7, 9))]
    a, b, c = pieces
    for got in (ra.merge(*ra.merge(*a, *b), *c), ra.merge(*a, *ra.merge(*b, *c)), ra.merge(*ra.merge(*c, *a), *b)):
        np.testing.assert_allclose(got[0], want_o, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got[1], want_lse, rtol=1e-12)


def test_a_piece_without_keys_is_neutral():
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((3, 4, 6, 3))
    hidden = np.ones((6, 6), bool)
    hidden[3:, :2] = False                                   # rows 0..2 see no key at all
    o, lse = ra.partial_attention(q, k, v, hidden)
    assert np.all(o[:, :3] == 0) and np.all(np.isneginf(lse[:, :3]))
    empty = (np.zeros_like(o), np.full(lse.shape, -np.inf))
    got = ra.merge(o, lse, *empty)
    assert np.array_equal(got[0], o) and np.array_equal(got[1], lse)
    both = ra.merge(*empty, *empty)
    assert np.all(both[0] == 0) and np.all(np.isneginf(both[1])) and not np.isnan(both[0]).any()


def test_float32_stays_float32():
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((3, 2, 4, 8)).astype(np.float32)
    o, lse = ra.merge(*ra.partial_attention(q, k[:, :2], v[:, :2]), *ra.partial_attention(q, k[:, 2:], v[:, 2:]))
    assert o.dtype == lse.dtype == np.float32
    np.testing.assert_allclose(o, softmax_attention(q, k, v)[0], rtol=1e-5, atol=1e-6)


def test_ring_attention_on_one_rank_keeps_the_same_lse():
    """C = 1: RingAttention's accumulators give the causal attention and its log-sum-exp, as the
    pieces merged do."""
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((3, 2, 2, 8, 4))
    f = ra.RingAttention()
    o = f.forward(q, k, v, comm.Group(MPI.COMM_SELF))
    causal = np.triu(np.ones((8, 8), bool), 1)
    want_o, want_lse = softmax_attention(q, k, v, causal)
    np.testing.assert_allclose(o, want_o, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(f.saved[-1], want_lse, rtol=1e-12)
    a = ra.partial_attention(q[..., :4, :], k[..., :4, :], v[..., :4, :], causal[:4, :4])
    b = ra.partial_attention(q[..., 4:, :], k[..., :4, :], v[..., :4, :])
    c = ra.partial_attention(q[..., 4:, :], k[..., 4:, :], v[..., 4:, :], causal[4:, 4:])
    np.testing.assert_allclose(np.concatenate([a[0], ra.merge(*b, *c)[0]], -2), o, rtol=1e-12, atol=1e-12)
