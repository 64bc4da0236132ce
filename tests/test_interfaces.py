"""The two contracts of minipar/model/contract.py (docs/design.md §4) are kept by every class that
the trainer uses through them: the model layouts derive from Model, and each gradient
synchroniser has every member of GradSync (a Protocol: checked here, member by member)."""
import inspect

import numpy as np
import pytest
from mpi4py import MPI

from minipar import comm
from minipar.model.contract import Model
from minipar.parallel.data_parallel import GradSync
from minipar.model.gpt import GPT, GPTConfig
from minipar.optim.adamw import AdamW
from minipar.parallel import data_parallel
from minipar.parallel.pipeline import stage as pipeline
from minipar.parallel.tensor import tensor_parallel
from minipar.parallel.zero import build as zero

CFG = GPTConfig(vocab_size=11, block_size=4, n_layer=2, n_head=2, n_embd=8)


def protocol_members(proto) -> set:
    methods = {n for n, v in vars(proto).items() if inspect.isfunction(v) and not n.startswith("_")}
    return methods | set(getattr(proto, "__annotations__", {}))


def missing_members(obj, proto) -> list:
    return sorted(m for m in protocol_members(proto) if not hasattr(obj, m))


def one_rank():
    return comm.Group(MPI.COMM_SELF, axis="dp")


SYNCHRONISERS = {                                # a model's parameters -> its synchroniser
    "NoSync": lambda m: data_parallel.NoSync(m.parameters()),
    "DataParallelNaive": lambda m: data_parallel.DataParallelNaive(m.parameters(), one_rank()),
    "DataParallelBucketed": lambda m: data_parallel.DataParallelBucketed(m.parameters(), one_rank(), 1e-3),
    "Zero": lambda m: zero.build(m, AdamW(m.parameters()), one_rank(), 2)[0],
}


def test_grad_sync_lists_what_the_trainer_calls():
    assert protocol_members(GradSync) == {"exposed_seconds", "zero_grad", "start_step", "sync_now", "finish",
                                          "grad_norm_sq", "local_found_inf", "tied_grad"}


@pytest.mark.parametrize("name", SYNCHRONISERS)
def test_every_synchroniser_keeps_grad_sync(name):
    """Every member is there, and one step through them (one dp rank) gives the gradients'
    sum of squares of the model alone."""
    model = GPT(CFG, dtype=np.float64)
    sync = SYNCHRONISERS[name](model)
    assert not missing_members(sync, GradSync), (name, missing_members(sync, GradSync))
    sync.zero_grad()
    sync.start_step()
    sync.sync_now(True)
    x = np.arange(8).reshape(2, 4) % CFG.vocab_size
    model(x, x).backward()
    sync.finish()
    twin = GPT(CFG, dtype=np.float64)
    twin(x, x).backward()
    want = sum(float(np.sum(p.grad ** 2)) for p in twin.parameters())
    np.testing.assert_allclose(sync.grad_norm_sq(model), want, rtol=1e-12, err_msg=name)
    assert sync.local_found_inf(model) is False


def test_a_synchroniser_missing_a_member_is_caught():
    class Partial:
        exposed_seconds = 0.0

        def zero_grad(self):
            pass
    assert missing_members(Partial(), GradSync) == ["finish", "grad_norm_sq", "local_found_inf", "start_step",
                                                    "sync_now", "tied_grad"]


def test_every_model_layout_is_a_model():
    for cls in (GPT, tensor_parallel.TensorParallelGPT, pipeline.PipelineStage):
        assert issubclass(cls, Model), cls


def test_the_whole_model_answers_the_sharding_hooks_as_one_rank():
    model = GPT(CFG, dtype=np.float64)
    state = model.state_dict()
    assert model.consolidate(state).keys() == state.keys()
    assert all(model.shard(n, a) is a for n, a in state.items())
    assert model.num_params() == model.num_local_params() == sum(a.size for a in state.values())
    x = np.arange(8).reshape(2, 4) % CFG.vocab_size
    model(x, x).backward()
    want = sum(float(np.sum(p.grad ** 2)) for p in model.parameters())
    np.testing.assert_allclose(model.grad_norm_sq(), want, rtol=1e-13)
