"""Mixed precision across ranks (run under mpirun -n 4): every rank agrees on a skip, and
the memory each rank holds is 2P + 2P + 12P of its own P.

A gradient hook poisons one gradient entry with inf on world rank 3 only, at step 1, during
backward (before data parallelism sums the gradients: that is where an overflow happens).
Every rank of the world must skip that step and only that one, and leave its parameters,
master weights, m, v and step count untouched on it.
"""
import numpy as np
import pytest
from mpi4py import MPI

from minipar import comm
from minipar.train import data, report, trainer as train
from minipar.parallel import data_parallel
from minipar.parallel.pipeline import stage as pipeline
from minipar.parallel.grid import ProcessGrid
from minipar.parallel.layout import Layout

pytestmark = pytest.mark.mpi(min_size=4)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
B, STEPS, POISON_STEP, POISON_RANK = 8, 3, 1, 3


def flags(mode, m, n_layer, dp, tp, pp):
    return train.build_parser().parse_args(
        ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp),
         "--batch-size", str(B), "--steps", str(STEPS), "--warmup", "1", "--precision", mode,
         "--n-layer", str(n_layer), "--n-head", "2", "--n-embd", "16", "--block-size", "16",
         "--micro-batches", str(m), "--sample", "0"])


def setup(mode, dp, tp, pp, m=2, n_layer=2):
    args = flags(mode, m, n_layer, dp, tp, pp)
    grid = ProcessGrid(WORLD, Layout(dp=dp, tp=tp, pp=pp))
    plan = train.prepare(args, SIZE)
    model, opt = train.init_model(plan, args, grid)
    return args, grid, plan, model, opt


def snapshot(model, opt):
    arrays = [p.data for p in model.parameters()] + opt.master + opt.m + opt.v
    return [a.copy() for a in arrays], opt.step_count


LAYOUTS = [  # (dp, tp, pp, dp mode, precision)
    (2, 2, 1, "bucketed", "fp16"),
    (1, 2, 2, "bucketed", "fp16"),
    (2, 1, 2, "naive", "bf16"),
    (2, 1, 2, "bucketed", "fp16"),
]


@pytest.mark.parametrize("dp,tp,pp,dp_mode,mode", LAYOUTS)
def test_every_rank_skips_the_step_one_rank_overflowed(dp, tp, pp, dp_mode, mode):
    what = f"dp={dp} tp={tp} pp={pp} {dp_mode} {mode} rank={RANK}"
    args, grid, plan, model, opt = setup(mode, dp, tp, pp)
    step_now = [0]
    victim = model.parameters()[-1]                      # a parameter every rank holds a piece of

    def poison(p):                                       # registered before dp's own hooks
        if RANK == POISON_RANK and step_now[0] == POISON_STEP:
            p.grad.flat[0] = np.inf
    victim.register_grad_hook(poison)
    ddp = data_parallel.make(model.parameters(), grid.dp_group, dp_mode, 1e-3) if dp > 1 else None
    pipe = pipeline.PipelineEngine(model, "1f1b", args.micro_batches) if pp > 1 else None
    sampler = data.Sampler(plan.tokens, 16, B, 0)
    rows = (grid.dp_rank * B // dp, (grid.dp_rank + 1) * B // dp)
    skipped = []
    for step in range(STEPS):
        step_now[0] = step
        before = snapshot(model, opt)
        with train.quiet_overflow():
            row = train.train_step(train.Session(args, model, opt, sampler, sync=ddp, rows=rows,
                                                 dp_group=grid.dp_group if dp > 1 else None,
                                                 world_group=grid.world, pipe=pipe), step)
        after = snapshot(model, opt)
        unchanged = all(np.array_equal(a, b) for a, b in zip(before[0], after[0])) and before[1] == after[1]
        assert unchanged == row["skipped"], f"step {step}: skipped={row['skipped']} but unchanged={unchanged} {what}"
        skipped.append(row["skipped"])
    everyone = comm.all_gather(comm.Group(WORLD), np.array(skipped, dtype=np.int64)).reshape(SIZE, STEPS)
    want = np.array([[s == POISON_STEP for s in range(STEPS)]] * SIZE, dtype=np.int64)
    np.testing.assert_array_equal(everyone, want, err_msg=f"skips by rank (rows) and step {what}")
    want_scale = 2.0 ** 15 if mode == "fp16" else 1.0             # halved once (fp16), fixed (bf16)
    assert opt.scaler.scale == want_scale, (opt.scaler.scale, what)
    if dp > 1:
        data_parallel.check_replicas(model.parameters(), grid.dp_group)


@pytest.mark.parametrize("dp,tp,pp", [(1, 2, 2), (2, 2, 1), (1, 1, 4)])
@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_memory_is_2P_2P_12P_of_the_local_parameters(dp, tp, pp, mode):
    args, grid, plan, model, opt = setup(mode, dp, tp, pp, m=1, n_layer=4)
    ddp = data_parallel.make(model.parameters(), grid.dp_group, "bucketed", 1.0) if dp > 1 else None
    pipe = pipeline.PipelineEngine(model, "1f1b", 1) if pp > 1 else None
    sampler = data.Sampler(plan.tokens, 16, B, 0)
    rows = (grid.dp_rank * B // dp, (grid.dp_rank + 1) * B // dp)
    train.train_step(train.Session(args, model, opt, sampler, sync=ddp, rows=rows,
                                   dp_group=grid.dp_group if dp > 1 else None, pipe=pipe), 0)
    if pp > 1:
        P = pipeline.local_param_count(plan.cfg, grid.pp_rank, pp, tp)
    else:
        P = model.num_local_params() if tp > 1 else model.num_params()
    assert P == sum(p.size for p in model.parameters())
    mem = report.memory_report(model, opt)
    got = {k: mem[k] for k in ("params", "grads", "optimizer")}
    assert got == {"params": 2 * P, "grads": 2 * P, "optimizer": 12 * P}, (got, P, RANK)
    assert {k: mem["formula"][k] for k in got} == got and mem["formula"]["text"] == "2P + 2P + 12P"
