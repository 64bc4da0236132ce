"""backward_split: B (activations' gradients) then W (parameters' gradients) equals one
backward bit for bit in float64; B touches no parameter and W computes no activation
gradient; hooks fire in W, once each."""
import numpy as np
import pytest

from minipar.autograd import backward_split, ops
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel.parallelize import parts
from minipar.autograd.tensor import Tensor

CFG = dict(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)


def model(recompute="none", tied=True):
    return GPT(GPTConfig(**CFG, tie_embeddings=tied), seed=0, dtype=np.float64, parts=parts(recompute))


def ids(seed=0):
    return np.random.default_rng(seed).integers(0, 64, (3, 8))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_b_then_w_equals_one_backward_bit_for_bit(recompute, tied):
    one, split = model(recompute, tied), model(recompute, tied)
    one(ids(), ids(1)).backward()
    pending = backward_split.backward_b(split(ids(), ids(1)), np.ones(()))
    assert all(p.grad is None for p in split.parameters()), "B touched a parameter"
    pending.run()
    for (name, p), q in zip(one.named_parameters(), split.parameters()):
        assert np.array_equal(p.grad, q.grad), name


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_stage_input_gets_its_gradient_in_b(recompute):
    """A pipeline stage after the first: its input is a leaf; B must finish its gradient (it
    goes to the previous stage at once), equal to one backward's."""
    rng = np.random.default_rng(2)
    x0 = rng.standard_normal((3, 8, 16))
    g = rng.standard_normal((3, 8, 16))
    grads = []
    for split in (False, True):
        m = model(recompute)
        x = Tensor(x0.copy(), requires_grad=True)
        y = m.run_block(1, m.run_block(0, x))
        if split:
            pending = backward_split.backward_b(y, g, inputs=[x])
            assert x.grad is not None and all(p.grad is None for p in m.parameters())
            pending.run()
        else:
            y.backward(g)
        grads.append([x.grad] + [p.grad for p in m.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1])
    assert all(np.array_equal(a, b) for a, b in zip(*grads))


def test_b_computes_no_weight_gradient_and_w_no_input_gradient(monkeypatch):
    """Every Linear backward in B asks for dx only, every one in W for dW (and db) only."""
    calls = []
    orig = ops.Linear.backward

    def spy(self, g):
        calls.append(tuple(self.needs_input_grad))
        return orig(self, g)
    monkeypatch.setattr(ops.Linear, "backward", spy)
    m = model()
    pending = backward_split.backward_b(m(ids(), ids(1)), np.ones(()))
    in_b, calls[:] = list(calls), []
    pending.run()
    assert in_b and all(c[0] and not any(c[1:]) for c in in_b), in_b
    assert calls and all(not c[0] and all(c[1:]) for c in calls), calls
    assert len(in_b) == len(calls) == 4 * CFG["n_layer"]                # c_attn, c_proj, c_fc, c_proj


def test_hooks_fire_in_w_once_each():
    m = model("full")
    fired = []
    for name, p in m.named_parameters():
        p.register_grad_hook(lambda t, name=name: fired.append(name))
    pending = backward_split.backward_b(m(ids(), ids(1)), np.ones(()))
    assert fired == []
    pending.run()
    assert sorted(fired) == sorted(n for n, _ in m.named_parameters())
