"""The autograd engine: accumulation, shared tensors, topological order, several live graphs,
leaf hooks (timing, count, order), no_grad, saved_bytes, error cases."""
import math

import numpy as np
import pytest

from minipar.autograd import ops
from minipar.model.gpt import GPT, GPTConfig
from minipar.autograd.tensor import Tensor, is_grad_enabled, no_grad


def rnd(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


def leaf(a):
    return Tensor(np.array(a, dtype=np.float64), requires_grad=True)


def gelu_prime(x):
    k = math.sqrt(2 / math.pi)
    t = np.tanh(k * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x)


TINY = GPTConfig(vocab_size=11, block_size=5, n_layer=2, n_head=2, n_embd=8)


def batch(seed, B=2, t=5, V=11):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, size=(B, t)), rng.integers(0, V, size=(B, t))


# --- accumulation and shared use ---------------------------------------------------------------

def test_grad_accumulates_across_backward_calls():
    x, w = rnd(3, 4, seed=1), rnd(4, 2, seed=2)
    xt, wt = leaf(x), leaf(w)
    ops.sum(ops.matmul(xt, wt)).backward()
    g1 = wt.grad.copy()
    np.testing.assert_allclose(g1, np.broadcast_to(x.sum(0)[:, None], (4, 2)), rtol=1e-14)
    ops.sum(ops.matmul(xt, wt)).backward()
    np.testing.assert_allclose(wt.grad, 2 * g1, rtol=1e-14)
    ops.sum(ops.mul(ops.matmul(xt, wt), 3.0)).backward()
    np.testing.assert_allclose(wt.grad, 5 * g1, rtol=1e-14)


def test_tensor_used_twice_gets_summed_gradient():
    x = rnd(5, seed=3)
    for f, expect in ((lambda t: t * t, 2 * x), (lambda t: t + t, 2 * np.ones(5)),
                      (lambda t: ops.mul(t, t) * t, 3 * x * x)):
        xt = leaf(x)
        ops.sum(f(xt)).backward()
        np.testing.assert_allclose(xt.grad, expect, rtol=1e-14)


@pytest.mark.parametrize("order", ["skip first", "skip last"])
def test_intermediate_used_by_a_branch_and_directly(order):
    """b = 3x feeds r directly and through gelu: the residual pattern x + f(x) of every
    transformer block. b's gradient is complete only after the gelu branch has been
    walked; a wrong topological order walks b too early and drops that branch."""
    x = rnd(4, seed=4)
    xt = leaf(x)
    b = xt * 3.0
    r = ops.add(b, ops.gelu(b)) if order == "skip first" else ops.add(ops.gelu(b), b)
    ops.sum(r).backward()
    np.testing.assert_allclose(xt.grad, 3.0 * (1.0 + gelu_prime(3 * x)), rtol=1e-12,
                               err_msg=f"d/dx sum(b + gelu(b)), b = 3x, operand order {order!r}")


def test_deep_residual_chain():
    """x_{i+1} = x_i + gelu(x_i * c_i), 6 times: d x_6 / d x_0 is the product of the
    per-step derivatives; every residual order must come out right."""
    x0 = rnd(3, seed=5)
    cs = [0.5, -1.2, 0.8, 1.5, -0.3, 1.1]
    xt = leaf(x0)
    h, x, deriv = xt, x0.copy(), np.ones(3)
    for i, c in enumerate(cs):
        branch = ops.gelu(h * c)
        h = ops.add(h, branch) if i % 2 else ops.add(branch, h)
        deriv = deriv * (1 + c * gelu_prime(c * x))
        x = x + 0.5 * (c * x) * (1 + np.tanh(math.sqrt(2 / math.pi) * (c * x + 0.044715 * (c * x) ** 3)))
    np.testing.assert_allclose(h.data, x, rtol=1e-13)
    ops.sum(h).backward()
    np.testing.assert_allclose(xt.grad, deriv, rtol=1e-12)


def test_leaf_grads_do_not_alias():
    """Add hands the same gradient array to both inputs, and backward(g) hands the caller's
    array down: each leaf must own its .grad, or the next += lands in several places."""
    a, b = leaf(np.zeros(3)), leaf(np.zeros(3))
    g = np.ones(3)
    for _ in range(2):
        ops.add(a, b).backward(g)
    np.testing.assert_array_equal(a.grad, [2, 2, 2])
    np.testing.assert_array_equal(b.grad, [2, 2, 2])
    np.testing.assert_array_equal(g, [1, 1, 1])
    assert not np.shares_memory(a.grad, b.grad)


# --- several graphs alive at once --------------------------------------------------------------

def test_two_live_graphs_backward_in_reverse_order():
    x, w, v = rnd(3, 4, seed=6), rnd(4, 5, seed=7), rnd(5, seed=8)

    def graph(xt, wt, vt, k):
        h = ops.gelu(ops.matmul(xt, wt) * float(k))
        return ops.sum(ops.mul(h, vt) + h)

    def grads_one_at_a_time():
        ts = [leaf(x), leaf(w), leaf(v)]
        graph(*ts, 1).backward()
        graph(*ts, 2).backward()
        return [t.grad for t in ts]

    ts = [leaf(x), leaf(w), leaf(v)]
    l1 = graph(*ts, 1)
    l2 = graph(*ts, 2)              # both alive, sharing the leaves
    assert l1.saved_bytes() > 0 and l2.saved_bytes() > 0
    l2.backward()
    assert l1.saved_bytes() > 0, "backward of one graph freed another graph"
    l1.backward()
    for got, ref, n in zip([t.grad for t in ts], grads_one_at_a_time(), "xwv"):
        np.testing.assert_allclose(got, ref, rtol=1e-13, err_msg=n)


def test_two_live_model_graphs_like_micro_batches():
    """Two micro-batches of the GPT in flight, backward in reverse order = one at a time."""
    (i1, t1), (i2, t2) = batch(1), batch(2)
    ref = GPT(TINY, seed=0)
    ref(i1, t1).backward()
    ref(i2, t2).backward()
    m = GPT(TINY, seed=0)
    l1, l2 = m(i1, t1), m(i2, t2)
    l2.backward()
    l1.backward()
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        np.testing.assert_allclose(p.grad, q.grad, rtol=1e-12, atol=1e-15, err_msg=n)


# --- leaf hooks -----------------------------------------------------------------------------------

def test_hook_fires_once_after_gradient_is_complete():
    x = rnd(4, seed=9)
    xt = leaf(x)
    seen = []
    xt.register_grad_hook(lambda p: seen.append(p.grad.copy()))
    # x is used by three ops at different depths
    ops.sum(ops.mul(xt, ops.gelu(xt * 2.0)) + xt).backward()
    assert len(seen) == 1, f"hook fired {len(seen)} times in one backward"
    expect = ops.gelu(Tensor(2 * x)).data + x * 2 * gelu_prime(2 * x) + 1
    np.testing.assert_allclose(xt.grad, expect, rtol=1e-12)
    np.testing.assert_allclose(seen[0], xt.grad, rtol=0, err_msg="hook saw an incomplete gradient")
    ops.sum(xt * 2.0).backward()
    assert len(seen) == 2
    np.testing.assert_allclose(seen[1], expect + 2, rtol=1e-14, err_msg="hook runs after the += into .grad")


def test_hook_removal_and_non_leaf():
    xt = leaf(rnd(3, seed=10))
    calls = []
    fn = xt.register_grad_hook(lambda p: calls.append(1))
    xt.remove_grad_hook(fn)
    ops.sum(xt * 2.0).backward()
    assert calls == []
    with pytest.raises(ValueError):
        (xt * 2.0).register_grad_hook(lambda p: None)


@pytest.mark.parametrize("tied", [True, False])
def test_model_hooks_see_final_grads_and_fire_last_used_first(tied):
    cfg = GPTConfig(**{**TINY.to_dict(), "tie_embeddings": tied})
    m = GPT(cfg, seed=0)
    fired, snap = [], {}

    def hook(p):
        fired.append(p.name)
        snap[p.name] = p.grad.copy()

    for _, p in m.named_parameters():
        p.register_grad_hook(hook)
    idx, tgt = batch(3)
    for rep in (1, 2):                                       # second backward accumulates
        fired.clear()
        m(idx, tgt).backward()
        names = [n for n, _ in m.named_parameters()]
        assert sorted(fired) == sorted(names), "every parameter's hook fires exactly once per backward"
        for n, p in m.named_parameters():
            np.testing.assert_array_equal(snap[n], p.grad, err_msg=f"{n}: hook saw an incomplete gradient")
    pos = {n: i for i, n in enumerate(fired)}
    last = max(pos[n] for n in names if n.startswith("h.1."))
    first = min(pos[n] for n in names if n.startswith("h.0."))
    assert last < first, f"h.1 parameters must all fire before h.0; order {fired}"
    head = ["ln_f.weight", "ln_f.bias"] + ([] if tied else ["lm_head.weight"])
    assert max(pos[n] for n in head) < min(pos[n] for n in names if n.startswith("h.")), fired
    assert pos["wpe.weight"] > max(pos[n] for n in names if n.startswith("h.")), fired
    # tied: wte is used by the head first in backward, but complete only after the embedding
    assert pos["wte.weight"] > max(pos[n] for n in names if n.startswith("h.")), fired


# --- no_grad ------------------------------------------------------------------------------------

def test_no_grad_records_nothing():
    xt = leaf(rnd(2, 3, seed=11))
    with no_grad():
        assert not is_grad_enabled()
        y = ops.gelu(ops.linear(xt, leaf(rnd(3, 2, seed=12))))
        assert not y.requires_grad and y.is_leaf
        assert y.saved_bytes() == 0
        with no_grad():
            pass
        assert not is_grad_enabled(), "nested no_grad re-enabled grad on exit"
    assert is_grad_enabled()
    z = ops.gelu(xt)
    assert z.requires_grad and not z.is_leaf


def test_no_grad_restores_state_after_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with no_grad():
            raise RuntimeError("boom")
    assert is_grad_enabled()
    with pytest.raises(ValueError):
        with no_grad():
            ops.matmul(leaf(np.ones((2, 3))), leaf(np.ones((4, 5))))
    assert is_grad_enabled()
    assert ops.mul(leaf([1.0]), 2.0).requires_grad


def test_constants_do_not_require_grad():
    y = ops.gelu(Tensor(np.ones(3)))
    assert not y.requires_grad and y.is_leaf


# --- saved_bytes -----------------------------------------------------------------------------------

def test_saved_bytes_counts_activations_not_weights():
    x = Tensor(rnd(4, 5, seed=13))                            # data: a leaf, no grad
    b, w2 = leaf(rnd(5, seed=14)), leaf(rnd(5, 1000, seed=15))
    h = ops.add(x, b)                                         # fresh (4, 5) activation; Add saves nothing
    assert h.saved_bytes() == 0
    y = ops.linear(h, w2)                                     # saves h and w2 (5000 floats)
    assert y.saved_bytes() == h.data.nbytes, (y.saved_bytes(), h.data.nbytes)
    loss = ops.sum(ops.gelu(y))
    assert loss.saved_bytes() > y.saved_bytes()
    loss.backward()
    assert loss.saved_bytes() == 0 and y.saved_bytes() == 0, "backward frees the graph"


def test_saved_bytes_excludes_a_transposed_parameter():
    """The tied GPT head, x @ wte.T, saves a transposed *view* of the parameter: that is
    parameter memory, not activation memory."""
    x = Tensor(rnd(2, 3, 4, seed=16))
    h = ops.add(x, leaf(rnd(4, seed=17)))                     # (2, 3, 4) activation
    w = leaf(rnd(5000, 4, seed=18))                           # a big "embedding"
    y = ops.matmul(h, ops.transpose(w))
    assert y.saved_bytes() == h.data.nbytes, \
        f"saved_bytes {y.saved_bytes()} != activation {h.data.nbytes} (weight is {w.data.nbytes})"


def test_saved_bytes_counts_a_shared_activation_once():
    """h is kept by Mul (as is) and by Linear (possibly as a reshaped view): one buffer."""
    h = ops.add(Tensor(rnd(2, 3, 4, seed=19)), leaf(rnd(4, seed=20)))
    c, w = leaf(rnd(4, seed=21)), leaf(rnd(4, 4, seed=22))
    y = ops.add(ops.mul(h, c), ops.linear(h, w))
    assert y.saved_bytes() == h.data.nbytes, (y.saved_bytes(), h.data.nbytes)


def test_saved_bytes_retain_graph():
    xt = leaf(rnd(3, 4, seed=23))
    y = ops.sum(ops.gelu(ops.gelu(xt)))
    b = y.saved_bytes()
    assert b > 0
    y.backward(retain_graph=True)
    assert y.saved_bytes() == b
    g = xt.grad.copy()
    y.backward()
    np.testing.assert_allclose(xt.grad, 2 * g, rtol=1e-14)
    assert y.saved_bytes() == 0


def test_model_saved_bytes_do_not_count_the_embedding():
    """Doubling V adds exactly the (N, V) softmax that cross-entropy keeps, never wte."""
    idx, tgt = batch(4, V=11)
    sizes = {}
    for V in (11, 211):
        cfg = GPTConfig(**{**TINY.to_dict(), "vocab_size": V})
        sizes[V] = GPT(cfg, seed=0)(idx, tgt).saved_bytes()
    N = idx.size
    assert sizes[211] - sizes[11] == N * 200 * 8, \
        f"extra saved bytes {sizes[211] - sizes[11]} != N*dV*8 = {N * 200 * 8} (wte grows by {200 * 8 * 8})"


# --- errors -----------------------------------------------------------------------------------

def test_backward_errors():
    xt = leaf(rnd(2, 3, seed=24))
    y = ops.gelu(xt)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        y.backward()
    with pytest.raises(ValueError):
        y.backward(np.ones((3, 2)))
    y.backward(np.ones((2, 3)))                               # explicit grad: fine
    assert xt.grad.shape == (2, 3)
    z = ops.sum(xt * xt)
    z.backward(np.array(2.0))
    np.testing.assert_allclose(xt.grad, gelu_prime(xt.data) + 4 * xt.data, rtol=1e-12)


def test_set_grad_buffer_overwrites_the_buffer_in_place_once():
    """A preallocated gradient buffer given with set_grad_buffer (how DP buckets avoid a memset)
    is written, not added to, by the next backward, in place; the backward after that accumulates."""
    from minipar.autograd import ops
    w = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    buf = np.full(3, 99.0)
    w.set_grad_buffer(buf)
    ops.sum(ops.mul(w, Tensor(np.array([1.0, 1.0, 1.0])))).backward()
    assert w.grad is buf and np.array_equal(buf, [1.0, 1.0, 1.0]) and not w._overwrite_grad
    ops.sum(ops.mul(w, Tensor(np.array([2.0, 2.0, 2.0])))).backward()
    assert np.array_equal(buf, [3.0, 3.0, 3.0])
