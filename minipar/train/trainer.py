"""The trainer: python -m minipar.train [flags]   (--help; docs/design.md §7. The flags and
their validation live in config.py.)

This file is the training loop and nothing else. A run is set_up (validate on every rank,
agree, build the grid, this rank's model, its optimizer and gradient synchroniser), then
train_loop (one train_step per step), then the summary (report.py), --verify (verify.py)
and checkpoints (checkpoint.py). Everything a step needs travels in one Session.

Each step:  for each micro-batch: loss = model(x, y, loss_denom=B*T); loss.backward()
            (with --pp: the stage's schedule runs the micro-batches, parallel/pipeline.py)
            sync.finish(); grad_norm = sqrt(sync.grad_norm_sq); lr = schedule(step); AdamW step
Dividing every micro-batch loss by the global token count B*T (not by its own size) makes
the accumulated gradient exactly the gradient of the mean loss over the global batch.
With --precision fp16/bf16 (precision.py): backward starts from the loss scale S instead
of 1; an inf/NaN in any gradient on any rank (a max all-reduce of every rank's flag)
skips the step everywhere; otherwise the gradients are unscaled and clipped in fp32
inside the optimizer's step, with one factor clip_coef / S.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import IO

import numpy as np

from minipar.train import checkpoint, data, faults, report, stop, verify
from minipar import comm, trace
from minipar.show import tracing
from minipar.model import moe
from minipar.config import outputs
from minipar.plan import memory
from minipar.optim import mixed_precision
from minipar.config.flags import ConfigError, build_parser
from minipar.train.setup import RunSpec, agree_on_errors, prepare
from minipar.model.contract import Model
from minipar.parallel.data_parallel import GradSync
from minipar.model.gpt import GPT, train_flops_per_token
from minipar.optim.adamw import AdamW, clip_coef, lr_at
from minipar.parallel.context import context_parallel
from minipar.parallel.context.ulysses import head_split
from minipar.parallel import data_parallel
from minipar.parallel.expert import expert_parallel
from minipar.parallel.pipeline import stage as pipeline
from minipar.parallel.tensor import tensor_parallel
from minipar.parallel.zero import build as zero, hybrid, zpp
from minipar.parallel.grid import ProcessGrid
from minipar.parallel.parallelize import parallelize
from minipar.plan.peak import keep_freed_memory, matmul_peak_flops
from minipar.autograd.tensor import no_grad


class Printer:
    """Progress and summary on stdout (rank 0 only, once there are ranks)."""

    def __init__(self, enabled=True):
        self.enabled = enabled

    def __call__(self, *a, **k):
        if self.enabled:
            print(*a, **k, flush=True)


@dataclass
class Session:
    """What every step and every phase of a run reads. The first four fields are all a
    single-process run needs (the --verify twin is one); set_up fills in the rest."""
    args: argparse.Namespace
    model: Model                                # GPT, TensorParallelGPT or PipelineStage
    opt: object                                 # AdamW, MixedPrecisionAdamW, or ZeRO's ShardedAdamW
    sampler: data.Sampler                       # the global batch of every step
    sync: GradSync | None = None                # None: data_parallel.NoSync (one dp rank)
    rows: tuple[int, int] | None = None         # this dp rank's rows of the batch; None: all
    context: object = None                      # --cp: this rank's ContextSplit (its tokens)
    dp_group: comm.Group | None = None          # sums the step's loss over dp x cp (> 1 rank)
    world_group: comm.Group | None = None       # agrees on fp16 overflow (world > 1)
    pipe: pipeline.PipelineEngine | None = None  # runs the micro-batches with --pp > 1
    spec: RunSpec | None = None                 # what setup.prepare decided
    grid: ProcessGrid | None = None
    say: Printer = Printer(False)
    logf: IO | None = None                      # the --log file on rank 0
    peak: float = 0.0                           # the ranks' aggregate matmul peak, FLOP/s
    flops_step: float = 0.0                     # model FLOPs of one training step
    requests: stop.Requests = field(default_factory=stop.Requests)   # signals, a failed output
    checkpoint: tuple | None = None             # (the last good checkpoint, its step), for the stop line
    lock: outputs.SaveLock | None = None        # rank 0's hold on --save DIR

    def __post_init__(self):
        if self.sync is None:
            self.sync = data_parallel.NoSync(self.model.parameters())
        if self.rows is None:
            self.rows = (0, self.args.batch_size)

    cfg = property(lambda self: self.model.cfg)
    world = property(lambda self: self.grid.world.size)
    rank = property(lambda self: self.grid.rank)

    @property
    def has_dp(self) -> bool:
        """Does this run sum gradients over dp ranks, or shard them with ZeRO?"""
        return self.grid is not None and (self.grid.grad_group.size > 1 or self.args.zero > 0)

    def local(self, batch):
        """This rank's tokens of an (ids, targets) batch: all of them, or with --cp its share
        of every sequence (context_parallel.ContextSplit.local)."""
        return batch if self.context is None else tuple(self.context.local(a) for a in batch)


# --- building a rank's model and optimizer ------------------------------------------------

def build_optimizer(model: Model, args) -> AdamW:
    """AdamW; with --precision fp16/bf16 MixedPrecisionAdamW, which takes the model's
    float32 weights as its master weights and leaves the model their 2-byte rounding."""
    if args.precision == "fp32":
        return AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    dtype = mixed_precision.storage_dtype(args.precision)
    return mixed_precision.MixedPrecisionAdamW(
        model.parameters(), dtype, lr=args.lr, weight_decay=args.weight_decay,
        scaler=mixed_precision.make_scaler(args.precision, args.loss_scale, args.loss_scale_window))


def init_model(spec: RunSpec, args, grid: ProcessGrid | None = None,
               context: context_parallel.ContextSplit | None = None):
    """(model, optimizer) for this rank: the layout's model (parallelize: every mechanism
    applied in order), its optimizer, and with --resume both loaded from the checkpoint."""
    model = parallelize(spec.cfg, grid, args.seed, spec.dtype, args.recompute, args.sp, context,
                        moe_settings(spec, args), args.virtual_stages, args.zero,
                        getattr(args, "attn_block", None))              # --attention tiled's block, else None
    opt = build_optimizer(model, args)
    if spec.meta is not None:
        try:
            checkpoint.restore(model, opt, spec.state, spec.ostate, args.resume)
        except checkpoint.CheckpointError as e:
            raise ConfigError(str(e)) from None
        if "loss_scaler" in spec.meta:                   # the scale and its clean-step count go on
            opt.scaler.load_state_dict(spec.meta["loss_scaler"])
    return model, opt


def moe_settings(spec: RunSpec, args) -> moe.MoESettings | None:
    """A MoE model's routing settings. The routing group is one micro-batch of one dp rank,
    B/(dp M) sequences, on every layout and in the --verify twin (spec.layout is the run's)."""
    cfg = spec.cfg
    if not cfg.moe_experts:
        return None
    rows = spec.layout.rows
    return moe.settings_of(cfg, aux_coef=args.moe_aux_coef, z_coef=args.moe_z_coef, group_rows=rows,
                           groups_total=args.batch_size // rows)


# --- one step ----------------------------------------------------------------------------------

def train_step(session: Session, step: int) -> dict:
    """One optimizer step over the global batch -> its log row (docs/design.md §8).

    rows = (lo, hi): this rank's rows of the global batch, cut into --micro-batches. Each
    micro-batch loss is divided by the global token count, so the gradients summed over
    micro-batches (autograd's +=) and over dp ranks (sync.finish) are those of the mean
    loss over the global batch. With a pipeline, its schedule runs the micro-batches (and
    calls sync.sync_now / finish itself).

    Mixed precision: backward is seeded with the loss scale S; the global norm of the scaled
    gradients is measured (not clipped); an inf/NaN in any gradient on any rank (a max
    all-reduce of each rank's flag over the world) skips the step on all of them; otherwise
    opt.step unscales and clips in fp32 with one factor, clip_coef / S."""
    args, model, opt, sync = session.args, session.model, session.opt, session.sync
    faults.inject(session, step, session.grid.rank if session.grid is not None else 0)     # MINIPAR_FAULT (tests)
    scaler = opt.scaler if args.precision != "fp32" else None
    scale = scaler.scale if scaler is not None else 1.0
    t0 = time.perf_counter()
    with comm.window() as w:                            # the ledger over the step: its row's bytes
        lr = opt.lr = lr_at(step, args.lr, args.lr_schedule, args.warmup, args.steps, args.min_lr)
        sync.zero_grad()
        sync.start_step()
        with moe.collecting(model.moe, scale) as routing:   # routing: this step's loss scale and stats
            batches = micro_batches(session, step)
            if session.pipe is not None:                      # the stage's schedule, then dp's sync
                loss_local = session.pipe.train_step(batches, args.batch_size * model.cfg.block_size, sync,
                                               loss_scale=scale)
            else:
                loss_local = accumulate(session, batches, scale)
        w.mark("synced")                                # the gradient sync's (and pipeline's) bytes end here
        loss_sum = loss_over_dp(session, loss_local)
        norm = math.sqrt(sync.grad_norm_sq(model)) / scale  # of the unscaled gradients
        skipped = overflowed(session, scaler)
        if not skipped:                                 # clip (and unscale) inside AdamW's passes:
            with trace.span("optimizer step", "optimizer"):  # the grads stay as they are
                opt.step(grad_scale=clip_coef(norm, args.grad_clip) / scale)
        if scaler is not None:
            scaler.update(skipped)                      # a skipped step: nothing in opt has changed
        dt = time.perf_counter() - t0
    return step_row(session, w, routing, step=step, loss=loss_sum, lr=lr, grad_norm=norm, step_time=dt,
                    loss_scale=scale, skipped=skipped)


def micro_batches(session: Session, step: int) -> list:
    """This rank's rows of the step's global batch cut into --micro-batches: each
    (B/(dp*M), T), with --cp (B/(dp*M), T/cp) (Session.local)."""
    lo, hi = session.rows
    M = session.args.micro_batches
    mb = (hi - lo) // M
    return [session.local(session.sampler.batch(step, lo + k * mb, lo + (k + 1) * mb)) for k in range(M)]


def accumulate(session: Session, batches: list, scale: float) -> float:
    """Without a pipeline: forward and backward of each micro-batch, the gradients adding up;
    only the last one's backward starts the gradient sync, waited for at the end. -> the sum
    of this rank's micro-batch losses."""
    model, sync, M = session.model, session.sync, len(batches)
    BT = session.args.batch_size * model.cfg.block_size        # every loss over the global token count
    loss_local = 0.0
    for k, (x, y) in enumerate(batches):
        sync.sync_now(k == M - 1)                       # only the last micro-batch talks
        with trace.span(f"forward mb {k}", "microbatch", kind="F", mb=k, stage=0):
            loss = model(x, y, loss_denom=BT)
        with trace.span(f"backward mb {k}", "microbatch", kind="B", mb=k, stage=0):
            loss.backward(mixed_precision.backward_seed(scale))   # None (i.e. 1) unless scaling
        loss_local += loss.item()
    with trace.span("wait for gradient sync", "wait"):
        sync.finish()
    return loss_local


def loss_over_dp(session: Session, loss_local: float) -> float:
    """The step's loss: this rank's sum, summed over dp x cp (one all-reduce)."""
    return (loss_local if session.dp_group is None
            else float(comm.all_reduce(session.dp_group, np.array([loss_local]))[0]))


def overflowed(session: Session, scaler) -> bool:
    """Skip the step? With a loss scaler: an inf/NaN in any gradient on any rank (a max
    all-reduce of every rank's flag over the world) skips it everywhere."""
    if scaler is None:
        return False
    skipped = session.sync.local_found_inf(session.model)
    if session.world_group is not None:                       # any rank's overflow skips the step everywhere
        flag = np.array([skipped], dtype=np.int64)
        skipped = bool(comm.all_reduce(session.world_group, flag, op="max")[0])
    return skipped


def step_row(session: Session, w: comm.window, routing: moe.collecting, *, step, loss, lr, grad_norm, step_time,
             loss_scale, skipped) -> dict:
    """The step's log row (docs/design.md §8) from what it measured and the ledger's window
    over it, by the axis of the group each byte went over (the ledger tags them where they
    are sent, minipar.comm): "dp" (gradient sums, the step's loss and clipping's norm over
    dp), "zero" (ZeRO's reduce-scatters and all-gathers), "tp", "pp", "cp", "ep", "world"
    (the fp16 overflow flag); up to the mark "synced" for the gradient sync's and the
    pipeline's; inter_host: the bytes that left the host."""
    step_sent, sync_sent = w.sent_by_axis, w.sent_until("synced")
    return {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": session.args.batch_size * session.cfg.block_size / step_time,
            "comm_bytes": sum(step_sent.values()),
            "grad_sync_bytes": sync_sent.get("dp", 0) + sync_sent.get("zero", 0),
            "pp_bytes": sync_sent.get("pp", 0),
            "tp_bytes": step_sent.get("tp", 0), "zero_bytes": step_sent.get("zero", 0),
            "bytes_by_axis": {str(axis): n for axis, n in step_sent.items() if n},
            "inter_host_bytes_by_axis": {str(axis): n for axis, n in w.inter_host_by_axis.items() if n},
            "exposed_comm_s": session.sync.exposed_seconds, "cp_wait_s": float(w.counted("ring", "waited")),
            **zero_gathers_row(session.sync, w),
            "step_time": step_time, "loss_scale": loss_scale, "skipped": skipped, **routing.row()}


def zero_gathers_row(sync, w: comm.window) -> dict:
    """ZeRO-3's gathers in a step's row: the exposed waits for them, forward and backward
    (the ledger's counts), and the peak of the gathered buffers in use (Stage3.gathered_peak)."""
    if not getattr(sync, "tracks_gathers", False):
        return {}
    return {"zero_gather_wait_s": {phase: float(w.counted_kind("zero", phase, "waited"))
                                   for phase in ("forward", "backward")},
            "zero_gathered_peak": sync.gathered_peak, "zero_secondary_peak": sync.secondary_peak}


def train_steps(session: Session, start: int, end: int):
    """Steps start..end-1, one log row per yield."""
    for step in range(start, end):
        session.requests.step = step
        with quiet_overflow(), trace.span(f"step {step}", "step", step=step):
            row = train_step(session, step)
        yield row                                       # outside the errstate: the caller runs here


def quiet_overflow():
    """No RuntimeWarning for an overflow in a step: fp16 gradients overflow to inf by design
    when the loss scale is too large (the step is skipped, as in PyTorch), and a run that
    diverges is stopped at the end of the step by stop.Watch, with one line."""
    return np.errstate(over="ignore", invalid="ignore")


# --- a run ------------------------------------------------------------------------------------

def open_rank0_outputs(args):
    """The files only rank 0 writes, opened (--log) or checked (--timeline, --trace) before the ranks
    agree on the configuration: a path rank 0 cannot write then stops every rank at once with
    exit code 2, where a failure later, on rank 0 alone, would leave the others waiting.
    --dry-run checks --log the same way without creating it. With --save, rank 0 takes the
    save lock (outputs.SaveLock), unless it is a dry run. -> (the open --log file or None,
    the lock or None)."""
    for flag, path in (("--timeline", args.timeline), ("--trace", args.trace), ("--log", args.log)):
        if not path or (flag == "--log" and not args.dry_run):
            continue
        parent = os.path.dirname(os.path.abspath(path))
        if (not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK)
                or os.path.isdir(path)):
            why = "is a directory" if os.path.isdir(path) else \
                f"directory {parent} " \
                f"{'is not writable' if os.path.isdir(parent) else 'does not exist'}"
            raise ConfigError(f"{flag} {path}: {why}")
    if args.dry_run:
        return None, None
    lock = None
    if args.save:
        try:
            lock = outputs.SaveLock(args.save)
        except (outputs.OutputError, OSError) as e:
            raise ConfigError(str(e)) from None
    if not args.log:
        return None, lock
    try:
        # line-buffered: each step's row is on disk at once
        return open(args.log, "w", buffering=1), lock
    except OSError as e:
        if lock is not None:
            lock.release()
        raise ConfigError(f"--log {args.log}: {e.strerror}") from None


def hybrid_context(grid, args, cfg):
    """--cp-impl hybrid: its ContextSplit, whose Ulysses degree (without --cp-ulysses: the cp
    ranks of a host) can be checked against the heads only now that the hosts are known. Every
    rank knows the same hosts, so every rank stops with the same one line."""
    try:
        context = context_parallel.ContextSplit(grid.cp_group, args.cp_layout, "hybrid", args.cp_ulysses)
        head_split(cfg.n_head // grid.tp_size, max(1, cfg.kv_heads // grid.tp_size), context.ulysses)
    except ValueError as e:
        raise ConfigError.everywhere(f"{e} (--n-head {cfg.n_head}, {cfg.kv_heads} key/value heads, --tp "
                                     f"{grid.tp_size}, Ulysses over {args.cp_ulysses or 'the cp ranks of a host'})",
                                     grid.rank) from None
    return context


def shard_blocks(grid, args, cfg) -> dict | None:
    """--shard-group: the shard block of each rank of the gradient group (zero.hybrid.blocks),
    and grid.layout's shard_group resolved (the ranks of a host, known only now: the memory
    check, which counted it flat, runs again with it). None: flat."""
    if args.shard_group is None:
        return None
    by_host = args.shard_group == "host"
    try:
        S = hybrid.host_shard_size(grid.grad_group) if by_host else args.shard_group
        grid.layout = grid.layout.but(shard_group=S)
        if by_host:
            memory.check_fits(args, cfg, grid.layout)
    except (ValueError, ConfigError) as e:
        raise ConfigError.everywhere(str(e), grid.rank) from None
    return hybrid.blocks(grid.grad_group, S, by_host)


def set_up(args, requests: stop.Requests | None = None) -> Session:
    """Validate on every rank, agree, then build the grid, the model of this rank, its
    optimizer and the data-parallel / ZeRO / pipeline machinery."""
    from mpi4py import MPI                                   # noqa: PLC0415 - keep import light
    world_comm = MPI.COMM_WORLD
    world, rank = world_comm.Get_size(), world_comm.Get_rank()
    if world > 1:                  # from here on an exception on any rank ends the whole job
        comm.abort_on_error()
    err, spec, logf, lock = None, None, None, None
    try:
        spec = prepare(args, world)
        memory.check_fits(args, spec.cfg, spec.layout)     # the planner's peak vs this machine
        if rank == 0:
            logf, lock = open_rank0_outputs(args)
    except ConfigError as e:
        err = e
    if world == 1:
        if err is not None:
            raise err
    else:
        if err is not None:
            err.agreed = True      # main(): every rank learns of it below and exits 2
        agree_on_errors(world_comm, err)
    if rank == 0 and spec.meta is not None and spec.meta["loaded_from"] != os.path.abspath(args.resume):
        print(f"checkpoint: {os.path.abspath(args.resume)} is missing (a save was cut off between its two "
              f"renames): resuming from the one before it, {spec.meta['loaded_from']}", flush=True)
    grid = ProcessGrid(world_comm, spec.layout)
    context = hybrid_context(grid, args, spec.cfg) if args.cp_impl == "hybrid" else (
        context_parallel.ContextSplit(grid.cp_group, args.cp_layout, args.cp_impl) if grid.cp_size > 1 else None)
    if args.cp_impl == "hybrid":                             # the planner's figures with the hosts' U
        grid.layout = grid.layout.but(cp_ulysses=context.ulysses)
    model, opt = init_model(spec, args, grid, context)
    sync = None
    grads = grid.grad_group        # dp x cp: every rank of it has a partial gradient of the same weights
    if args.zero:                  # two objects on the same units: the dp synchroniser, the sharded optimizer
        experts = (grid.expert_group, lambda n: expert_parallel.expert_of(n) is not None) if grid.ep_size > 1 else ()
        # only what is set goes to build: its defaults are flat ZeRO with plain gathers, and a
        # replacement of it (labs/08_zero's) takes no more
        layout, blocks, wire = {}, shard_blocks(grid, args, spec.cfg), zpp.Wire(args.qwz, args.hpz, args.qgz)
        if blocks is not None:
            layout["blocks"] = blocks
        if args.zero == 3 and (args.prefetch or not args.reshard_after_forward or wire.on):
            layout.update(prefetch=args.prefetch, reshard_after_forward=args.reshard_after_forward, wire=wire)
        try:
            sync, opt = zero.build(model, opt, grads, args.zero, *experts, **layout)
        except (zpp.HostLayoutError, hybrid.ShardLayoutError) as e:
            raise ConfigError.everywhere(str(e), grid.rank) from None
    elif grid.ep_size > 1:         # experts summed over their replicas, the rest over dp
        sync = expert_parallel.ExpertParallelSync(model, grid, args.dp_mode, args.bucket_mb)
    elif grads.size > 1:
        sync = data_parallel.make(model.parameters(), grads, args.dp_mode, args.bucket_mb)
    B, T, dp, r = args.batch_size, spec.cfg.block_size, grid.dp_size, grid.dp_rank
    if args.trace and not args.dry_run:         # after the clocks' ping-pong with rank 0
        tracing.start(grid.world, tracing.process_name(grid))
    return Session(args, model, opt, data.Sampler(spec.tokens, T, B, args.seed), sync=sync,
                   rows=(r * B // dp, (r + 1) * B // dp), context=context,
                   dp_group=grads if grads.size > 1 else None,
                   world_group=grid.world if world > 1 else None,
                   pipe=(pipeline.PipelineEngine(model, args.schedule, args.micro_batches)
                         if grid.pp_size > 1 else None),
                   spec=spec, grid=grid, say=Printer(rank == 0), logf=logf,
                   peak=(0.0 if args.dry_run
                         else matmul_peak_flops(spec.dtype, seconds=0.1) * world),  # all ranks
                   flops_step=train_flops_per_token(spec.cfg, T) * B * T, lock=lock,
                   requests=requests or stop.Requests(),
                   checkpoint=(args.resume, spec.start) if args.resume else None)


def train_loop(session: Session) -> list[dict]:
    """The steps from the spec's start to --steps: a progress line every --log-every steps,
    a log row per step, a checkpoint every --save-every; after each step the ranks agree on
    whether to stop (stop.py: divergence, a signal, an output that failed). -> the rows."""
    args, start = session.args, session.spec.start
    log_every = args.log_every or max(1, (args.steps - start) // 20)
    rows_log = []
    watch = stop.Watch(args)
    session.requests.in_steps = True
    for row in train_steps(session, start, args.steps):
        step = row["step"]
        row["mfu"] = session.flops_step / row["step_time"] / session.peak
        row["tokens"] = (step + 1) * args.batch_size * session.cfg.block_size
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            row["val_loss"] = validation_loss(session)         # collective with --pp
        rows_log.append(row)
        write_log(session, report.json_safe(row))
        if (step - start) % log_every == 0 or step == args.steps - 1 or row["skipped"]:
            session.say(report.progress_line(session, row))
        scaler = session.opt.scaler
        why = watch.check(row, scaler.scale if scaler is not None and scaler.dynamic else None)
        if why:                                          # the same verdict on every rank
            session.requests.in_steps = False
            raise stop.Stop(stop.DIVERGED, watch.line(why, session.checkpoint))
        reason = stop.REASONS[stop.agree(session.world_group, session.requests.local_code())]
        if reason:
            session.requests.in_steps = False
            raise stopped(session, reason, step + 1)
        if args.save and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save(session, step + 1)
    session.requests.in_steps = False
    return rows_log


def write_log(session: Session, obj: dict):
    """One --log line on rank 0. A full disk or an I/O error is said once, in one line naming
    the file; the ranks then stop after this step (the checkpoint still written)."""
    if session.logf is None:
        return
    try:
        session.logf.write(json.dumps(obj) + "\n")
    except OSError as e:
        session.requests.output_error = f"--log {session.args.log}: {checkpoint.describe_error(e)}"
        with contextlib.suppress(OSError):
            session.logf.close()
        session.logf = None


def save(session: Session, step: int):
    """The checkpoint of the steps before `step` (collective), remembered for a stop line.
    A state holding NaN is never written (the run diverged); one process's full disk is one
    line (several ranks: checkpoint.save agrees, and says it on the failing rank)."""
    d = session.args.save
    try:
        with trace.span("save checkpoint", "checkpoint", step=step):
            checkpoint.save_run(d, session, step)
    except checkpoint.NotFinite as e:
        raise stop.Stop(stop.DIVERGED, f"minipar.train: {e}") from None
    except OSError as e:                            # one process: the error as it is
        raise stop.Stop(stop.OUTPUT_FAILED, f"minipar.train: checkpoint {d} not written: "
                                            f"{checkpoint.describe_error(e)}; {d} keeps the last good "
                                            f"checkpoint") from None
    session.checkpoint = (d, step)


def stopped(session: Session, reason: str, step: int) -> stop.Stop:
    """The agreed stop after `step` steps: SIGTERM and a failed output first save a
    checkpoint (with --save); -> the Stop to raise on every rank."""
    args = session.args
    saved = ""
    if args.save and reason in ("SIGTERM", "output"):
        save(session, step)
        saved = f"; checkpoint {args.save} written: --resume {args.save} continues at step {step}"
    if reason == "output":
        return stop.Stop(stop.OUTPUT_FAILED, f"minipar.train: an output could not be written "
                                             f"({session.requests.output_error or 'on another rank'}): stopped after "
                                             f"step {step - 1}{saved}")
    code = stop.INTERRUPTED[signal.SIGTERM if reason == "SIGTERM" else signal.SIGINT]
    return stop.Stop(code, f"minipar.train: interrupted at step {step} ({reason}): steps 0..{step - 1} "
                           f"done, the log flushed{saved}")


def validation_loss(session: Session) -> float:
    """The mean loss of 4 batches of the held-out split (collective with --pp: every stage)."""
    args = session.args
    val = data.Sampler(session.spec.tokens, session.cfg.block_size, args.batch_size, args.seed, split="val")
    with no_grad(), trace.span("validation", "eval"):
        loss = float(np.mean([session.model.evaluate(*session.local(val.batch(i))) for i in range(4)]))
    if session.context is None:
        return loss
    # each cp rank's mean over as many tokens as every other's: their mean is the batch's
    return float(comm.all_reduce(session.context.group, np.array([loss]))[0]) / session.context.size


def replica_digest(session: Session) -> str:
    """Check that the replicas hold the same weights (raises if not) -> the weights' hash.
    With --ep the experts are compared over their own replicas, the rest over dp."""
    grid, params = session.grid, session.model.named_parameters()
    if grid.ep_size == 1:
        return data_parallel.check_replicas(session.model.parameters(), grid.grad_group)
    experts = [p for n, p in params if expert_parallel.expert_of(n) is not None]
    if grid.expert_group.size > 1:
        data_parallel.check_replicas(experts, grid.expert_group)
    return data_parallel.check_replicas([p for n, p in params if expert_parallel.expert_of(n) is None], grid.dp_group)


def sample(session: Session):
    """--sample N: N bytes generated on rank 0 from the consolidated model."""
    args, model = session.args, session.model
    if args.sample <= 0:
        return
    grid = session.grid
    if grid.tp_size > 1 or grid.pp_size > 1 or grid.cp_size > 1 or grid.ep_size > 1 or args.zero == 3:
        # collective over tp, pp, dp; whole on rank 0
        full = checkpoint.canonical_state(model, session.opt)
        if session.rank == 0:
            model = GPT(session.cfg, seed=args.seed, dtype=session.spec.dtype)
            model.load_state_dict(full)
    if session.rank == 0:
        out = model.generate(data.encode("The pipeline")[None].astype(np.int64), args.sample,
                             rng=np.random.default_rng(args.seed))
        ids = np.where(out[0] < 256, out[0], 0xFF)      # a converted model's ids past the bytes: U+FFFD
        session.say("sample:\n  " + data.decode(ids).replace("\n", "\n  "))


def run(args, requests: stop.Requests | None = None) -> dict:
    """python -m minipar.train: set up, describe, train, summarise, verify, sample.
    --dry-run stops after the description. A stop (stop.Stop) is written into the log as
    its last line; the log is closed and the save lock released however the run ends."""
    s = set_up(args, requests)
    try:
        return phases(s)
    except stop.Stop as e:
        write_log(s, {"stopped": True, "exit_code": e.code, "last_step": s.requests.step, "why": e.line})
        raise
    finally:
        if s.logf:
            with contextlib.suppress(OSError):
                s.logf.close()
        if s.lock is not None:
            s.lock.release()


def phases(session: Session) -> dict:
    """Describe, train, summarise, verify, sample."""
    args = session.args
    for line in report.describe(session):
        session.say(line)
    if args.dry_run:
        for line in report.plan_lines(session):
            session.say(line)
        session.say(f"dry run: the flags, the layout{', the checkpoint' if args.resume else ''} and the data "
              f"check out on all {session.world} rank(s); nothing trained, nothing written")
        return {"dry_run": True}
    t0 = time.perf_counter()
    rows_log = train_loop(session)
    elapsed = time.perf_counter() - t0
    # the training steps' only (not validation)
    tp_ledger = tensor_parallel.traffic()
    # stage 3: every dp rank holds other shards
    replicated = session.grid.grad_group.size > 1 and args.zero != 3
    digest = replica_digest(session) if replicated else None
    if args.save:
        save(session, args.steps)
    val_loss = validation_loss(session)
    stages = session.pipe.gather_stats() if session.pipe is not None else None   # collective over pp
    summary, lines = report.summarize(session, rows_log, elapsed, val_loss, digest, stages, tp_ledger)
    for line in lines:
        session.say(line)
    if args.timeline and session.rank == 0:
        report.draw_timeline(session, summary)
    if args.verify:
        verify.verify(session, rows_log, summary)
    if args.trace:                                  # collective: every rank's events to rank 0
        try:
            written = tracing.finish(session.grid.world, args.trace, trace_metadata(session))
        except OSError as e:                        # rank 0 alone writes it: the others are done
            session.requests.output_error = f"--trace {args.trace}: {checkpoint.describe_error(e)}"
            written = None
        if written:
            session.say(f"trace: {written} (open it in https://ui.perfetto.dev or chrome://tracing)")
    write_log(session, summary)
    if session.requests.output_error:
        raise stop.Stop(stop.OUTPUT_FAILED, f"minipar.train: an output could not be written "
                                            f"({session.requests.output_error})")
    sample(session)
    return summary


def trace_metadata(session: Session) -> dict:
    """What a reader of the trace needs to check it: the layout, the schedule, the command."""
    args, grid = session.args, session.grid
    return {"layout": {"dp": grid.dp_size, "cp": grid.cp_size, "tp": grid.tp_size, "pp": grid.pp_size,
                       "zero": args.zero},
            "schedule": args.schedule if grid.pp_size > 1 else None, "micro_batches": args.micro_batches,
            "virtual_stages": args.virtual_stages,
            "steps": [session.spec.start, args.steps], "argv": sys.argv[1:]}


def end_job(code: int):
    """End every rank of the job now (several ranks: MPI_Abort), so that none is left
    waiting for this one; one process: return, and the caller exits."""
    from mpi4py import MPI                                   # noqa: PLC0415
    if MPI.COMM_WORLD.Get_size() > 1:
        comm.abort_world(code)


def main(argv=None):
    args = build_parser().parse_args(argv)
    keep_freed_memory()
    requests = stop.Requests()
    with requests.installed():
        return ended(args, requests)


def ended(args, requests: stop.Requests):
    """run(), each way it can end turned into its line and exit code (docs/debugging.md)."""
    try:
        summary = run(args, requests)
    except ConfigError as e:
        if not e.quiet:
            print(f"minipar.train: error: {e}", file=sys.stderr, flush=True)
        if not (e.quiet or e.agreed):
            end_job(2)             # raised after the agreement, maybe on this rank alone
        sys.exit(2)
    except checkpoint.SaveFailed as e:
        stop.say(f"minipar.train: {e}")
        end_job(stop.OUTPUT_FAILED)    # the failing rank has said why
        sys.exit(stop.OUTPUT_FAILED)
    except stop.Stop as e:             # agreed: every rank stops here, together
        if rank_of() == 0:
            stop.say(e.line)
        sys.exit(e.code)
    except stop.Interrupted as e:      # a second signal, or one outside the steps: now
        stop.say("minipar.train: interrupted" + (f" at step {requests.step}" if requests.step is not None else "")
                 + f" ({e} on rank {rank_of()}, outside a step or a second time): ending every rank now")
        end_job(stop.INTERRUPTED[e.signum])
        sys.exit(stop.INTERRUPTED[e.signum])
    except SystemExit as e:            # a rank leaving mid-run: end the job now, not at the timeout
        code = e.code if isinstance(e.code, int) else 1
        stop.say(f"minipar.train: rank {rank_of()} left the run"
                 + (f" at step {requests.step}" if requests.step is not None else "")
                 + f" (exit code {code}): ending every rank")
        end_job(stop.LEFT)
        sys.exit(stop.LEFT if code == 0 else code)
    if "verify" in summary and not summary["verify"]["ok"]:
        sys.exit(1)
    return summary


def rank_of() -> int:
    from mpi4py import MPI                                   # noqa: PLC0415
    return MPI.COMM_WORLD.Get_rank()


if __name__ == "__main__":
    main()
