"""The trainer: python -m minipar.train [flags]   (see --help, and docs/design.md §7; the flags
and their validation live in config.py)

The model, AdamW, the step-indexed sampler, gradient accumulation over micro-batches,
checkpoints and a JSONL log, on one process or on a dp x tp x pp grid of MPI ranks
(parallel/). run() = set_up, train_loop, then the summary; what is printed (the start-up
description, progress lines, the summary, --verify's verdict) is report.py's.

Each step:  for each micro-batch: loss = model(x, y, loss_denom=B*T); loss.backward()
            (with --pp: the stage's schedule runs the micro-batches, parallel/pipeline.py)
            grad_norm = clip(grads); lr = schedule(step); AdamW step
Dividing every micro-batch loss by the global token count B*T (not by its own size) makes
the accumulated gradient exactly the gradient of the mean loss over the global batch.
With --precision fp16/bf16 (precision.py): backward starts from the loss scale S instead
of 1; an inf/NaN in any gradient on any rank (a max all-reduce of every rank's flag)
skips the step everywhere; otherwise the gradients are unscaled and clipped in fp32
inside MixedPrecisionAdamW's step.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import numpy as np

from minipar import checkpoint, comm, data, precision, report
from minipar.model import GPT, GPTConfig, param_specs, train_flops_per_token
from minipar.optim import AdamW, clip_coef, grad_norm, lr_at
from minipar.perf import keep_freed_memory, matmul_peak_flops
from minipar.parallel import data_parallel, pipeline, tensor_parallel, zero
from minipar.config import ConfigError, Plan, agree_on_errors, build_parser, prepare, tokens_digest
from minipar.parallel.grid import ProcessGrid
from minipar.tensor import no_grad

def local_state(model, opt, kind: str) -> dict:
    """{canonical name: this rank's (tp slice, pp stage) array} of "params" (the fp32 master
    weights with --precision fp16/bf16), "m" or "v". With ZeRO, gathered from the dp
    group's shards (collective over dp)."""
    names = [n for n, _ in model.named_parameters()]
    mixed = getattr(opt, "mixed", isinstance(opt, precision.MixedPrecisionAdamW))
    if isinstance(opt, zero.Zero):
        return opt.gather_local("master" if kind == "params" and mixed else kind)
    if kind == "params":
        return dict(zip(names, opt.master)) if mixed else {n: p.data for n, p in model.named_parameters()}
    return dict(zip(names, getattr(opt, kind)))


def canonical(model, local: dict) -> dict:
    """{canonical name: full array} from this rank's pieces (collective over tp and pp)."""
    if hasattr(model, "consolidate"):
        return model.consolidate(local)
    return {n: np.array(a, copy=True) for n, a in local.items()}


def canonical_state(model, opt) -> dict:
    """The model as checkpoints and --verify see it: {canonical name: full array}. With
    --precision fp16/bf16 that is the fp32 master weights (the 2-byte parameters are their
    rounding). Collective over tp and pp (and dp with ZeRO), like model.state_dict()."""
    return canonical(model, local_state(model, opt, "params"))


def optimizer_shard(model, opt) -> dict:
    """This rank's Adam state for its checkpoint shard (checkpoint.py): m and v flat, exactly
    as this rank holds them, and `index`: where each element sits in the canonical flat
    vector (every parameter of param_specs, C order, concatenated), -1 for padding. No
    communication.

    The index comes from cutting an index tensor the way the parameters are cut: for each
    local parameter, model.shard (the tp slice; identity for GPT) of the tensor 1..size
    shifted by the parameter's canonical offset, minus 1, so tensor parallelism's zero
    padding of the vocabulary rows comes out as -1; with ZeRO each unit is then flattened
    and padded like the parameters (Unit.flatten, zeros -> -1 again) and cut to this
    rank's [lo, hi)."""
    where, off = {}, 0                                  # {name: (canonical offset, full shape)}
    for name, shape, _ in param_specs(model.cfg):
        where[name], off = (off, shape), off + math.prod(shape)
    cut = getattr(model, "shard", lambda name, full: full)
    index = {}                                          # {name: this rank's slice of 1 + index}
    for name, _ in model.named_parameters():
        start, shape = where[name]
        full = np.arange(start + 1, start + math.prod(shape) + 1, dtype=np.int64).reshape(shape)
        index[name] = np.asarray(cut(name, full))
    if isinstance(opt, zero.Zero):                      # its flat shard of every unit
        parts = [(u.flatten([index[n] for n in u.names])[u.lo:u.hi], u.m, u.v) for u in opt.units]
    else:
        parts = [(index[n].ravel(), m.ravel(), v.ravel())
                 for (n, _), m, v in zip(model.named_parameters(), opt.m, opt.v)]
    return {"step": opt.step_count, "index": np.concatenate([i for i, _, _ in parts]) - 1,
            "m": np.concatenate([m for _, m, _ in parts]), "v": np.concatenate([v for _, _, v in parts])}


def save_checkpoint(path, model, opt, cfg: GPTConfig, args, next_step: int, tokens, grid=None):
    """Called on every rank. model.npz: the canonical model, consolidated on rank 0
    (collective: tp all-gathers, pp sends to stage 0, ZeRO all-gathers over dp). The
    optimizer: each rank writes the shard it holds (optimizer_shard), with ZeRO every rank,
    without it dp rank 0 of each (tp, pp) position (its dp replicas hold the same). Then
    checkpoint.save agrees that every write succeeded before rank 0 commits."""
    state = canonical_state(model, opt)
    rank = grid.rank if grid is not None else 0
    writes = isinstance(opt, zero.Zero) or grid is None or grid.dp_rank == 0
    shard = optimizer_shard(model, opt) if writes else None
    meta = None
    if rank == 0:
        state = {n: state[n] for n, _, _ in param_specs(cfg)}          # canonical order
        scaler = getattr(opt, "scaler", None)
        meta = {"config": cfg.to_dict(), "step": next_step, "dtype": args.dtype, "precision": args.precision,
                **({"loss_scaler": scaler.state_dict()} if scaler is not None else {}),
                "layout": {"dp": grid.dp_size if grid else 1, "tp": grid.tp_size if grid else 1,
                           "pp": grid.pp_size if grid else 1, "zero": getattr(args, "zero", 0)},
                "data": {"source": args.data or data.BUILTIN_NAME, "tokens": int(len(tokens)),
                         "sha256_16": tokens_digest(tokens), "position": next_step},
                "seed": args.seed, "batch_size": args.batch_size}
    checkpoint.save(path, state if rank == 0 else None, shard, meta, grid.world if grid is not None else None)


def restore(model, opt: AdamW, state, ostate, path):
    try:
        model.load_state_dict(state)
    except ValueError as e:
        raise ConfigError(f"checkpoint {path}/model.npz does not match the model: {e}") from None
    names = [n for n, _ in model.named_parameters()]
    missing = [n for n in names if n not in ostate["m"] or n not in ostate["v"]]
    if missing:
        raise ConfigError(f"checkpoint {path}: the optimizer state lacks {missing[:3]}")
    shard = getattr(model, "shard", lambda name, full: full)   # this rank's slice (tensor parallel)
    opt.step_count = ostate["step"]
    for n, m, v in zip(names, opt.m, opt.v):
        m[...], v[...] = shard(n, ostate["m"][n]), shard(n, ostate["v"][n])
    if isinstance(opt, precision.MixedPrecisionAdamW):         # model.npz holds the fp32 master weights
        opt.load_master([shard(n, state[n]) for n in names])


class Printer:
    """Progress and summary on stdout (rank 0 only, once there are ranks)."""

    def __init__(self, enabled=True):
        self.enabled = enabled

    def __call__(self, *a, **k):
        if self.enabled:
            print(*a, **k, flush=True)


def build_optimizer(model: GPT, args) -> AdamW:
    """AdamW; with --precision fp16/bf16 MixedPrecisionAdamW, which takes the model's
    float32 weights as its master weights and leaves the model their 2-byte rounding."""
    mode = getattr(args, "precision", "fp32")
    if mode == "fp32":
        return AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    dtype = precision.storage_dtype(mode)
    opt = precision.MixedPrecisionAdamW(model.parameters(), dtype, lr=args.lr, weight_decay=args.weight_decay,
                                        scaler=precision.make_scaler(mode, getattr(args, "loss_scale", None)))
    model.dtype = dtype
    if isinstance(model, pipeline.PipelineStage):
        model.inner.dtype = dtype
    return opt


def init_model(plan: Plan, args, tp_group=None, grid=None):
    """The model for this rank: GPT, or its tensor-parallel shards when tp_group has > 1 rank;
    with a grid of pp > 1, only this rank's pipeline stage of it."""
    if tp_group is not None and tp_group.size > 1:
        model = tensor_parallel.TensorParallelGPT(plan.cfg, tp_group, seed=args.seed, dtype=plan.dtype)
    else:
        model = GPT(plan.cfg, seed=args.seed, dtype=plan.dtype)
    if grid is not None and grid.pp_size > 1:
        model = pipeline.PipelineStage(model, grid.pp_rank, grid.pp_size, grid.pp_group)
    opt = build_optimizer(model, args)
    if plan.meta is not None:
        restore(model, opt, plan.state, plan.ostate, args.resume)
        if "loss_scaler" in plan.meta:                   # the scale and its clean-step count go on
            opt.scaler.load_state_dict(plan.meta["loss_scaler"])
    return model, opt


def train_steps(model: GPT, opt: AdamW, sampler, args, start: int, stop: int, rows, dp=None, group=None,
                pipe=None, world=None):
    """The training loop, one step per yield: {step, loss, lr, grad_norm, ...}.

    rows = (lo, hi): this rank's rows of the global batch, cut into --micro-batches.
    Each micro-batch loss is divided by the global token count, so the gradients summed
    over micro-batches (autograd's +=) and over dp ranks (dp.finish) are those of the mean
    loss over the global batch. dp=None is the single-process twin. pipe: a
    pipeline.PipelineEngine that runs the micro-batches through the stages instead (and
    calls dp.finish itself, after its schedule).

    Mixed precision (opt is a precision.MixedPrecisionAdamW): backward is seeded with the
    loss scale S; the global norm of the scaled gradients is measured (not clipped); an
    inf/NaN in any gradient on any rank of `world` (a max all-reduce of each rank's flag;
    None: this process alone) skips the step on all of them; otherwise opt.step unscales
    and clips in fp32 with one factor, clip_coef / S."""
    for step in range(start, stop):
        with quiet_overflow(getattr(opt, "scaler", None) is not None):
            row = train_step(model, opt, sampler, args, step, rows, dp, group, pipe, world)
        yield row                                # outside the errstate: the caller runs here


def quiet_overflow(on: bool):
    """fp16 gradients overflow to inf by design when the loss scale is too large (then the
    step is skipped): no RuntimeWarning for that, as in PyTorch."""
    return np.errstate(over="ignore", invalid="ignore") if on else contextlib.nullcontext()


def train_step(model, opt, sampler, args, step: int, rows, dp=None, group=None, pipe=None, world=None) -> dict:
    """One step of train_steps: -> its log row."""
    B, T, M = args.batch_size, model.cfg.block_size, args.micro_batches
    lo, hi = rows
    mb = (hi - lo) // M
    scaler = getattr(opt, "scaler", None)
    t0 = time.perf_counter()
    sent0, tp0, pp0, z0 = comm_sent(), tp_sent(), pp_sent(), zero_sent()
    lr = lr_at(step, args.lr, args.lr_schedule, args.warmup, args.steps, args.min_lr)
    opt.lr = lr
    if dp is None:
        opt.zero_grad()
    else:
        dp.zero_grad()
        dp.start_step()
    loss_local = 0.0
    scale = scaler.scale if scaler is not None else 1.0
    if pipe is not None:                                 # the stage's schedule, then dp's sync
        batches = [sampler.batch(step, lo + k * mb, lo + (k + 1) * mb) for k in range(M)]
        loss_local = pipe.train_step(batches, B * T, dp, loss_scale=scale)
    else:
        for k in range(M):
            if dp is not None:
                dp.sync_now(k == M - 1)                  # only the last micro-batch talks
            x, y = sampler.batch(step, lo + k * mb, lo + (k + 1) * mb)      # (B/(dp*M), T)
            loss = model(x, y, loss_denom=B * T)
            loss.backward(precision.backward_seed(scale))   # None (i.e. 1) unless scaling
            loss_local += loss.item()
        if dp is not None:
            dp.finish()
    pp_bytes = pp_sent() - pp0
    grad_bytes = (comm_sent() - sent0) - (tp_sent() - tp0) - pp_bytes   # dp's share of what was sent
    loss_sum = loss_local if group is None else float(comm.all_reduce(group, np.array([loss_local]))[0])
    skipped = False
    norm = global_grad_norm(model, opt, dp) / scale     # of the unscaled gradients; grads are the
    if scaler is not None:                          # same on every dp rank
        skipped = opt.local_found_inf() if isinstance(opt, zero.Zero) else \
            precision.local_found_inf(model.parameters())
        if world is not None and world.size > 1:    # any rank's overflow skips the step everywhere
            skipped = bool(comm.all_reduce(world, np.array([skipped], dtype=np.int64), op="max")[0])
    if not skipped:                                 # clip (and unscale) inside AdamW's passes:
        opt.step(grad_scale=clip_coef(norm, args.grad_clip) / scale)   # the grads stay as they are
    if scaler is not None:
        scaler.update(skipped)                      # a skipped step: nothing in opt has changed
    dt = time.perf_counter() - t0
    return {"step": step, "loss": loss_sum, "lr": lr, "grad_norm": norm, "tokens_per_s": B * T / dt,
            "comm_bytes": comm_sent() - sent0, "grad_sync_bytes": grad_bytes, "tp_bytes": tp_sent() - tp0,
            "pp_bytes": pp_bytes, "zero_bytes": zero_sent() - z0,
            "exposed_comm_s": 0.0 if dp is None else dp.exposed_seconds, "step_time": dt,
            "loss_scale": scale, "skipped": skipped}


def comm_sent() -> int:
    return sum(v["bytes_sent"] for v in comm.traffic().values())


def tp_sent() -> int:
    return sum(v["bytes_sent"] for v in tensor_parallel.traffic().values())


def zero_sent() -> int:
    """Bytes of ZeRO's collectives: during a step only it reduce-scatters and all-gathers."""
    t = comm.traffic()
    return sum(t.get(op, {}).get("bytes_sent", 0) for op in ("reduce_scatter", "all_gather"))


def pp_sent() -> int:
    """Bytes of the pipeline's messages: only it sends point-to-point ("send": activations,
    gradients, the tied wte gradient) and broadcasts (the step's loss) during a step."""
    t = comm.traffic()
    return sum(t.get(op, {}).get("bytes_sent", 0) for op in ("send", "broadcast"))


def global_grad_norm(model, opt, dp=None) -> float:
    """The global L2 norm of the gradients that clipping uses: a tensor-parallel model counts
    each parameter once across tp, ZeRO each gradient shard once across dp, bucketed data
    parallelism each bucket piece once across dp (every dp rank holds the same sums)."""
    if isinstance(opt, zero.Zero):
        return math.sqrt(opt.grad_norm_sq())
    if hasattr(dp, "grad_norm_sq"):
        return math.sqrt(dp.grad_norm_sq(model))
    if hasattr(model, "grad_norm_sq"):
        return math.sqrt(model.grad_norm_sq())
    return grad_norm([p.grad for p in model.parameters()])


def run_twin(plan: Plan, args, start: int, stop: int):
    """--verify: the same steps on one process, from the same weights and data (and the
    same --precision: the fp32 master weights are compared). -> (losses, gradient norms
    before clipping, the final canonical state)."""
    model, opt = init_model(plan, args)
    sampler = data.Sampler(plan.tokens, plan.cfg.block_size, args.batch_size, args.seed)
    rows = list(train_steps(model, opt, sampler, args, start, stop, (0, args.batch_size)))
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows], canonical_state(model, opt)


def open_rank0_outputs(args):
    """The files only rank 0 writes, opened (--log) or checked (--timeline) before the ranks
    agree on the configuration: a path rank 0 cannot write then stops every rank at once with
    exit code 2, where a failure later, on rank 0 alone, would leave the others waiting.
    -> the open --log file, or None."""
    if args.timeline:
        parent = os.path.dirname(os.path.abspath(args.timeline))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK) or os.path.isdir(args.timeline):
            why = "is a directory" if os.path.isdir(args.timeline) else \
                f"directory {parent} {'is not writable' if os.path.isdir(parent) else 'does not exist'}"
            raise ConfigError(f"--timeline {args.timeline}: {why}")
    if not args.log:
        return None
    try:
        return open(args.log, "w", buffering=1)     # line-buffered: each step's row is on disk at once
    except OSError as e:
        raise ConfigError(f"--log {args.log}: {e.strerror}") from None


@dataclass
class Session:
    """What every phase of a run reads: the flags, the plan, the grid and what this rank
    built on it (report.py reads it too)."""
    args: object
    plan: Plan
    grid: ProcessGrid
    model: object
    opt: object                    # AdamW, MixedPrecisionAdamW, or zero.Zero
    ddp: object                    # data_parallel.DataParallel*, zero.Zero (the same as opt), or None
    pipe: object                   # pipeline.PipelineEngine or None
    say: Printer
    logf: object                   # the --log file on rank 0, else None
    peak: float                    # the ranks' aggregate matmul peak, FLOP/s
    flops_step: float              # model FLOPs of one training step

    cfg = property(lambda self: self.plan.cfg)
    world = property(lambda self: self.grid.world.size)
    rank = property(lambda self: self.grid.rank)

    @property
    def rows(self):
        """This dp rank's rows of the global batch."""
        B, dp, r = self.args.batch_size, self.grid.dp_size, self.grid.dp_rank
        return r * B // dp, (r + 1) * B // dp


def set_up(args) -> Session:
    """Validate on every rank, agree, then build the grid, the model of this rank, its
    optimizer and the data-parallel / ZeRO / pipeline machinery."""
    from mpi4py import MPI                                   # noqa: PLC0415 - keep import light
    world_comm = MPI.COMM_WORLD
    world, rank = world_comm.Get_size(), world_comm.Get_rank()
    if world > 1:                  # from here on an exception on any rank ends the whole job
        comm.abort_on_error()
    err, plan, logf = None, None, None
    try:
        plan = prepare(args, world)
        if rank == 0:
            logf = open_rank0_outputs(args)
    except ConfigError as e:
        err = e
    if world == 1:
        if err is not None:
            raise err
    else:
        if err is not None:
            err.agreed = True      # main(): every rank learns of it below and exits 2
        agree_on_errors(world_comm, err)
    grid = ProcessGrid(world_comm, plan.dp, plan.tp, plan.pp)
    model, opt = init_model(plan, args, grid.tp_group, grid)
    if args.zero:                  # one object: the dp synchroniser and the sharded optimizer
        opt = ddp = zero.Zero(model, opt, grid.dp_group, args.zero)
    elif grid.dp_size > 1:
        ddp = data_parallel.make(model.parameters(), grid.dp_group, args.dp_mode, args.bucket_mb)
    else:
        ddp = None
    pipe = pipeline.PipelineEngine(model, args.schedule, args.micro_batches) if grid.pp_size > 1 else None
    T = plan.cfg.block_size
    return Session(args, plan, grid, model, opt, ddp, pipe, Printer(rank == 0), logf,
                   peak=matmul_peak_flops(plan.dtype, seconds=0.1) * world,   # aggregate peak of all ranks
                   flops_step=train_flops_per_token(plan.cfg, T) * args.batch_size * T)


def train_loop(s: Session) -> list[dict]:
    """The steps from the plan's start to --steps: a progress line every --log-every steps,
    a log row per step, a checkpoint every --save-every. -> the rows."""
    a, start = s.args, s.plan.start
    sampler = data.Sampler(s.plan.tokens, s.cfg.block_size, a.batch_size, a.seed)
    log_every = a.log_every or max(1, (a.steps - start) // 20)
    group = s.grid.dp_group if s.grid.dp_size > 1 else None
    rows_log = []
    for row in train_steps(s.model, s.opt, sampler, a, start, a.steps, s.rows, s.ddp, group, s.pipe, s.grid.world):
        step = row["step"]
        row["mfu"] = s.flops_step / row["step_time"] / s.peak
        rows_log.append(row)
        if s.logf:
            s.logf.write(json.dumps(report.json_safe(row)) + "\n")
        if (step - start) % log_every == 0 or step == a.steps - 1 or row["skipped"]:
            s.say(report.progress_line(s, row))
        if a.save and a.save_every and (step + 1) % a.save_every == 0 and step + 1 < a.steps:
            save_checkpoint(a.save, s.model, s.opt, s.cfg, a, step + 1, s.plan.tokens, s.grid)
    return rows_log


def validation_loss(s: Session) -> float:
    """The mean loss of 4 batches of the held-out split (collective with --pp: every stage)."""
    val = data.Sampler(s.plan.tokens, s.cfg.block_size, s.args.batch_size, s.args.seed, split="val")
    evaluate = getattr(s.model, "evaluate", lambda x, y: s.model(x, y).item())
    with no_grad():
        return float(np.mean([evaluate(*val.batch(i)) for i in range(4)]))


def draw_timeline(s: Session, summary: dict):
    """--timeline FILE.svg: the last step's pipeline timeline (rank 0)."""
    pl = summary["pipeline"]
    a, pp = s.args, s.grid.pp_size
    with open(a.timeline, "w") as f:
        f.write(pipeline.timeline_svg(pl["last_step_timeline"], pp,
                                      f"{a.schedule} p={pp} m={a.micro_batches}: bubble {pl['bubble_measured']:.3f} "
                                      f"(theory {pl['bubble_theory']:.3f})"))
    s.say(f"  timeline drawn in {a.timeline}")


def verify(s: Session, rows_log, summary: dict):
    """--verify: rank 0 re-runs the steps on one process and compares (report.verdict)."""
    state = canonical_state(s.model, s.opt)                 # collective over tp, pp (and dp with ZeRO)
    if s.rank != 0:
        return
    s.say(f"verify: re-running steps {s.plan.start}..{s.args.steps - 1} on one process ...")
    ref_losses, ref_norms, ref_state = run_twin(s.plan, s.args, s.plan.start, s.args.steps)
    summary["verify"], line = report.verdict(s, rows_log, ref_losses, ref_norms, state, ref_state)
    s.say(line)


def sample(s: Session):
    """--sample N: N bytes generated on rank 0 from the consolidated model."""
    a, model = s.args, s.model
    if a.sample <= 0:
        return
    if s.grid.tp_size > 1 or s.grid.pp_size > 1 or a.zero == 3:
        full = canonical_state(model, s.opt)                # collective over tp, pp, dp; whole on rank 0
        if s.rank == 0:
            model = GPT(s.cfg, seed=a.seed, dtype=s.plan.dtype)
            model.load_state_dict(full)
    if s.rank == 0:
        out = model.generate(data.encode("The pipeline")[None].astype(np.int64), a.sample,
                             rng=np.random.default_rng(a.seed))
        s.say("sample:\n  " + data.decode(out[0]).replace("\n", "\n  "))


def run(args) -> dict:
    """python -m minipar.train: set up, describe, train, summarise, verify, sample."""
    s = set_up(args)
    for line in report.describe(s):
        s.say(line)
    t0 = time.perf_counter()
    rows_log = train_loop(s)
    elapsed = time.perf_counter() - t0
    tp_ledger = tensor_parallel.traffic()                   # the training steps' only (not validation)
    replicated = s.grid.dp_size > 1 and args.zero != 3      # stage 3: every dp rank holds other shards
    digest = data_parallel.check_replicas(s.model.parameters(), s.grid.dp_group) if replicated else None
    if args.save:
        save_checkpoint(args.save, s.model, s.opt, s.cfg, args, args.steps, s.plan.tokens, s.grid)
    val_loss = validation_loss(s)
    stages = s.pipe.gather_stats() if s.pipe is not None else None   # collective over pp
    losses = [r["loss"] for r in rows_log]
    summary, lines = report.summarize(s, rows_log, losses, elapsed, val_loss, digest, stages, tp_ledger)
    for line in lines:
        s.say(line)
    if args.timeline and s.rank == 0:
        draw_timeline(s, summary)
    if args.verify:
        verify(s, rows_log, summary)
    if s.logf:
        s.logf.write(json.dumps(summary) + "\n")
        s.logf.close()
    sample(s)
    return summary


def end_job(code: int):
    """End every rank of the job now (several ranks: MPI_Abort), so that none is left
    waiting for this one; one process: return, and the caller exits."""
    from mpi4py import MPI                                   # noqa: PLC0415
    if MPI.COMM_WORLD.Get_size() > 1:
        comm.abort_world(code)


def main(argv=None):
    args = build_parser().parse_args(argv)
    keep_freed_memory()
    try:
        summary = run(args)
    except ConfigError as e:
        if not e.quiet:
            print(f"minipar.train: error: {e}", file=sys.stderr, flush=True)
        if not (e.quiet or getattr(e, "agreed", False)):
            end_job(2)             # raised after the agreement, maybe on this rank alone
        sys.exit(2)
    except checkpoint.SaveFailed:
        end_job(1)                 # the failing rank has printed its traceback
        raise
    if "verify" in summary and not summary["verify"]["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
