"""ZeRO stages 1, 2 and 3 against the single-process twin, in float64 (mpirun -n 4).

Every rank computes the twin itself (tiny model, no messages): losses of every step, the
last step's summed gradients (ZeRO's shards gathered over dp, then tp) and the parameters
after the last step. Also: memory and bytes per step equal formulas.formula and
formulas.traffic_theory exactly, and stage 3's re-gather before backward is really needed.
Hybrid sharding (zero/hybrid.py, shard groups of S ranks, replicated across) the same way:
the twin, the clipping norm, memory and bytes.
"""
import numpy as np
import pytest
from mpi4py import MPI

from minipar.train import checkpoint, data, trainer as train
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel.tensor import tensor_parallel
from minipar.parallel.zero import build as zero, formulas, hybrid, stage3, units as zero_units
from minipar.parallel.grid import ProcessGrid
from minipar.parallel.parallelize import parts
from minipar.parallel.layout import Layout

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
STEPS = 3


def flags(*extra):
    return train.build_parser().parse_args(
        ["--batch-size", "24", "--steps", str(STEPS), "--warmup", "1", "--lr", "1e-2", "--grad-clip", "0",
         "--dtype", "float64", "--seed", "0", *extra])


def run(args, sub=None, stage=0, tp=1, S=None, **gathers):
    """STEPS steps. sub None: the single-process twin; else ZeRO `stage` on the ranks of sub
    (dp = size / tp), hybrid over shard groups of S dp ranks when S is given, stage 3's
    gathers as given (prefetch, reshard_after_forward). -> dict(losses,
    grads, params, rows, zero: (sync, optimizer))."""
    B = args.batch_size
    sampler = data.Sampler(data.load_tokens(None, CFG.block_size), CFG.block_size, B, args.seed)
    if sub is None:
        model = GPT(CFG, seed=args.seed, dtype=np.float64)
        opt, z, sync, group, rows = train.build_optimizer(model, args), None, None, None, (0, B)
    else:
        grid = ProcessGrid(sub, Layout(dp=sub.Get_size() // tp, tp=tp))
        p = parts(args.recompute, gathers=stage3.Gathers() if stage == 3 else None)   # as parallelize builds them
        model = (tensor_parallel.TensorParallelGPT(CFG, grid.tp_group, seed=args.seed, dtype=np.float64, parts=p)
                 if tp > 1 else GPT(CFG, seed=args.seed, dtype=np.float64, parts=p))
        blocks = None if S is None else hybrid.blocks(grid.grad_group, S)
        sync, opt = z = zero.build(model, train.build_optimizer(model, args), grid.dp_group, stage, blocks=blocks,
                                   **gathers)
        group = grid.dp_group if grid.dp_size > 1 else None
        rows = (grid.dp_rank * B // grid.dp_size, (grid.dp_rank + 1) * B // grid.dp_size)
    out = list(train.train_steps(train.Session(args, model, opt, sampler, sync=sync, rows=rows, dp_group=group),
                                 0, STEPS))
    if z is None:
        grads = {n: p.grad.copy() for n, p in model.named_parameters()}
    else:
        grads = model.consolidate(opt.gather_local("grad_shard"))   # summed, whole, canonical
    return {"losses": [r["loss"] for r in out], "grads": grads, "params": checkpoint.canonical_state(model, opt),
            "rows": out, "zero": z}


@pytest.fixture(scope="module")
def twin():
    return {m: run(flags("--micro-batches", str(m))) for m in (1, 2)}


def split(k):
    """The world cut into blocks of k ranks (the last block smaller when k does not divide)."""
    return WORLD.Split(color=RANK // k, key=RANK)


def assert_twin(out, ref, what, param_tol=1e-12):
    np.testing.assert_allclose(out["losses"], ref["losses"], rtol=1e-12, atol=0, err_msg=f"losses {what} rank={RANK}")
    np.testing.assert_allclose([r["grad_norm"] for r in out["rows"]], [r["grad_norm"] for r in ref["rows"]],
                               rtol=1e-12, atol=0, err_msg=f"grad norms {what} rank={RANK}")
    for n, r in ref["params"].items():
        scale = max(np.abs(ref["grads"][n]).max(), 1e-30)
        np.testing.assert_allclose(out["grads"][n] / scale, ref["grads"][n] / scale, rtol=0, atol=1e-12,
                                   err_msg=f"grad {n} {what} rank={RANK}")
        scale = max(np.abs(r).max(), 1e-30)
        np.testing.assert_allclose(out["params"][n] / scale, r / scale, rtol=0, atol=param_tol,
                                   err_msg=f"param {n} {what} rank={RANK}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2])
def test_zero_matches_single_process(twin, stage, dp, m):
    """dp 3 leaves rank 3 alone in a group of 1 (ZeRO over one rank is plain training),
    and 3 divides no unit here: every unit is padded."""
    sub = split(dp)
    out = run(flags("--micro-batches", str(m)), sub, stage)
    assert_twin(out, twin[m], f"zero={stage} dp={sub.Get_size()} micro-batches={m}")
    if sub.Get_size() == 3:
        assert out["zero"][0].padding > 0
    sub.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_with_tensor_parallel(twin, stage):
    """dp 2 x tp 2: each tp rank shards its own slices over its dp group. Parameters after
    AdamW steps are held at 1e-10 of each tensor's largest entry, as for tensor parallelism
    alone (tests/mpi/test_tensor_parallel.py says why)."""
    sub = split(4)
    out = run(flags(), sub, stage, tp=2)
    assert_twin(out, twin[1], f"zero={stage} dp=2 tp=2", param_tol=1e-10)
    sub.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("tp", [1, 2])
def test_clipping_by_the_global_norm(stage, tp):
    """--grad-clip 0.05 clips every step: the norm over the dp shards (and tp slices, each
    replicated parameter counted once) must be the twin's."""
    sub = split(4)
    out = run(flags("--grad-clip", "0.05"), sub, stage, tp=tp)
    ref = run(flags("--grad-clip", "0.05"))
    assert all(r["grad_norm"] > 0.05 for r in ref["rows"])
    assert_twin(out, ref, f"zero={stage} dp={4 // tp} tp={tp} clipped", param_tol=1e-10)
    sub.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp,m", [(2, 1), (3, 2), (4, 2)])
def test_memory_and_bytes_equal_the_formulas(stage, dp, m):
    """What each rank holds, from nbytes, is formulas.formula to the byte, and what it sends
    per step (the ledger) is formulas.traffic_theory: (N-1)/N of the padded units' bytes times
    2 (stage 1), M + 1 (stage 2), 3M (stage 3)."""
    sub = split(dp)
    out = run(flags("--micro-batches", str(m)), sub, stage)
    (z, opt), N = out["zero"], sub.Get_size()
    mem = opt.memory_report()
    f = mem["formula"]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (f["params"], f["grads"], f["optimizer"]), mem
    s, P_pad = 8, z.P_pad
    expect = {1: (s * P_pad, s * P_pad, 16 * P_pad // N), 2: (s * P_pad, s * P_pad // N, 16 * P_pad // N),
              3: (s * P_pad // N, s * P_pad // N, 16 * P_pad // N)}[stage]
    assert (f["params"], f["grads"], f["optimizer"]) == expect
    assert z.P == GPT(CFG).num_params() and P_pad == sum(zero_units.padded(u.n, N) for u in z.units)
    held = {}                     # every array the units keep between steps, counted once per buffer
    for u in z.units:
        for a in vars(u).values():
            if isinstance(a, np.ndarray):
                base = a if a.base is None else a.base
                held[id(base)] = base.nbytes
    assert sum(held.values()) == mem["params"] + mem["grads"] + mem["optimizer"], (held, mem)
    calls = {1: 2, 2: m + 1, 3: 3 * m}[stage]
    for row in out["rows"]:
        if N > 1:
            assert row["zero_bytes"] == z.traffic_theory(m) == calls * (N - 1) / N * s * P_pad, (row, N)
        else:
            assert row["zero_bytes"] == 0
    sub.Free()


@pytest.mark.mpi(min_size=4)
def test_stage3_backward_needs_its_regather(monkeypatch):
    """Released parameters hold no memory and read as NaN; without the all-gather placed
    before each block's backward, the gradients come out NaN (the forward's buffer was
    poisoned at release), so the re-gather is not decoration."""
    sub = split(2)
    ok = run(flags(), sub, 3)
    assert all(np.isfinite(g).all() for g in ok["grads"].values())
    p = ok["zero"][0].units[1].params[0]
    assert np.isnan(p.data).all() and p.data.base.nbytes == p.data.itemsize, "a released parameter holds memory"
    monkeypatch.setattr(stage3.Regather, "backward", lambda self, g: (g, None, None, None))
    broken = run(flags(), sub, 3)
    assert np.isfinite(broken["losses"][0]), "the first forward is right: only backward lacks its parameters"
    assert any(np.isnan(g).any() for g in broken["grads"].values()), "gradients stayed finite without the re-gather"
    sub.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("dp,S,m", [(4, 2, 2), (4, 1, 1), (3, 1, 2)])
def test_hybrid_matches_single_process(twin, stage, dp, S, m):
    """Shard groups of S, replicated over dp/S: the reduce-scatter inside the group, the
    shard's all-reduce across the replicas once a step (after the last micro-batch's), the
    all-gathers inside the group. dp 3 with S 1: three replicas, doubling's fix-up step."""
    sub = split(dp)
    if sub.Get_size() != dp:
        sub.Free()
        return
    out = run(flags("--micro-batches", str(m)), sub, stage, S=S)
    z = out["zero"][0]
    assert (z.N, z.R) == (S, dp // S) and all(u.replicas.size == dp // S for u in z.units)
    assert_twin(out, twin[m], f"hybrid zero={stage} dp={dp} S={S} micro-batches={m}")
    sub.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_clipping_counts_each_shard_once(stage):
    """Each shard lives on R ranks: the clipping norm counts it on the first replica only."""
    sub = split(4)
    out = run(flags("--grad-clip", "0.05"), sub, stage, S=2)
    ref = run(flags("--grad-clip", "0.05"))
    assert_twin(out, ref, f"hybrid zero={stage} S=2 clipped")
    sub.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("S,m", [(2, 2), (1, 2)])
def test_hybrid_memory_and_bytes_equal_the_formulas(stage, S, m):
    """A rank holds formula(N = S) to the byte; it sends per step (the ledger) what
    sync.traffic_split says, call by call from comm.sent, which is the closed form
    formulas.traffic_theory(R) when the replicas' all-reduce is the bandwidth one or R = 2
    (doubling's log2(R) = 2(R-1)/R there)."""
    sub = split(4)
    out = run(flags("--micro-batches", str(m)), sub, stage, S=S)
    (z, opt), R = out["zero"], 4 // S
    mem = opt.memory_report()
    f = mem["formula"]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (f["params"], f["grads"], f["optimizer"]), mem
    s, P_pad = 8, z.P_pad
    expect = {1: (s * P_pad, s * P_pad, 16 * P_pad // S), 2: (s * P_pad, s * P_pad // S, 16 * P_pad // S),
              3: (s * P_pad // S, s * P_pad // S, 16 * P_pad // S)}[stage]
    assert (f["params"], f["grads"], f["optimizer"]) == expect and P_pad % 4 == 0
    for row in out["rows"]:
        assert row["zero_bytes"] == z.traffic_theory(m) > 0, (row, S)
    closed = formulas.traffic_theory(stage, P_pad, S, s, m, R)
    assert (z.traffic_theory(m) == closed) == (R == 2), (z.traffic_theory(m), closed)
    sub.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("K,reshard,mode", [(0, True, "none"), (1, True, "none"), (5, True, "full"),
                                             (1, False, "none"), (2, False, "full"), (0, False, "full")])
def test_prefetch_and_reshard_match_and_meet_their_formulas(twin, K, reshard, mode):
    """Stage 3 with the next K blocks' gathers started ahead (K = 5 > the 2 blocks), releasing
    after forward or not, with and without --recompute full: the twin; the bytes (reshard
    off: no all-gather in backward); the gathered peak equal to formulas.gathered_peak."""
    sub = split(4)
    m = 2
    out = run(flags("--micro-batches", str(m), "--recompute", mode), sub, 3, prefetch=K,
              reshard_after_forward=reshard)
    assert_twin(out, twin[m], f"zero=3 prefetch={K} reshard={reshard} recompute={mode}")
    z = out["zero"][0]
    assert z.gathered_bytes == 0, "a gathered buffer outlived the step"
    n = 8 * z.P_pad
    for row in out["rows"]:
        assert row["zero_bytes"] == z.traffic_theory(m) == (3 if reshard else 2) * m * 3 / 4 * n
    g = z.model.parts.gathers
    size = [8 * sum(u.n_pad for u in g.blocks[i]) for i in g.order]
    outer = 8 * sum(u.n_pad for u in g.outer)
    expect = outer + (sum(size) if not reshard else sum(sorted(size)[-min(K + 1, len(size)):]))
    assert z.gathered_peak == z.gathered_formula() == expect, (z.gathered_peak, expect)
    sub.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("K", [1, 2])
def test_prefetch_starts_the_next_gathers_before_the_block_computes(monkeypatch, K):
    """The order of events on a rank: with prefetch K, the all-gathers of blocks i+1..i+K are
    started before block i's forward runs (so they travel while it computes), and in backward
    those of blocks i-1..i-K before block i's backward; with K = 0 never."""
    events = []
    start, regather = stage3.Stage3.start, stage3.Regather.forward

    def spy_start(self, u, again=False):
        if not u.live:
            events.append(("start", self.model.family.block_of(u.names[0]), again))
        return start(self, u, again)

    def spy_forward(self, x, gathers, key, keep=False):
        events.append(("computed", key, False))
        return regather(self, x, gathers, key, keep)
    monkeypatch.setattr(stage3.Stage3, "start", spy_start)
    monkeypatch.setattr(stage3.Regather, "forward", spy_forward)
    sub = split(4)
    run(flags(), sub, 3, prefetch=K)
    blocks = [e for e in events if e[0] == "start" and e[1] is not None]
    assert blocks, events
    first_forward = events[:events.index(("computed", 0, False))]      # before block 0's output
    assert {e[1] for e in first_forward if e[0] == "start"} >= {0, 1}, first_forward
    backward = [e[1] for e in events if e[0] == "start" and e[2] and e[1] is not None]
    assert backward[:2] == [1, 0], backward                             # the last block first, then ahead
    sub.Free()


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("qwz,hpz,qgz", [(0, True, 0), (64, False, 0), (0, False, 64), (32, True, 256)])
def test_zero_plus_plus_bytes_memory_and_distance(twin, qwz, hpz, qgz):
    """ZeRO++ on one host of 4: hpZ alone computes exactly what plain ZeRO-3 does (the
    secondary shards are the gathered weights); with qwZ or qgZ the losses stay within one
    code step (verify.QUANTIZED_RTOL) of the exact twin and are not equal to it. Bytes: the
    ledger equals traffic_theory (formulas.calls_of through comm.sent), and qwZ's and qgZ's
    messages are wire_bytes: fewer than plain ZeRO-3's. hpZ's secondary shards at the peak:
    every unit's n_pad/k."""
    from minipar.parallel.zero import quantize, zpp
    from minipar.train.verify import QUANTIZED_RTOL
    sub = split(4)
    m = 2
    out = run(flags("--micro-batches", str(m)), sub, 3, wire=zpp.Wire(qwz, hpz, qgz))
    z = out["zero"][0]
    if qwz or qgz:
        rel = np.abs(np.array(out["losses"]) - twin[m]["losses"]) / np.abs(twin[m]["losses"])
        assert 0 < rel.max() <= QUANTIZED_RTOL, rel
    else:
        assert_twin(out, twin[m], "hpZ alone")
    n, S = 8 * z.P_pad, 4
    plain = 3 * m * (S - 1) / S * n
    for row in out["rows"]:
        assert row["zero_bytes"] == z.traffic_theory(m)
    shards = [u.shard_size for u in z.units]
    flat = m * (S - 1) / S * n                                  # one plain all-gather or reduce-scatter a micro-batch
    forward = m * (S - 1) * sum(quantize.wire_bytes(s, qwz) for s in shards) if qwz else flat
    backward = flat if hpz else forward                         # hpZ: the secondary shards, not coded
    reduce = m * (S - 1) * sum(quantize.wire_bytes(s, qgz) for s in shards) if qgz else flat
    expect = forward + backward + reduce
    assert z.traffic_theory(m) == expect and (expect < plain) == bool(qwz or qgz)
    assert z.secondary_peak == z.secondary_formula() == (n // S if hpz else 0)
    sub.Free()
