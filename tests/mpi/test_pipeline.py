"""Pipeline parallelism against its single-process twin, in float64 (run under mpirun -n 4).

Each layout trains 2 steps through train.train_steps with a PipelineEngine; every rank also
computes the single-process reference itself (tiny model, no messages) and compares its
stage's losses, gradient norms, gradients and parameters (tp shards gathered) to ~1e-12.
"""
import numpy as np
import pytest
from mpi4py import MPI

from minipar import comm
from minipar.train import data, trainer as train
from minipar.train.setup import RunSpec
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel import data_parallel
from minipar.parallel.pipeline import stage as pipeline, schedules
from minipar.parallel.grid import ProcessGrid
from minipar.parallel.layout import Layout

pytestmark = pytest.mark.mpi(min_size=4)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
STEPS, B = 2, 8
# Parameters after AdamW get --verify's float64 tolerance (relative to the tensor's largest
# entry), as in test_tensor_parallel.py: Adam's lr * m / (sqrt(v) + eps) turns 1e-17 of
# rounding noise in a near-zero gradient into moves up to ~1e-11 (measured here: 2e-14
# absolute on a c_attn.weight entry of 1e-2 with tp2 x pp2). Losses, gradient norms and
# gradients, where the pipeline's maths shows, are held to 1e-12: the gradients of the first
# step, computed from the same weights as the twin's (a later step's gradients inherit the
# parameters' Adam noise, ~1e-12 after one step of lr 1e-2).
PARAM_TOL = 1e-10


def flags(n_layer, m, tied=True, schedule="1f1b", clip=0.5, virtual=1):
    return train.build_parser().parse_args(
        ["--batch-size", str(B), "--steps", str(STEPS), "--warmup", "1", "--lr", "1e-2",
         "--grad-clip", str(clip), "--dtype", "float64", "--seed", "0", "--n-layer", str(n_layer),
         "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--micro-batches", str(m),
         "--schedule", schedule, "--virtual-stages", str(virtual)] + ([] if tied else ["--untied"]))


def config(n_layer, tied=True):
    return GPTConfig(vocab_size=256, block_size=16, n_layer=n_layer, n_head=2, n_embd=16, tie_embeddings=tied)


_TOKENS = []


def tokens():
    if not _TOKENS:
        _TOKENS.append(data.load_tokens(None, 16))
    return _TOKENS[0]


_TWINS = {}


def twin(n_layer, m, tied=True):
    """The single-process run: (losses, norms, grads, params), cached."""
    key = (n_layer, m, tied)
    if key not in _TWINS:
        args = flags(n_layer, m, tied)
        model = GPT(config(n_layer, tied), seed=0, dtype=np.float64)
        opt = train.build_optimizer(model, args)
        sampler = data.Sampler(tokens(), 16, B, 0)
        steps = train.train_steps(train.Session(args, model, opt, sampler, rows=(0, B)), 0, STEPS)
        rows = [next(steps)]
        grads = {n: p.grad.copy() for n, p in model.named_parameters()}    # of step 0
        rows += list(steps)
        _TWINS[key] = ([r["loss"] for r in rows], [r["grad_norm"] for r in rows], grads, model.state_dict())
    return _TWINS[key]


def run(n_layer, pp, schedule, m, dp=1, tp=1, tied=True, mode="bucketed", bucket_mb=1.0, virtual=1):
    """STEPS steps on blocks of dp*tp*pp ranks -> (losses, norms, full grads, full params, engine, grid)."""
    k = dp * tp * pp
    sub = WORLD.Split(color=RANK // k, key=RANK)
    grid = ProcessGrid(sub, Layout(dp=dp, tp=tp, pp=pp))
    args = flags(n_layer, m, tied, schedule, virtual=virtual)
    spec = RunSpec(config(n_layer, tied), np.float64, tokens(), 0, None, None, None, grid.layout)
    model, opt = train.init_model(spec, args, grid)
    ddp = data_parallel.make(model.parameters(), grid.dp_group, mode, bucket_mb) if dp > 1 else None
    pipe = pipeline.PipelineEngine(model, schedule, m)
    sampler = data.Sampler(tokens(), 16, B, 0)
    rows = (grid.dp_rank * B // dp, (grid.dp_rank + 1) * B // dp)
    s = train.Session(args, model, opt, sampler, sync=ddp, rows=rows, dp_group=grid.dp_group if dp > 1 else None,
                      pipe=pipe)
    steps = train.train_steps(s, 0, STEPS)
    out = [next(steps)]
    grads = {n: p.grad.copy() for n, p in model.named_parameters()}   # of step 0: same weights as
    if tp > 1:                                                        # the twin, so the maths shows
        grads = model.inner.consolidate(grads)                        # (later steps inherit Adam's noise)
    out += list(steps)
    params = {n: p.data for n, p in model.named_parameters()}
    if tp > 1:                                          # tp shards -> full canonical tensors
        params = model.inner.consolidate(params)
    sub.Free()
    return [r["loss"] for r in out], [r["grad_norm"] for r in out], grads, params, pipe, grid


def assert_twin(out, ref, what):
    losses, norms, grads, params = out[:4]
    rlosses, rnorms, rgrads, rparams = ref
    what = f"{what} rank={RANK}"
    np.testing.assert_allclose(losses, rlosses, rtol=1e-12, atol=0, err_msg=f"losses {what}")
    np.testing.assert_allclose(norms, rnorms, rtol=1e-12, atol=0, err_msg=f"grad norms {what}")
    assert grads, f"a stage with no parameters: {what}"
    for n in grads:
        scale = max(np.abs(rgrads[n]).max(), 1e-30)
        np.testing.assert_allclose(grads[n] / scale, rgrads[n] / scale, rtol=0, atol=1e-12,
                                   err_msg=f"grad {n} {what}")
        top = max(np.abs(rparams[n]).max(), 1e-30)
        np.testing.assert_allclose(params[n] / top, rparams[n] / top, rtol=0, atol=PARAM_TOL,
                                   err_msg=f"param {n} {what}")


@pytest.mark.parametrize("schedule", ["naive", "gpipe", "1f1b"])
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_matches_single_process(pp, m, schedule):
    out = run(pp, pp, schedule, m)
    assert_twin(out, twin(pp, m), f"pp={pp} m={m} {schedule}")
    stage, names = out[5].pp_rank, set(out[2])
    assert names == set(schedules.stage_param_names(config(pp), stage, pp)), names


@pytest.mark.parametrize("n_layer,pp,tied,schedule", [
    (3, 2, True, "1f1b"), (3, 2, False, "gpipe"), (5, 4, False, "1f1b"), (6, 4, True, "naive")])
def test_uneven_split_tied_and_untied(n_layer, pp, tied, schedule):
    out = run(n_layer, pp, schedule, 4, tied=tied)
    assert_twin(out, twin(n_layer, 4, tied), f"L={n_layer} pp={pp} tied={tied} {schedule}")
    layers = {int(n.split(".")[1]) for n in out[2] if n.startswith("h.")}
    assert layers == set(schedules.partition(n_layer, pp)[out[5].pp_rank])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("mode,bucket_mb", [("bucketed", 1e-3), ("bucketed", 1e3), ("naive", 0)])
def test_dp2_x_pp2(schedule, mode, bucket_mb):
    """GPipe's last backward is micro-batch 0, not m-1: the dp sync must key on the stage's
    last Backward instruction, or buckets stay unreduced (picotron's 1F1B + DP trap)."""
    out = run(2, 2, schedule, 4, dp=2, mode=mode, bucket_mb=bucket_mb)
    assert_twin(out, twin(2, 4), f"dp=2 pp=2 {schedule} {mode} {bucket_mb}")


@pytest.mark.parametrize("tied,schedule", [(True, "1f1b"), (False, "gpipe")])
def test_tp2_x_pp2(tied, schedule):
    out = run(3, 2, schedule, 4, tp=2, tied=tied)
    assert_twin(out, twin(3, 4, tied), f"tp=2 pp=2 tied={tied} {schedule}")


def test_tied_copies_of_wte_stay_identical():
    """Stage 0 and the last stage each hold wte.weight; after training both equal the
    twin's, bit for bit equal to each other (same summed gradient, same update)."""
    out = run(4, 4, "1f1b", 4)
    grid, params = out[5], out[3]
    g = comm.Group(WORLD)
    w = params.get("wte.weight", np.zeros((256, 16)))
    digest = comm.all_gather(g, data_parallel.weights_digest([type("P", (), {"data": w})()])).reshape(SIZE, -1)
    assert ("wte.weight" in params) == (grid.pp_rank in (0, 3))
    assert np.array_equal(digest[0], digest[3]), "the two copies of wte differ"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_activation_peak_within_bound(schedule):
    """1F1B holds at most p - stage micro-batches of saved activations, GPipe all m."""
    p, m = 4, 8
    out = run(4, p, schedule, m)
    pipe, s = out[4], out[5].pp_rank
    st = pipe.steps[-1]
    per_mb, peak = st["microbatch_activation_bytes"], st["peak_activation_bytes"]
    assert per_mb > 0
    bound = min(p - s, m) if schedule == "1f1b" else m
    assert peak == bound * per_mb, (schedule, s, peak, per_mb, peak / per_mb)
    # the timeline: m forwards and m backwards, each with start <= end, in the schedule's order
    ops = [(k, mb) for k, mb, _, _ in st["timeline"]]
    want = [(type(i).__name__[0], i.mb) for i in schedules.schedule(schedule, s, p, m)
            if isinstance(i, (schedules.Forward, schedules.Backward))]
    assert ops == want
    assert all(0 <= a <= b <= st["step_time"] for _, _, a, b in st["timeline"])
    assert 0 <= st["bubble"] < 1


def test_consolidated_state_and_evaluate():
    """state_dict gathers every stage to pp rank 0 in canonical order; evaluate gives the
    single-process loss on every rank."""
    n_layer, pp = 4, 4
    sub = WORLD.Split(color=0, key=RANK)
    grid = ProcessGrid(sub, Layout(pp=pp))
    args = flags(n_layer, 1)
    spec = RunSpec(config(n_layer), np.float64, tokens(), 0, None, None, None, grid.layout)
    model, _ = train.init_model(spec, args, grid)
    ref = GPT(config(n_layer), seed=0, dtype=np.float64)
    state = model.state_dict()
    if grid.pp_rank == 0:
        assert list(state) == list(ref.state_dict())
        for n, a in ref.state_dict().items():
            np.testing.assert_array_equal(state[n], a, err_msg=n)
    x, y = data.Sampler(tokens(), 16, B, 0, split="val").batch(0)
    assert model.evaluate(x, y) == pytest.approx(ref(x, y).item(), rel=1e-13)
    assert model.num_params() == ref.num_params()
    assert model.num_local_params() == pipeline.local_param_count(config(n_layer), grid.pp_rank, pp)
    sub.Free()


@pytest.mark.parametrize("schedule,virtual", [("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1)])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_schedules_past_1f1b_match_single_process(pp, m, schedule, virtual):
    """Interleaved 1F1B (2 chunks per rank: 2p layers) and the zero-bubble schedules (B and W
    split) give the twin's losses, gradients and weights; each rank holds the parameters of
    its chunks."""
    n_layer = pp * virtual
    out = run(n_layer, pp, schedule, m, virtual=virtual, tied=m == 4)
    assert_twin(out, twin(n_layer, m, tied=m == 4), f"pp={pp} m={m} {schedule}")
    stage, names = out[5].pp_rank, set(out[2])
    assert names == set(schedules.stage_param_names(config(n_layer, m == 4), stage, pp, virtual)), names


@pytest.mark.parametrize("pp,virtual", [(2, 1), (4, 2), (2, 3)])
def test_point_to_point_messages_per_micro_batch(pp, virtual):
    """A micro-batch crosses pV - 1 boundaries each way: the ranks of the pipeline together
    send 2 m (pV - 1) messages per step (untied: no embedding exchange; the loss goes by
    broadcast), as the ledger counts them."""
    m = 4
    comm.reset_traffic()
    out = run(pp * virtual, pp, "interleaved" if virtual > 1 else "1f1b", m, tied=False, virtual=virtual)
    g = comm.Group(WORLD)
    mine = comm.traffic().get("send", {}).get("calls", 0)
    every = comm.all_gather(g, np.array([mine])).reshape(SIZE // pp, pp).sum(axis=1)   # per pipeline
    assert out[4].model.n_chunks == virtual
    assert list(every) == [STEPS * 2 * m * (pp * virtual - 1)] * (SIZE // pp), every
