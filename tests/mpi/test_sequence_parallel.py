"""Sequence parallelism (minipar/parallel/tensor/sequence_parallel.py) against the single-process
twin in float64, its ledger against tensor parallelism's and the formula, and its saved bytes
against activations.py (run under mpirun -n 4).

tp = 2, 3 and 4 cut the world into blocks (the `groups` fixture); with tp = 3 rank 3 is a
group of one and runs SequenceParallelGPT over tp = 1, which must be the plain model.
"""
import numpy as np
import pytest
from mpi4py import MPI

from minipar.plan import activations
from minipar import comm
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel.tensor import sequence_parallel as spar
from minipar.parallel.tensor import tensor_parallel as tpar
from minipar.parallel.tensor.sequence_parallel import SequenceParallelGPT
from minipar.parallel.tensor.tensor_parallel import TensorParallelGPT
from minipar.parallel.parallelize import parts

RANK = MPI.COMM_WORLD.Get_rank()
V, T, L, H, C = 256, 24, 2, 12, 48           # 12 heads and T = 24: tp = 2, 3, 4 divide both
B, t = 3, 12                                 # t < T: positions 0..t-1 of wpe


def config(tied=True, **kw):
    return GPTConfig(**{**dict(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C,
                               tie_embeddings=tied), **kw})


def batch(seed=0, rows=B, length=t):
    rng = np.random.default_rng(seed)
    x, y = rng.integers(0, V, size=(2, rows, length))
    x[0, 0], y[0, -1] = V - 1, V - 1                  # the shard next to the vocabulary padding
    return x, y


def grads(model, x, y, denom=None):
    model.zero_grad()
    loss = model(x, y, loss_denom=denom)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def worst_difference(model, ref_grads):
    """max over parameters of |this rank's grad - its shard of the twin's| / max |twin's|."""
    return {n: float(np.max(np.abs(g - model.shard(n, ref_grads[n]))) / np.max(np.abs(ref_grads[n])))
            for n, g in ((n, p.grad) for n, p in model.named_parameters())}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_matches_single_process(groups, tp, tied):
    """The loss, the gathered logits and every gradient shard at 1e-12, float64."""
    x, y = batch()
    ref = GPT(config(tied), seed=0, dtype=np.float64)
    ref_loss, ref_grads = grads(ref, x, y)
    model = SequenceParallelGPT(config(tied), groups[tp], seed=0, dtype=np.float64)
    loss, _ = grads(model, x, y)
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    logits = model(x).data                                            # (B, t, Vp/tp)
    every = comm.all_gather(model.group, np.ascontiguousarray(logits)).reshape(model.tp_size, *logits.shape)
    full = np.concatenate(list(every), axis=-1)[..., :V]
    np.testing.assert_allclose(full, ref(x).data, rtol=0, atol=1e-12 * np.abs(full).max())
    bad = {n: d for n, d in worst_difference(model, ref_grads).items() if d > 1e-12}
    assert not bad, bad


def test_replicated_gradients_must_be_summed_over_tp(groups, monkeypatch):
    """The trap: without SumGradOver's all-reduce each rank's LayerNorm and row-parallel
    bias gradients cover its own tokens only. The twin comparison then fails on exactly
    those parameters (and on nothing that tensor parallelism splits)."""
    monkeypatch.setattr(spar.SumGradOver, "backward", lambda self, g: (g, None, None))
    x, y = batch()
    ref = GPT(config(), seed=0, dtype=np.float64)
    _, ref_grads = grads(ref, x, y)
    model = SequenceParallelGPT(config(), groups[2], seed=0, dtype=np.float64)
    grads(model, x, y)
    diff = worst_difference(model, ref_grads)
    wrong = sorted(n for n, d in diff.items() if d > 1e-3)
    want = sorted(n for n in diff if ".ln_" in n or n.startswith("ln_f") or n.endswith("c_proj.bias"))
    if groups[2].size == 1:
        assert wrong == []                                            # nothing to sum alone
    else:
        assert wrong == want, wrong
        assert all(diff[n] <= 1e-12 for n in diff if n not in want)


@pytest.mark.parametrize("tp", [2, 4])
def test_f_and_g_send_what_tensor_parallel_all_reduces_send(groups, tp):
    """Per layer and in all, the all-gather + reduce-scatter pair of f (and of g) sends
    exactly the bytes of tensor parallelism's all-reduce. Activations of 16 x 16 x 48 float64
    = 96 KiB: above the 64 KiB where minipar's all-reduce leaves recursive doubling, so at
    tp = 4 both are bandwidth-optimal (2(p-1)/p n)."""
    cfg, (x, y) = config(), batch(1, rows=16, length=16)
    sent = {}
    for name, cls in (("tp", TensorParallelGPT), ("sp", SequenceParallelGPT)):
        tpar.reset_traffic()
        grads(cls(cfg, groups[tp], seed=0, dtype=np.float64), x, y)
        sent[name] = {k: v["bytes_sent"] for k, v in tpar.traffic().items()}
    if groups[tp].size == 1:
        return
    tp_, sp_ = sent["tp"], sent["sp"]
    assert sp_["f_gather"] + sp_["f_scatter"] == tp_["f"]
    assert sp_["g_scatter"] + sp_["g_gather"] == tp_["g"]
    assert sp_["cross_entropy"] == tp_["cross_entropy"]
    n = 16 * 16 * C * 8
    per_pair = 2 * (tp - 1) * n // tp                                  # one all-reduce's bytes
    assert tp_["f"] == (2 * L + 1) * per_pair
    assert sp_["regather"] == (2 * L + 1) * (tp - 1) * n // tp         # Megatron's extra gather


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("tp", [2, 3])
def test_ledger_equals_sp_count(groups, tp, recompute):
    """Calls and elements of every kind, forward + backward, equal sequence_parallel.sp_count
    (full recomputation gathers and scatters each block's forward again)."""
    cfg, (x, y) = config(), batch(2)
    model = SequenceParallelGPT(cfg, groups[tp], seed=0, dtype=np.float64, parts=parts(recompute))
    tpar.reset_traffic()
    grads(model, x, y)
    got = {k: (v["calls"], v["elements"]) for k, v in tpar.traffic().items()}
    if groups[tp].size == 1:
        assert got == {}
        return
    assert got == spar.sp_count(cfg, B, t, tp, recompute=recompute)


def test_sequence_not_divisible_by_tp_is_an_error(groups):
    model = SequenceParallelGPT(config(), groups[4], seed=0, dtype=np.float64)
    if groups[4].size == 1:
        return
    with pytest.raises(ValueError, match="length 10 is not divisible by 4"):
        model(batch(length=10)[0])


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_saved_bytes_equal_the_formula(groups, tp, sp, recompute):
    """Tensor.saved_bytes of one forward (with the loss) equals activations.stage_bytes to
    the byte, given the ids and targets this rank's vocabulary slice owns (the one
    data-dependent term); and one layer's bytes (3 layers less 2) equal layer_bytes."""
    cls = SequenceParallelGPT if sp else TensorParallelGPT
    x, y = batch(3, length=T)
    measured = {}
    for n_layer in (2, 3):
        model = cls(config(n_layer=n_layer), groups[tp], seed=0, dtype=np.float64, parts=parts(recompute))
        measured[n_layer] = model(x, y).saved_bytes()
    g = groups[tp]
    lo, n = model.vocab_start, model.vocab_per_rank
    owned = (int(((x >= lo) & (x < lo + n)).sum()), int(((y >= lo) & (y < lo + n)).sum()))
    formula = activations.stage_bytes(config(n_layer=3), 0, 1, g.size, B, 8, 8, sp, recompute, owned)
    assert measured[3] == formula
    assert measured[3] - measured[2] == activations.layer_bytes(B, T, C, H, g.size, 8, 8, sp and g.size > 1,
                                                                recompute)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_b_then_w_equals_one_backward_with_tensor_parallelism(groups, sp):
    """backward_split across tp ranks (the zero-bubble schedules' B and W): every gradient equal
    (==) to one backward's, and the same collectives, some of them now in W (sequence
    parallelism's re-gathers and parameter sums, the vocabulary embedding's)."""
    from minipar.autograd import backward_split
    cls = SequenceParallelGPT if sp else TensorParallelGPT
    x, y = batch(4)
    kinds = []
    for split in (False, True):
        model = cls(config(), groups[2], seed=0, dtype=np.float64)
        tpar.reset_traffic()
        loss = model(x, y)
        if split:
            backward_split.backward_b(loss, np.ones(())).run()
        else:
            loss.backward()
        kinds.append(tpar.traffic())
        if not split:
            one = {n: p.grad.copy() for n, p in model.named_parameters()}
    assert all(np.array_equal(p.grad, one[n]) for n, p in model.named_parameters())
    assert kinds[0] == kinds[1]
