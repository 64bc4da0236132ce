"""Data parallelism against its single-process twin, in float64 (run under mpirun -n 4).

Every rank also computes the single-process reference itself (tiny model, no messages), so
each comparison is local and the failure message names the rank and the layout.
"""
import numpy as np
import pytest
from mpi4py import MPI

from minipar import comm
from minipar.train import data, trainer as train
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel import data_parallel
from minipar.parallel.grid import ProcessGrid
from minipar.parallel.layout import Layout

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
STEPS = 3


def flags(*extra):
    return train.build_parser().parse_args(
        ["--batch-size", "8", "--steps", str(STEPS), "--warmup", "1", "--lr", "1e-2", "--grad-clip", "0",
         "--dtype", "float64", "--seed", "0", "--n-layer", "2", "--n-head", "2", "--n-embd", "16",
         "--block-size", "16", *extra])


def tokens():
    return data.load_tokens(None, CFG.block_size)


def run(args, dp_comm=None, mode="bucketed", bucket_mb=1.0, check=None):
    """3 steps; dp_comm None is the single-process twin.
    -> (losses, grads, params, ddp, gradient norms, model)."""
    model = GPT(CFG, seed=args.seed, dtype=np.float64)
    opt = train.build_optimizer(model, args)
    sampler = data.Sampler(tokens(), CFG.block_size, args.batch_size, args.seed)
    B = args.batch_size
    if dp_comm is None:
        ddp, group, rows = None, None, (0, B)
    else:
        grid = ProcessGrid(dp_comm, Layout(dp=dp_comm.Get_size()))
        group = grid.dp_group
        ddp = data_parallel.make(model.parameters(), group, mode, bucket_mb)
        if check is not None:
            ddp.finish = check(ddp, ddp.finish)
        rows = (grid.dp_rank * B // grid.dp_size, (grid.dp_rank + 1) * B // grid.dp_size)
    log = list(train.train_steps(train.Session(args, model, opt, sampler, sync=ddp, rows=rows, dp_group=group), 0, STEPS))
    grads = {n: p.grad.copy() for n, p in model.named_parameters()}
    return [r["loss"] for r in log], grads, model.state_dict(), ddp, [r["grad_norm"] for r in log], model


@pytest.fixture(scope="module")
def twin():
    return {m: run(flags("--micro-batches", str(m))) for m in (1, 2, 4)}


def split(k):
    """Cut the world into blocks of k ranks (k divides SIZE)."""
    return WORLD.Split(color=RANK // k, key=RANK)


def assert_twin(out, ref, what):
    losses, grads, params = out[:3]
    rlosses, rgrads, rparams = ref[:3]
    np.testing.assert_allclose(losses, rlosses, rtol=1e-12, atol=0, err_msg=f"losses {what} rank={RANK}")
    for n in rparams:
        scale = max(np.abs(rgrads[n]).max(), 1e-30)
        np.testing.assert_allclose(grads[n] / scale, rgrads[n] / scale, rtol=0, atol=1e-12,
                                   err_msg=f"grad {n} {what} rank={RANK}")
        np.testing.assert_allclose(params[n], rparams[n], rtol=1e-12, atol=1e-14,
                                   err_msg=f"param {n} {what} rank={RANK}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("mode,bucket_mb", [("bucketed", 1.0), ("bucketed", 1e-3), ("bucketed", 1e3),
                                            ("naive", 0)])
def test_dp_matches_single_process(twin, dp, mode, bucket_mb):
    sub = split(dp)
    out = run(flags(), sub, mode, bucket_mb)
    assert_twin(out, twin[1], f"dp={dp} mode={mode} bucket_mb={bucket_mb}")
    sub.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("m", [1, 2, 4])
def test_micro_batches_match(twin, m):
    sub = split(2)                                   # dp=2: 4 rows per rank, cut into m
    out = run(flags("--micro-batches", str(m)), sub)
    assert_twin(out, twin[1], f"dp=2 micro-batches={m}")
    assert_twin(out, twin[m], f"dp=2 micro-batches={m} vs twin with the same m")
    sub.Free()


@pytest.fixture(scope="module")
def twin_clipped():
    return run(flags("--batch-size", "12", "--grad-clip", "0.05"))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("dp", [2, 3, 4])
@pytest.mark.parametrize("bucket_mb", [1.0, 1e-3, 1e3])
def test_clipping_norm_split_over_dp(twin_clipped, dp, bucket_mb):
    """Bucketed dp squares only each rank's piece of each bucket and all-reduces the sum:
    every step's norm equals the twin's at 1e-12, clipping (active) gives the same
    parameters, and grad_norm_sq equals the sum over all gradients. (On 4 ranks, dp=3
    leaves rank 3 alone: a group of one.)"""
    sub = split(dp)
    args = flags("--batch-size", "12", "--grad-clip", "0.05")
    out = run(args, sub, "bucketed", bucket_mb)
    ref_norms = twin_clipped[4]
    assert min(ref_norms) > 0.05, f"clipping is not active: norms {ref_norms}"
    np.testing.assert_allclose(out[4], ref_norms, rtol=1e-12, atol=0, err_msg=f"grad norms dp={dp} rank={RANK}")
    assert_twin(out, twin_clipped, f"dp={dp} bucket_mb={bucket_mb} clipped")
    ddp, model = out[3], out[5]
    full = sum(float(np.sum(p.grad ** 2)) for p in model.parameters())
    np.testing.assert_allclose(ddp.grad_norm_sq(model), full, rtol=1e-13, atol=0)
    sub.Free()


@pytest.mark.mpi(min_size=4)
def test_buckets_launch_during_backward_in_reverse_order():
    """With tiny buckets every bucket's all-reduce has been started from a gradient hook
    before finish() runs, and the last layers' bucket is first in the list."""
    seen = {}

    def check(ddp, finish):
        def wrapped():
            seen["launched"] = sum(b.handle is not None for b in ddp.buckets)
            seen["total"] = len(ddp.buckets)
            return finish()
        return wrapped

    sub = split(4)
    ddp = run(flags(), sub, "bucketed", 1e-4, check)[3]
    assert seen["total"] > 10 and seen["launched"] == seen["total"], seen
    first = ddp.buckets[0].params[0]
    assert first.name == "ln_f.bias", f"first bucket starts with {first.name}, expected the last parameter"
    sub.Free()


@pytest.mark.mpi(min_size=4)
def test_grad_sync_bytes_equal_the_ring_formula():
    """One bucket holding every gradient, with p | n: the ledger shows exactly 2(p-1)/p * n
    bytes sent per rank per step (the loss all-reduce is counted separately)."""
    sub = split(4)
    args = flags("--n-embd", "32")
    cfg = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=32)   # 273 KB: the ring's size
    model = GPT(cfg, dtype=np.float64)
    n_bytes = sum(p.data.nbytes for p in model.parameters())
    assert (n_bytes // 8) % 4 == 0 and n_bytes > 4 * comm.ALL_REDUCE_DOUBLING_MAX_BYTES, n_bytes
    grid = ProcessGrid(sub, Layout(dp=4))
    ddp = data_parallel.make(model.parameters(), grid.dp_group, "bucketed", 1e3)
    sampler = data.Sampler(tokens(), cfg.block_size, args.batch_size, args.seed)
    rows = (grid.dp_rank * 2, grid.dp_rank * 2 + 2)
    opt = train.build_optimizer(model, args)
    for row in train.train_steps(train.Session(args, model, opt, sampler, sync=ddp, rows=rows, dp_group=grid.dp_group), 0, 2):
        assert row["grad_sync_bytes"] == 2 * 3 * n_bytes // 4, (row, n_bytes)
    sub.Free()


@pytest.mark.mpi(min_size=4)
def test_replica_check_detects_divergence():
    sub = split(4)
    grid = ProcessGrid(sub, Layout(dp=4))
    model = GPT(CFG, dtype=np.float64)
    data_parallel.check_replicas(model.parameters(), grid.dp_group)   # identical: no error
    if grid.dp_rank == 2:
        model.params["h.1.mlp.c_fc.bias"].data[3] += 1e-15
    with pytest.raises(RuntimeError, match=r"dp ranks \[2\]"):
        data_parallel.check_replicas(model.parameters(), grid.dp_group)
    comm.reset_traffic()
    sub.Free()
