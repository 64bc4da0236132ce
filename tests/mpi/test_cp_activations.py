"""Activation memory with context parallelism: Tensor.saved_bytes of one forward (with the
loss) on this rank's tokens equals activations.stage_bytes(..., cp=C) to the byte, and one
layer's bytes (3 layers less 2) equal activations.layer_bytes(..., cp=C). Run under
mpirun -n 4: cp 2 and 4 on the `groups` fixture's blocks of ranks; cp 2 x tp 2 on the
trainer's grid (tp fastest, then cp: docs/design.md §6), where the vocabulary-parallel ops
keep the ids this rank's slice owns (given to the formula, as tests/mpi/test_sequence_parallel.py
does for tp).

What the formula says a rank keeps (the module docstring of activations.py): everything per
token on its T/C tokens, the ring's q, k, v, o and log-sum-exp instead of the T x T softmax,
whatever --recompute (full: the block inputs alone), and its T/C positions.
"""
import numpy as np
import pytest
from mpi4py import MPI

from minipar.plan import activations
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel.context.context_parallel import ContextSplit
from minipar.parallel.grid import ProcessGrid
from minipar.parallel.layout import Layout
from minipar.parallel.parallelize import parts
from minipar.parallel.tensor.tensor_parallel import TensorParallelGPT

WORLD = MPI.COMM_WORLD
V, T, C, B = 97, 16, 24, 2                   # T = 16: 2 x cp divides it for cp = 2 and 4
DTYPES = {"float64": (np.float64, 8, 8), "float32": (np.float32, 4, 4), "float16": (np.float16, 2, 4)}


def config(n_layer, n_head):
    return GPTConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=n_head, n_embd=C)


def batch(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(0, V, size=(2, B, T))


def forward_bytes(make, split, recompute):
    """{n_layer: saved bytes of the loss} for 2 and 3 layers, on this rank's tokens."""
    x, y = batch()
    out = {}
    for n_layer in (2, 3):
        model = make(n_layer, parts(recompute, context=split))
        out[n_layer] = model(split.local(x), split.local(y), loss_denom=B * T).saved_bytes()
    return out


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("cp,n_head,layout", [(2, 3, "zigzag"), (4, 3, "zigzag"), (4, 3, "contiguous"),
                                              (2, 1, "zigzag")], ids=["cp2", "cp4", "cp4-contiguous", "cp2-one-head"])
def test_saved_bytes_equal_the_formula(groups, cp, n_head, layout, dtype, recompute):
    """The layout moves the tokens, not the bytes. One head (the trap of activations.py's
    docstring): c_proj's input is a view of the ring's output o, counted once."""
    g = groups[cp]
    if g.size != cp:
        pytest.skip(f"needs {cp} ranks")
    dt, s, c = DTYPES[dtype]
    split = ContextSplit(g, layout)
    got = forward_bytes(lambda n, p: GPT(config(n, n_head), seed=0, dtype=dt, parts=p), split, recompute)
    where = f"cp={cp} rank {g.rank} {dtype} {recompute} {layout} H={n_head}"
    assert got[3] == activations.stage_bytes(config(3, n_head), 0, 1, 1, B, s, c, False, recompute, cp=cp), where
    assert got[3] - got[2] == activations.layer_bytes(B, T, C, n_head, 1, s, c, False, recompute, cp), where


@pytest.fixture(scope="module")
def grid():
    """cp 2 x tp 2 on the world, as the trainer cuts it."""
    if WORLD.Get_size() != 4:
        pytest.skip("cp 2 x tp 2 needs 4 ranks")
    return ProcessGrid(WORLD, Layout(dp=1, tp=2, pp=1, cp=2))


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("n_head", [4, 2], ids=["H4", "H2-one-head-per-tp-rank"])
def test_saved_bytes_with_tp_equal_the_formula(grid, n_head, dtype, recompute):
    """cp 2 x tp 2 on 4 ranks: the vocabulary-parallel embedding and cross-entropy keep the
    ids (and targets) of this rank's tokens that its vocabulary slice owns, the one
    data-dependent term, given to the formula."""
    dt, s, c = DTYPES[dtype]
    split = ContextSplit(grid.cp_group, "zigzag")
    made = []

    def make(n, p):
        made.append(TensorParallelGPT(config(n, n_head), grid.tp_group, seed=0, dtype=dt, parts=p))
        return made[-1]

    got = forward_bytes(make, split, recompute)
    x, y = (split.local(a) for a in batch())
    lo, n = made[-1].vocab_start, made[-1].vocab_per_rank
    owned = (int(((x >= lo) & (x < lo + n)).sum()), int(((y >= lo) & (y < lo + n)).sum()))
    where = f"cp rank {grid.cp_rank} tp rank {grid.tp_rank} {dtype} {recompute} H={n_head} owned={owned}"
    want = activations.stage_bytes(config(3, n_head), 0, 1, 2, B, s, c, False, recompute, owned, cp=2)
    assert got[3] == want, where
    assert got[3] - got[2] == activations.layer_bytes(B, T, C, n_head, 2, s, c, False, recompute, 2), where
