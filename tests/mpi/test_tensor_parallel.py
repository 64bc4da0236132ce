"""Tensor parallelism against its single-process twin, in float64 (run under mpirun -n 4).

Every rank also runs the single-process GPT itself (tiny model, no messages) on the same
weights and batches, and compares its own shard: the loss, the gradients re-sharded with
model.shard(name, ref_grad), the global gradient norm, and the parameters after 3 AdamW
steps with global-norm clipping active. tp = 3 pads V = 256 to 258 (the last rank holds 2
padded rows). With the `groups` fixture, a world of 4 cut into blocks of 3 leaves rank 3
alone: it runs tp = 1 in that test (still a valid twin).
"""
import canonical
import numpy as np
import pytest
from mpi4py import MPI

from minipar import comm
from minipar.train import data, trainer as train
from minipar.model.gpt import GPT, GPTConfig
from minipar.optim.adamw import AdamW, clip_grad_norm
from minipar.parallel import data_parallel
from minipar.parallel.tensor import tensor_parallel as tpar
from minipar.parallel.grid import ProcessGrid
from minipar.parallel.layout import Layout
from minipar.parallel.tensor.tensor_parallel import TensorParallelGPT

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
V, T, L, H, C = 256, 16, 2, 12, 48            # 12 heads: divisible by tp = 2, 3 and 4
B, t = 4, 12                                  # global batch; t < T exercises wpe[0:t]
STEPS, LR, WD, CLIP = 3, 1e-2, 0.1, 0.5       # CLIP is below the norm: clipping is active
# Parameters after AdamW get --verify's float64 tolerance, not 1e-12: Adam's step
# lr * m / (sqrt(v) + eps) ignores the gradient's scale, so an entry whose gradient is near
# 0 (the key third of c_attn.bias is exactly 0 in exact arithmetic) turns rounding noise of
# 1e-17 into moves up to lr * 1e-17 / eps ~ 1e-11. Measured: the single-process model
# against itself with 4 micro-batches instead of 1 (the same maths summed in another order)
# differs by 7e-12 after 3 steps of test_dp2_tp2_in_train_steps. Losses, logits and
# gradients, where tensor parallelism's maths shows, are held to 1e-12.
PARAM_TOL = 1e-10


def config(tied=True, **kw):
    return GPTConfig(**{**dict(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C,
                               tie_embeddings=tied), **kw})


def batch(step):
    """(x, y) of the global batch of `step`, (B, t) each; ids from the whole vocabulary, the
    last id included, so every vocabulary shard (and the one next to the padding) is hit."""
    rng = np.random.default_rng([7, step])
    x, y = rng.integers(0, V, size=(2, B, t))
    x[0, 0], y[0, -1] = V - 1, V - 1
    return x, y


def gather_logits(model, logits):
    """Vocab-sharded (B, t, Vp/tp) on each tp rank -> the full (B, t, V) logits."""
    shards = comm.all_gather(model.group, np.ascontiguousarray(logits))
    shards = shards.reshape(model.tp_size, *logits.shape)
    return np.concatenate(list(shards), axis=-1)[..., :V]


_CACHE = {}
WORST = {}          # largest differences seen, by what was compared (printed by the last test)


def note(what, value):
    WORST[what] = max(WORST.get(what, 0.0), float(value))


def run_single(tied):
    """The twin: 3 steps on one process. -> dict of per-step losses, grads, norms; params."""
    key = ("single", tied)
    if key not in _CACHE:
        model = GPT(config(tied), seed=0, dtype=np.float64)
        opt = AdamW(model.parameters(), lr=LR, weight_decay=WD)
        out = {"logits": model(batch(0)[0]).data, "loss": [], "grads": [], "norm_sq": []}
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(step)
            loss = model(x, y, loss_denom=B * t)
            loss.backward()
            out["loss"].append(loss.item())
            out["grads"].append({n: p.grad.copy() for n, p in model.named_parameters()})
            out["norm_sq"].append(sum(float((p.grad ** 2).sum()) for p in model.parameters()))
            clip_grad_norm(model.parameters(), CLIP)
            opt.step()
        out["state"] = model.state_dict()
        _CACHE[key] = out
    return _CACHE[key]


def run_tp(tied, tp_group, dp_group=None, rows=(0, B), micro=1):
    """The same 3 steps with tensor parallelism (and data parallelism if dp_group), as
    train.train_steps does them, but clipping with the tp-global norm."""
    model = TensorParallelGPT(config(tied), tp_group, seed=0, dtype=np.float64)
    ddp = data_parallel.make(model.parameters(), dp_group, "bucketed", 0.02) if dp_group else None
    opt = AdamW(model.parameters(), lr=LR, weight_decay=WD)
    local = model(batch(0)[0][rows[0]:rows[1]]).data                  # (b, t, Vp/tp), before training
    out = {"model": model, "logits": gather_logits(model, local), "logits_local": local,
           "loss": [], "grads": [], "norm_sq": [], "rep_spread": []}
    lo, hi = rows
    mb = (hi - lo) // micro
    for step in range(STEPS):
        if ddp is None:
            model.zero_grad()
        else:
            ddp.zero_grad()
            ddp.start_step()
        loss_local = 0.0
        for k in range(micro):
            if ddp is not None:
                ddp.sync_now(k == micro - 1)
            x, y = batch(step)
            rows_k = slice(lo + k * mb, lo + (k + 1) * mb)
            loss = model(x[rows_k], y[rows_k], loss_denom=B * t)
            loss.backward()
            loss_local += loss.item()
        if ddp is not None:
            ddp.finish()
            loss_local = float(comm.all_reduce(dp_group, np.array([loss_local]))[0])
        out["loss"].append(loss_local)
        out["grads"].append({n: p.grad.copy() for n, p in model.named_parameters()})
        out["norm_sq"].append(model.grad_norm_sq())
        # replicated gradients on every tp rank: gather them and take the largest spread
        rep = np.concatenate([p.grad.ravel() for n, p in model.named_parameters()
                              if model.is_replicated(n)])
        every = comm.all_gather(tp_group, rep).reshape(model.tp_size, -1)
        out["rep_spread"].append(float(np.abs(every - every[0]).max()))
        norm = tpar.clip_grad_norm(model, CLIP)
        assert norm > CLIP, f"clipping should be active (norm {norm})"
        opt.step()
    out["local_state"] = {n: p.data.copy() for n, p in model.named_parameters()}
    out["state"] = model.state_dict()
    if ddp is not None:
        data_parallel.check_replicas(model.parameters(), dp_group)
    return out


def cached_tp(tp, tied, groups):
    key = ("tp", tp, tied)
    if key not in _CACHE:
        _CACHE[key] = run_tp(tied, groups[tp])
    return _CACHE[key]


def check(kind, actual, desired, tol, msg):
    """max |actual - desired| / max |desired| <= tol: the measure of --verify (and of the
    DP tests' gradients), so entries near zero are judged on the tensor's scale."""
    actual, desired = np.asarray(actual), np.asarray(desired)
    d = float(np.abs(actual - desired).max() / max(np.abs(desired).max(), 1e-300)) if desired.size else 0.0
    note(kind, d)
    assert d <= tol, f"{msg}: max|diff|/max|ref| = {d:.3e} > {tol:g} (rank {RANK})"


def assert_matches(out, ref, what, rows=(0, B)):
    model = out["model"]
    check("logits", out["logits"], ref["logits"][rows[0]:rows[1]], 1e-12, f"logits {what}")
    for step in range(STEPS):
        check("loss", out["loss"][step], ref["loss"][step], 1e-12, f"loss step {step} {what}")
        check("grad_norm_sq", out["norm_sq"][step], ref["norm_sq"][step], 1e-12,
              f"grad_norm_sq step {step} {what}")
        for n, rg in ref["grads"][step].items():
            check("grads", out["grads"][step][n], model.shard(n, rg), 1e-12, f"grad {n} step {step} {what}")
    for n, rp in ref["state"].items():
        check("params", out["local_state"][n], model.shard(n, rp), PARAM_TOL,
              f"param {n} after {STEPS} steps {what}")
        check("state_dict", out["state"][n], rp, PARAM_TOL, f"state_dict {n} after {STEPS} steps {what}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_tp_matches_single_process(groups, tp, tied):
    out = cached_tp(tp, tied, groups)
    model = out["model"]
    assert_matches(out, run_single(tied), f"tp={model.tp_size} tied={tied}")
    assert model.vocab_padded == -(-V // model.tp_size) * model.tp_size
    if model.vocab_valid < model.vocab_per_rank:               # the rank holding the padding
        heads = ["wte.weight"] + ([] if tied else ["lm_head.weight"])
        for n in heads:
            assert not out["local_state"][n][model.vocab_valid:].any(), f"{n} padding rows moved"
            assert all(not g[n][model.vocab_valid:].any() for g in out["grads"]), f"{n} padding got gradient"
        assert np.isneginf(out["logits_local"][..., model.vocab_valid:]).all(), "padded logits are not -inf"


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_replicated_grads_identical_across_tp(groups, tp, tied):
    """wpe, LayerNorms and row-parallel biases: bit-identical gradients on every tp rank
    (f and g in the right places make it so); the loss and grad_norm_sq too. (That
    grad_norm_sq counts them once is checked against the twin's sum of squares above.)"""
    out = cached_tp(tp, tied, groups)
    assert max(out["rep_spread"]) == 0.0, f"replicated grads differ across tp: {out['rep_spread']} rank={RANK}"
    for what in ("loss", "norm_sq"):
        every = comm.all_gather(groups[tp], np.array(out[what])).reshape(groups[tp].size, -1)
        assert (every == every[0]).all(), f"{what} differs across tp ranks: {every}"


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_dp2_tp2_matches_single_process(tied):
    """dp2 x tp2 on 4 ranks, two micro-batches per dp rank, bucketed data parallelism
    wrapped around the tensor-parallel model's shards."""
    grid = ProcessGrid(WORLD, Layout(dp=2, tp=2))
    rows = (grid.dp_rank * B // 2, (grid.dp_rank + 1) * B // 2)
    out = run_tp(tied, grid.tp_group, grid.dp_group, rows, micro=2)
    assert_matches(out, run_single(tied), f"dp=2 tp=2 tied={tied}", rows)
    assert max(out["rep_spread"]) == 0.0, out["rep_spread"]


@pytest.mark.mpi(min_size=4)
def test_dp2_tp2_in_train_steps():
    """The TP model drops into train.train_steps unchanged when clipping is off (its
    clip_grad_norm would see local shards only): losses and parameters equal the twin."""
    args = train.build_parser().parse_args(
        ["--batch-size", "4", "--steps", "3", "--warmup", "1", "--lr", "1e-2", "--grad-clip", "0",
         "--dtype", "float64", "--micro-batches", "2", "--block-size", str(T)])
    cfg = config(True)
    tokens = data.load_tokens(None, T)
    grid = ProcessGrid(WORLD, Layout(dp=2, tp=2))
    model = TensorParallelGPT(cfg, grid.tp_group)
    ddp = data_parallel.make(model.parameters(), grid.dp_group, "bucketed", 0.02)
    rows = (grid.dp_rank * 2, grid.dp_rank * 2 + 2)
    s = train.Session(args, model, train.build_optimizer(model, args), data.Sampler(tokens, T, 4, 0),
                      sync=ddp, rows=rows, dp_group=grid.dp_group)
    losses = [r["loss"] for r in train.train_steps(s, 0, 3)]
    twin = GPT(cfg)
    s = train.Session(args, twin, train.build_optimizer(twin, args), data.Sampler(tokens, T, 4, 0), rows=(0, 4))
    ref = [r["loss"] for r in train.train_steps(s, 0, 3)]
    check("loss", losses, ref, 1e-12, "train_steps losses")
    state = model.state_dict()
    for n, rp in twin.state_dict().items():
        check("train_steps params", state[n], rp, PARAM_TOL, f"train_steps param {n}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_ledger(groups, tp, monkeypatch):
    """One forward + backward: the all-reduces, in order, with their sizes. Per layer 2 of
    B*t*C forward (g after attention and MLP) and 2 backward (f before them), plus the
    embedding's g, the LM head's f, and the loss's max / target / sum-exp of B*t."""
    model = TensorParallelGPT(config(), groups[tp])
    x, y = batch(0)
    calls = []
    real = comm.all_reduce

    def spy(g, a, op="sum", **kw):
        calls.append((a.shape, op))
        return real(g, a, op=op, **kw)

    monkeypatch.setattr(comm, "all_reduce", spy)
    comm.reset_traffic()
    tpar.reset_traffic()
    loss = model(x, y, loss_denom=B * t)
    fwd = list(calls)
    loss.backward()
    bwd = calls[len(fwd):]
    act, row = ((B, t, C), "sum"), ((B * t,), "sum")
    assert fwd == [act] + [act, act] * L + [((B * t,), "max"), row, row], fwd
    assert bwd == [act] + [act, act] * L, bwd
    n_calls, elems = 4 * L + 5, (4 * L + 2) * B * t * C + 3 * B * t
    assert B * t * C * 8 <= comm.ALL_REDUCE_DOUBLING_MAX_BYTES      # all by recursive doubling:
    led = comm.traffic()                                           # log2(p) * n bytes sent
    assert set(led) - {"debug_check"} == {"all_reduce"}, led      # (MINIPAR_DEBUG=1 adds its own)
    assert led["all_reduce"]["calls"] == n_calls, led
    assert led["all_reduce"]["bytes_sent"] == int(np.log2(tp)) * 8 * elems, (led, elems)
    mine = tpar.traffic()
    assert {k: v["calls"] for k, v in mine.items()} == {"g": 2 * L + 1, "f": 2 * L + 1, "cross_entropy": 3}, mine
    assert mine["f"]["elements"] == mine["g"]["elements"] == (2 * L + 1) * B * t * C, mine
    assert mine["cross_entropy"]["elements"] == 3 * B * t, mine
    assert sum(v["bytes_sent"] for v in mine.values()) == led["all_reduce"]["bytes_sent"], (mine, led)
    if RANK == 0:
        print(f"\ntp={tp} L={L} B={B} t={t} C={C}: {n_calls} all-reduces, {elems} elements, "
              f"{led['all_reduce']['bytes_sent']} B sent per rank; by kind {mine}")


@pytest.mark.mpi(min_size=4)
def test_n_head_not_divisible_by_tp_raises(groups):
    with pytest.raises(ValueError, match=r"n_head 6 is not divisible by tp 4"):
        TensorParallelGPT(config(n_head=6), groups[4])
    with pytest.raises(ValueError, match=r"n_head 3 is not divisible by tp 2"):
        TensorParallelGPT(config(n_head=3, n_embd=24), groups[2])
    comm.reset_traffic()
    TensorParallelGPT(config(n_head=6), groups[2])          # 6 % 2 == 0: fine, and no message
    assert comm.traffic() == {}


def design_shapes(tied):
    return canonical.design_shapes(V, T, L, C, tied)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_state_dict_is_canonical(groups, tp, tied):
    """Before training: the consolidated state has docs/design.md §2's names and shapes and is the
    single-process model's, bit for bit (same init); load_state_dict keeps only the shard."""
    model = TensorParallelGPT(config(tied), groups[tp])
    twin = GPT(config(tied))
    state = model.state_dict()
    assert {n: a.shape for n, a in state.items()} == design_shapes(tied)
    assert list(state) == [n for n, _ in twin.named_parameters()]
    for n, a in twin.state_dict().items():
        assert np.array_equal(state[n], a), f"{n} tp={model.tp_size} rank={RANK}"
    assert model.num_params() == twin.num_params()
    rng = np.random.default_rng(3)
    new = {n: rng.standard_normal(a.shape) for n, a in state.items()}
    model.load_state_dict(new)
    for n, p in model.named_parameters():
        assert np.array_equal(p.data, model.shard(n, new[n])), n
    back = model.state_dict()
    assert all(np.array_equal(back[n], new[n]) for n in new)
    with pytest.raises(ValueError, match="missing"):
        model.load_state_dict({n: a for n, a in new.items() if n != "ln_f.bias"})
    with pytest.raises(ValueError, match=r"h\.0\.attn\.c_attn\.weight: checkpoint shape"):
        model.load_state_dict({**new, "h.0.attn.c_attn.weight": new["h.0.attn.c_attn.weight"][:, :C]})


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_shards_and_the_qkv_trap(groups, tp):
    """shard/unshard invert each other for every parameter, and a c_attn shard is head group
    r of q, of k and of v ([q_r | k_r | v_r]), not the r-th contiguous block of [q | k | v]."""
    model = TensorParallelGPT(config(False), groups[tp])
    p = model.tp_size
    rng = np.random.default_rng(5)
    for n, shape in model.full_shapes.items():
        full = rng.standard_normal(shape)
        pieces = [model.shard(n, full, r) for r in range(p)]
        assert all(a.shape == model.params[n].shape for a in pieces), n
        assert np.array_equal(model.unshard(n, pieces), full), n
    w = rng.standard_normal((C, 3 * C))
    k = C // p
    for r in range(p):
        want = np.concatenate([w[:, r * k:(r + 1) * k], w[:, C + r * k:C + (r + 1) * k],
                               w[:, 2 * C + r * k:2 * C + (r + 1) * k]], axis=1)
        assert np.array_equal(model.shard("h.0.attn.c_attn.weight", w, r), want)
        if p > 1:
            assert not np.array_equal(want, w[:, r * 3 * k:(r + 1) * 3 * k])


@pytest.mark.mpi(min_size=4)
def test_zz_report_largest_differences():
    """Not a check: the largest differences seen on any rank (pytest -s shows them)."""
    worst = {k: WORLD.allreduce(v, op=MPI.MAX) for k, v in sorted(WORST.items())}
    if RANK == 0:
        print("\nlargest max|diff|/max|ref| vs the single-process twin: "
              + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
