"""The Llama family under tensor and sequence parallelism against its single-process twin, in
float64 (mpirun -n 4): grouped-query attention with the key/value heads split by groups
(n_kv_head % tp == 0) and held by several ranks (tp % n_kv_head == 0, their gradients summed over
exactly those ranks), the fused [gate | up] cut per rank, RMSNorm on sequence shards, and the two
mistakes the layout exists to avoid, planted: the contiguous cut of [gate | up] and the missing
sum of a shared key/value head's gradient."""
import numpy as np
import pytest
from mpi4py import MPI

from minipar import comm
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel.tensor import tensor_parallel as tpar
from minipar.parallel.tensor.sequence_parallel import SequenceParallelGPT
from minipar.parallel.tensor.tensor_parallel import TensorParallelGPT

RANK = MPI.COMM_WORLD.Get_rank()
V, T, L, H, C, F = 61, 8, 2, 8, 32, 24          # V odd: vocabulary padding at tp 2 and 4
B = 3


def config(n_kv, tied=False):
    return GPTConfig(arch="llama", vocab_size=V, block_size=T, n_layer=L, n_head=H, n_kv_head=n_kv,
                     n_embd=C, ffn_hidden=F, rope_theta=100.0, tie_embeddings=tied)


def batch():
    rng = np.random.default_rng(11)
    x, y = rng.integers(0, V, size=(2, B, T))
    x[0, 0], y[0, -1] = V - 1, V - 1
    return x, y


def single(cfg):
    model = GPT(cfg, seed=2, dtype=np.float64)
    x, y = batch()
    loss = model(x, y)
    loss.backward()
    return {"logits": model(x).data, "loss": loss.item(),
            "grads": {n: p.grad.copy() for n, p in model.named_parameters()},
            "norm_sq": sum(float((p.grad ** 2).sum()) for p in model.parameters()), "state": model.state_dict()}


def parallel(cls, cfg, group):
    model = cls(cfg, group, seed=2, dtype=np.float64)
    x, y = batch()
    loss = model(x, y)
    loss.backward()
    local = model(x).data
    shards = comm.all_gather(group, np.ascontiguousarray(local)).reshape(group.size, *local.shape)
    return model, {"logits": np.concatenate(list(shards), axis=-1)[..., :V], "loss": loss.item(),
                   "grads": {n: p.grad.copy() for n, p in model.named_parameters()},
                   "norm_sq": model.grad_norm_sq(), "state": model.state_dict()}


def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def assert_twin(model, out, ref, what):
    assert rel(out["logits"], ref["logits"]) <= 1e-12, f"{what}: logits"
    assert rel(out["loss"], ref["loss"]) <= 1e-12, f"{what}: loss"
    assert rel(out["norm_sq"], ref["norm_sq"]) <= 1e-12, f"{what}: the gradient norm counts each copy once"
    for n, g in ref["grads"].items():
        assert rel(out["grads"][n], model.shard(n, g)) <= 1e-12, f"{what}: gradient of {n} (rank {RANK})"
    for n, p in ref["state"].items():
        np.testing.assert_array_equal(out["state"][n], p, err_msg=f"{what}: state_dict {n}")


LAYOUTS = [(4, 2), (4, 4), (2, 2), (2, 4), (1, 2), (1, 4), (8, 4)]       # (n_kv_head, tp)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("cls", [TensorParallelGPT, SequenceParallelGPT], ids=["tp", "sp"])
@pytest.mark.parametrize("n_kv,tp", LAYOUTS, ids=[f"kv{k}-tp{t}" for k, t in LAYOUTS])
def test_equals_the_single_process_twin(groups, cls, n_kv, tp):
    cfg = config(n_kv, tied=(n_kv == 2))
    model, out = parallel(cls, cfg, groups[tp])
    assert model.kv_share == max(1, tp // n_kv)
    assert_twin(model, out, single(cfg), f"{cls.__name__} n_kv_head={n_kv} tp={tp}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("n_kv,tp", [(2, 4), (1, 2), (1, 4)])
def test_a_shared_kv_head_is_held_alike_and_summed_over_its_ranks_only(groups, n_kv, tp, monkeypatch):
    """tp > n_kv_head: the tp/n_kv_head ranks of a key/value head hold equal copies with equal
    (summed) gradients, and the sum runs over exactly those ranks (kv_grads, tp/n_kv_head per
    projection). Without the sum (planted) each copy's gradient is its own query heads' part
    and no longer the twin's."""
    cfg, group = config(n_kv), groups[tp]
    ref = single(cfg)
    model, out = parallel(TensorParallelGPT, cfg, group)
    share = tp // n_kv
    for name in ("layers.0.self_attn.k_proj.weight", "layers.1.self_attn.v_proj.weight"):
        every = comm.all_gather(group, np.ascontiguousarray(out["grads"][name])).reshape(tp, -1)
        for j in range(n_kv):
            copies = every[j * share:(j + 1) * share]
            assert (copies == copies[0]).all(), f"{name}: the copies of kv head {j} got different gradients"
        assert not (every == every[0]).all() or n_kv == 1
    kinds = tpar.traffic()
    assert kinds["kv_grads"]["calls"] >= 2 * L, kinds
    monkeypatch.setattr(tpar.SumGradOver, "backward", lambda self, g: (g, None, None))
    model, out = parallel(TensorParallelGPT, cfg, group)
    worst = max(rel(out["grads"][n], model.shard(n, g)) for n, g in ref["grads"].items() if "k_proj" in n)
    assert worst > 1e-3, f"without the sum the shared heads' gradients still equal the twin's ({worst:.1e})"


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("tp", [2, 4])
def test_the_fused_gate_up_cut_per_rank_and_the_trap(groups, tp):
    """A rank's fused [gate | up] is [gate_r | up_r]. Cutting the canonical fused (C, 2F) into tp
    contiguous blocks has the same shape but gives rank 0 gate only: planted, the loss is wrong."""
    cfg, group = config(2), groups[tp]
    ref = single(cfg)
    model = TensorParallelGPT(cfg, group, seed=2, dtype=np.float64)
    r, n = group.rank, F // tp
    for i in range(L):
        h = f"layers.{i}.mlp."
        gate, up = ref["state"][h + "gate_proj.weight"], ref["state"][h + "up_proj.weight"]
        right = np.concatenate([gate[:, r * n:(r + 1) * n], up[:, r * n:(r + 1) * n]], axis=1)
        mine = np.concatenate([model.params[h + "gate_proj.weight"].data, model.params[h + "up_proj.weight"].data], 1)
        np.testing.assert_array_equal(mine, right)
        wrong = np.concatenate([gate, up], axis=1)[:, r * 2 * n:(r + 1) * 2 * n]      # the contiguous cut
        assert wrong.shape == right.shape and not np.array_equal(wrong, right)
        model.params[h + "gate_proj.weight"].data[...] = wrong[:, :n]
        model.params[h + "up_proj.weight"].data[...] = wrong[:, n:]
    x, y = batch()
    assert rel(model(x, y).item(), ref["loss"]) > 1e-4, "the contiguous cut of [gate | up] went unnoticed"


@pytest.mark.mpi(min_size=4)
def test_rmsnorm_weights_on_sequence_shards_need_their_sum(groups, monkeypatch):
    """--sp: each rank's RMSNorm weights see 1/tp of the tokens; without the sum over tp
    (planted) their gradients are partial."""
    cfg = config(2)
    ref = single(cfg)
    monkeypatch.setattr(tpar.SumGradOver, "backward", lambda self, g: (g, None, None))
    model, out = parallel(SequenceParallelGPT, cfg, groups[4])
    worst = max(rel(out["grads"][n], ref["grads"][n]) for n in ref["grads"] if "layernorm" in n)
    assert worst > 1e-3, worst
