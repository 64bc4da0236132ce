"""Tiled attention (minipar/autograd/tiled_attention.py): FlashAttention-2's forward and backward
equal the plain attention at 1e-12 in float64 (the plain softmax written out here, and
attention.CausalSelfAttentionReference on the packed projection, grouped-query too) for block
sizes that do and do not divide T, T below a block and T = 1, causal and not; float32 stays
float32; no T x T array is held (tracemalloc's peak, which NumPy's allocations report to);
`--attention tiled --attn-block B` trains as the plain attention does (--verify's twin
attends plainly), and its flags are checked.
"""
import math
import tracemalloc

import numpy as np
import pytest

from minipar.autograd import ops
from minipar.autograd.tensor import Tensor
from minipar.autograd.tiled_attention import TiledAttention, spans, tiled_attention, tiled_backward, tiled_forward
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel.parallelize import parts
from minipar.train import trainer as train
from minipar.train.checkpoint import canonical_state
from trainer_runs import assert_main_exits_2

RTOL = 1e-12


def plain(q, k, v, causal, scale=None):
    """(o, lse, P) of softmax(q k^T * scale [+ causal mask]) v, the whole T x T at once."""
    T, d = q.shape[-2:]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if causal:
        s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    p = e / total
    return p @ v, (m + np.log(total))[..., 0], p


def plain_backward(q, k, v, do, causal, scale=None):
    T, d = q.shape[-2:]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    _, _, p = plain(q, k, v, causal, scale)
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return (ds @ k) * scale, (np.swapaxes(ds, -1, -2) @ q) * scale, np.swapaxes(p, -1, -2) @ do


def close(got, want, rtol=RTOL):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(1.0, float(np.abs(want).max(initial=0))))


CASES = [((1, 4), 4, 4), ((3, 5), 8, 8), ((12, 4), 4, 4), ((13, 4), 4, 4), ((13, 4), 5, 3), ((13, 4), 3, 5),
         ((17, 8), 1, 1), ((2, 3, 11, 4), 4, 6), ((2, 3, 16, 8), 16, 16), ((4, 9, 2), 2, 7)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape,bq,bk", CASES, ids=[f"{s}-{q}x{k}" for s, q, k in CASES])
def test_equals_the_plain_attention_in_float64(shape, bq, bk, causal):
    r = np.random.default_rng([len(shape), *shape, bq, bk])
    q, k, v, do = (r.standard_normal(shape) for _ in range(4))
    keep = [a.copy() for a in (q, k, v, do)]
    o, lse = tiled_forward(q, k, v, causal, bq, bk)
    want_o, want_lse, _ = plain(q, k, v, causal)
    close(o, want_o)
    close(lse, want_lse)
    for got, want in zip(tiled_backward(q, k, v, o, lse, do, causal, bq, bk), plain_backward(q, k, v, do, causal)):
        close(got, want)
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v, do), keep))


def test_an_explicit_scale_and_large_scores():
    """scale given (not 1/sqrt(d)); scores of +-300, where exp overflows without the running max."""
    r = np.random.default_rng(3)
    q, k, v, do = (r.standard_normal((19, 4)) for _ in range(4))
    q *= 60.0
    for causal in (False, True):
        o, lse = tiled_forward(q, k, v, causal, 4, 6, scale=0.7)
        want_o, want_lse, _ = plain(q, k, v, causal, 0.7)
        close(o, want_o)
        close(lse, want_lse)
        for got, want in zip(tiled_backward(q, k, v, o, lse, do, causal, 4, 6, scale=0.7),
                             plain_backward(q, k, v, do, causal, 0.7)):
            close(got, want, 1e-10)


def test_float32_stays_float32():
    r = np.random.default_rng(4)
    q, k, v, do = (r.standard_normal((2, 10, 4)).astype(np.float32) for _ in range(4))
    o, lse = tiled_forward(q, k, v, True, 3, 4)
    grads = tiled_backward(q, k, v, o, lse, do, True, 3, 4)
    assert {a.dtype for a in (o, lse, *grads)} == {np.dtype(np.float32)}
    want = plain(*(a.astype(np.float64) for a in (q, k, v)), True)
    close(o, want[0].astype(np.float32), 1e-5)


def test_spans_cut_a_ragged_tail():
    assert spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert spans(3, 8) == [(0, 3)]
    assert spans(0, 4) == []
    with pytest.raises(ValueError):
        spans(5, 0)


def test_no_t_by_t_array_is_held():
    """The peak of the allocations (tracemalloc) is a few (T, d) arrays and a few blocks, far
    below one T x T array of float64."""
    T, d, b = 1024, 4, 32
    r = np.random.default_rng(5)
    q, k, v, do = (r.standard_normal((T, d)) for _ in range(4))
    bound = 8 * (8 * T * d + 4 * T + 16 * b * b) + (64 << 10)
    assert bound < T * T * 8 // 10
    for causal in (False, True):
        tracemalloc.start()
        o, lse = tiled_forward(q, k, v, causal, b, b)
        forward_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        tiled_backward(q, k, v, o, lse, do, causal, b, b)
        backward_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert forward_peak < bound and backward_peak < bound, (forward_peak, backward_peak, bound)


@pytest.mark.parametrize("H,Hkv,block", [(2, 2, 3), (4, 2, 5), (4, 1, 16), (3, 3, 64)])
def test_packed_projection_equals_causal_self_attention(H, Hkv, block):
    """TiledAttention on qkv (B, T, (H + 2 Hkv) hs) against CausalSelfAttentionReference, forward
    and backward, multi-head and grouped-query."""
    B, T, hs = 2, 11, 4
    r = np.random.default_rng([H, Hkv, block])
    qkv = r.standard_normal((B, T, (H + 2 * Hkv) * hs))
    dy = r.standard_normal((B, T, H * hs))
    want_y, cache = ops.CausalSelfAttentionReference.forward(qkv, H, Hkv)
    want_dqkv = ops.CausalSelfAttentionReference.backward(dy, cache)
    x = Tensor(qkv.copy(), requires_grad=True)
    y = tiled_attention(x, H, Hkv, block)
    close(y.data, want_y)
    (y * Tensor(dy)).sum().backward()
    close(x.grad, want_dqkv)


def test_the_op_keeps_no_scores():
    """What backward keeps: q, k, v, o (B, H, T, hs each) and lse (B, H, T), not P."""
    B, T, H, hs = 2, 16, 2, 4
    qkv = Tensor(np.random.default_rng(6).standard_normal((B, T, 3 * H * hs)), requires_grad=True)
    y = TiledAttention.apply(qkv, H, None, 4)
    kept = sum(a.nbytes for a in y._ctx.saved)
    assert kept == 8 * (4 * B * H * T * hs + B * H * T)


FLAGS = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
         "--steps", "3", "--sample", "0", "--dtype", "float64"]


def run(*flags):
    s = train.set_up(train.build_parser().parse_args(FLAGS + list(flags)))
    rows = list(train.train_steps(s, 0, 3))
    return rows, canonical_state(s.model, s.opt)


@pytest.mark.parametrize("flags", [("--attn-block", "5"), ("--attn-block", "16", "--recompute", "selective"),
                                   ("--attn-block", "3", "--arch", "llama", "--n-head", "4", "--n-kv-head", "2")])
def test_trains_as_the_plain_attention(flags):
    extra = list(flags[2:])
    plain_rows, plain_state = run(*[f for f in extra if f not in ("--recompute", "selective")])
    rows, state = run("--attention", "tiled", *flags)
    np.testing.assert_allclose([r["loss"] for r in rows], [r["loss"] for r in plain_rows], rtol=1e-12)
    for name, want in plain_state.items():
        close(state[name], want, 1e-10)


def test_verify_twin_attends_plainly(capsys):
    """--verify on one process with --attention tiled: the twin is the plain attention."""
    summary = train.main(FLAGS + ["--attention", "tiled", "--attn-block", "5", "--verify"])
    assert summary["verify"]["ok"], summary["verify"]
    assert "tiled attention (blocks of 5" in capsys.readouterr().out


def test_model_parts_use_the_tiled_op():
    """parts(attn_block=B): every layer's attention node is a TiledAttention of block B."""
    cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = GPT(cfg, seed=0, dtype=np.float64, parts=parts(attn_block=3))
    idx = np.random.default_rng(0).integers(0, 256, (2, 8))
    nodes, seen, stack = [], set(), [model(idx, idx)]
    while stack:
        t = stack.pop()
        ctx = t._ctx
        if ctx is not None and id(ctx) not in seen:
            seen.add(id(ctx))
            nodes.append(ctx)
            stack += [p for p in ctx.parents if p is not None]
    tiled = [n for n in nodes if isinstance(n, TiledAttention)]
    assert len(tiled) == cfg.n_layer and all(n.block == 3 for n in tiled)
    assert not any(isinstance(n, ops.CausalSelfAttention) for n in nodes)


@pytest.mark.parametrize("argv,needles", [
    (["--attn-block", "4"], ["--attn-block 4", "--attention tiled"]),
    (["--attention", "tiled", "--attn-block", "0"], ["--attn-block must be"]),
    (["--attention", "tiled", "--cp", "2"], ["--attention tiled", "--cp 2"]),
])
def test_flags_refused_in_one_line(argv, needles, capsys):
    assert_main_exits_2(FLAGS + argv, needles, capsys, " ".join(argv))
