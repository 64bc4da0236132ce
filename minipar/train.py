"""The trainer: python -m minipar.train [flags]   (see --help, and DESIGN 2.7; the flags
and their validation live in config.py)

The model, AdamW, the step-indexed sampler, gradient accumulation over micro-batches,
checkpoints, a JSONL log, a progress line and a closing summary, on one process or on a
dp x tp x pp grid of MPI ranks (parallel/).

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
import numpy as np

from minipar import checkpoint, comm, data, precision
from minipar.model import GPT, GPTConfig, param_specs, train_flops_per_token
from minipar.optim import AdamW, clip_coef, clip_grad_norm, lr_at
from minipar.perf import human_bytes, keep_freed_memory, matmul_peak_flops
from minipar.parallel import data_parallel, pipeline, schedules, tensor_parallel, zero
from minipar.config import ConfigError, Plan, agree_on_errors, build_parser, prepare, tokens_digest
from minipar.parallel.grid import ProcessGrid
from minipar.tensor import no_grad

def memory_report(model, opt: AdamW) -> dict:
    """Bytes this process holds for model states, beside the formula (fp32/fp64: Adam keeps
    m and v, so params + grads + optimizer = s*P + s*P + 2s*P for an s-byte dtype, with P
    the parameters this rank holds: all of them, or tensor_parallel.local_param_count).
    --precision fp16/bf16: 2P + 2P + 12P (the optimizer adds fp32 master weights to m, v).
    With --zero, the ZeRO object's own report: its shards, beside zero.formula."""
    if isinstance(opt, zero.Zero):
        return opt.memory_report()
    tp = getattr(model, "tp_size", 1)
    if isinstance(model, pipeline.PipelineStage):
        P = pipeline.local_param_count(model.cfg, model.stage, model.n_stages, tp)
    else:
        P = model.num_params() if tp == 1 else tensor_parallel.local_param_count(model.cfg, tp)
    s = model.dtype.itemsize
    so = 12 if isinstance(opt, precision.MixedPrecisionAdamW) else 2 * s      # optimizer bytes/param
    return {
        "params": sum(p.data.nbytes for p in model.parameters()),
        "grads": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
        "optimizer": opt.state_bytes(),
        "formula": {"params": s * P, "grads": s * P, "optimizer": so * P,
                    "text": f"{s}P + {s}P + {so}P"},
    }


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
    if scaler is None:
        norm = clip_grads(model, opt, args.grad_clip)   # grads are identical on every dp rank
        opt.step()
    else:
        norm = clip_grads(model, opt, 0.0) / scale  # measure only: the 2-byte grads stay as they are
        skipped = opt.local_found_inf() if isinstance(opt, zero.Zero) else \
            precision.local_found_inf(model.parameters())
        if world is not None and world.size > 1:    # any rank's overflow skips the step everywhere
            skipped = bool(comm.all_reduce(world, np.array([skipped], dtype=np.int64), op="max")[0])
        if not skipped:
            opt.step(grad_scale=clip_coef(norm, args.grad_clip) / scale)   # unscale + clip in fp32
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


def clip_grads(model, opt, max_norm: float) -> float:
    """Global-norm clipping; a tensor-parallel model counts each parameter once across tp,
    ZeRO each gradient shard once across dp."""
    if isinstance(opt, zero.Zero):
        return opt.clip_grad_norm(max_norm)
    if hasattr(model, "grad_norm_sq"):
        return tensor_parallel.clip_grad_norm(model, max_norm)
    return clip_grad_norm(model.parameters(), max_norm)


def run_twin(plan: Plan, args, start: int, stop: int):
    """--verify: the same steps on one process, from the same weights and data (and the
    same --precision: the fp32 master weights are compared)."""
    model, opt = init_model(plan, args)
    sampler = data.Sampler(plan.tokens, plan.cfg.block_size, args.batch_size, args.seed)
    losses = [r["loss"] for r in train_steps(model, opt, sampler, args, start, stop, (0, args.batch_size))]
    return losses, canonical_state(model, opt)


def judged(name: str, a: np.ndarray) -> np.ndarray:
    """The part of parameter `name` that --verify judges: all of it, except the key bias.
    Adding b_k to every key adds q . b_k to all of a query's logits, which softmax cancels,
    so the key bias's exact gradient is zero and what it receives is rounding noise.
    AdamW's step, scale-free, turns that noise into moves of up to about lr * g/(|g| + eps)
    per step, different in every layout: in float32 the key bias (|b_k| ~ 1e-6) differs
    between layouts by as much as its own size, while every other tensor agrees to ~1e-5."""
    if name.endswith("attn.c_attn.bias"):
        q, _, v = np.split(a, 3)
        return np.concatenate([q, v])
    return a


def compare(losses, ref_losses, state, ref_state) -> dict:
    """Largest absolute and relative differences; relative = |a - b| / |b| for losses and
    max|a - b| / max|b| per parameter tensor (biases start at 0: no elementwise ratio),
    without the key biases (`judged`; their largest difference is key_bias_abs).
    param_rel_global = ||a - b|| / ||b|| over all parameters at once: what --verify reports
    with --precision fp16/bf16 (see VERIFY_RTOL)."""
    la, lb = np.array(losses), np.array(ref_losses)
    loss_abs = float(np.max(np.abs(la - lb)))
    loss_rel = float(np.max(np.abs(la - lb) / np.maximum(np.abs(lb), 1e-300)))
    p_abs = p_rel = key_bias = 0.0
    worst = None
    diff_sq = ref_sq = 0.0
    for name, ref in ref_state.items():
        diff = state[name].astype(np.float64) - ref
        if name.endswith("attn.c_attn.bias"):
            key_bias = max(key_bias, float(np.max(np.abs(np.split(diff, 3)[1]))))
        diff, ref = judged(name, diff), judged(name, ref)
        d = float(np.max(np.abs(diff))) if ref.size else 0.0
        r = d / max(float(np.max(np.abs(ref))) if ref.size else 0.0, 1e-300)
        if r > p_rel:
            worst = name
        p_abs, p_rel = max(p_abs, d), max(p_rel, r)
        diff_sq += float(np.sum(diff * diff))
        ref_sq += float(np.sum(np.square(ref, dtype=np.float64)))
    return {"loss_abs": loss_abs, "loss_rel": loss_rel, "param_abs": p_abs, "param_rel": p_rel,
            "worst_param": worst, "param_rel_global": math.sqrt(diff_sq / max(ref_sq, 1e-300)),
            "key_bias_abs": key_bias}


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


def run(args) -> dict:
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
    say = Printer(rank == 0)
    cfg, tokens, start = plan.cfg, plan.tokens, plan.start
    grid = ProcessGrid(world_comm, plan.dp, plan.tp, plan.pp)
    dp_size, dp_rank = grid.dp_size, grid.dp_rank

    sampler = data.Sampler(tokens, cfg.block_size, args.batch_size, args.seed)
    model, opt = init_model(plan, args, grid.tp_group, grid)
    if args.zero:                  # one object: the dp synchroniser and the sharded optimizer
        opt = ddp = zero.Zero(model, opt, grid.dp_group, args.zero)
    else:
        ddp = data_parallel.make(model.parameters(), grid.dp_group, args.dp_mode, args.bucket_mb) if dp_size > 1 else None
    B, T, M = args.batch_size, cfg.block_size, args.micro_batches
    pp = grid.pp_size
    pipe = pipeline.PipelineEngine(model, args.schedule, M) if pp > 1 else None
    rows = (dp_rank * B // dp_size, (dp_rank + 1) * B // dp_size)
    flops_step = train_flops_per_token(cfg, T) * B * T
    peak = matmul_peak_flops(plan.dtype, seconds=0.1) * world  # aggregate peak of all ranks
    log_every = args.log_every or max(1, (args.steps - start) // 20)
    source = args.data or f"{data.BUILTIN_NAME} corpus"
    mode = "" if ddp is None or args.zero else (f", {args.dp_mode} gradient all-reduce" + (
        f" in {len(ddp.buckets)} bucket(s) of <= {args.bucket_mb:g} MiB" if args.dp_mode == "bucketed" else ""))
    mixed = args.precision != "fp32"
    say(f"minipar: GPT L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd} T={T} V={cfg.vocab_size} "
        f"({'tied' if cfg.tie_embeddings else 'untied'}), {model.num_params():,} params, {args.dtype}"
        + (f", --precision {args.precision}" if mixed else ""))
    if mixed:
        say(f"  precision: parameters, gradients and activations in {opt.dtype.name}, matmuls and other "
            f"ops computed in float32; fp32 master weights, m and v in the optimizer; "
            + (f"dynamic loss scale from {opt.scaler.scale:g}, x{opt.scaler.growth_factor:g} after "
               f"{opt.scaler.growth_interval} clean steps, x{opt.scaler.backoff_factor:g} and skip on inf/NaN"
               if opt.scaler.dynamic else "no loss scaling (a step with an inf/NaN gradient is skipped)"))
    say(f"  layout: {world} process(es), {grid.describe()}{mode}")
    if grid.tp_size > 1:
        say(f"  tensor parallel: each tp rank holds {cfg.n_head // grid.tp_size} of {cfg.n_head} heads, "
            f"1/{grid.tp_size} of every MLP, {model.vocab_per_rank} of {model.vocab_padded} vocabulary rows "
            f"(V={cfg.vocab_size}{' padded' if model.vocab_padded != cfg.vocab_size else ''}); "
            f"{model.num_local_params():,} of {model.num_params():,} parameters")
    if pipe is not None:
        parts = schedules.partition(cfg.n_layer, pp)
        say(f"  pipeline: {pp} stages, layers " + ", ".join(f"{r.start}..{r.stop - 1}" for r in parts)
            + f" (stage 0 + wte/wpe, stage {pp - 1} + ln_f/head"
            + (", tied wte copied to the last stage" if cfg.tie_embeddings else "")
            + f"); {args.schedule} schedule over {M} micro-batch(es), bubble in theory {pipe.bubble_theory:.3f}")
    if args.zero:
        say(f"  ZeRO stage {args.zero} over {dp_size} dp rank(s): "
            + {1: "optimizer state", 2: "optimizer state and gradients",
               3: "optimizer state, gradients and parameters"}[args.zero]
            + f" sharded in {len(ddp.units)} units (wte, each block, the rest), each padded to a multiple of "
              f"{dp_size} ({ddp.padding} padding elements on this rank)")
    say(f"  batch: {B} x {T} tokens; each dp rank {B // dp_size} sequences in {M} micro-batch(es) of {B // dp_size // M}")
    say(f"  data: {source}, {len(tokens):,} tokens; steps {start}..{args.steps - 1}; "
        f"lr {args.lr:g} {args.lr_schedule}, warm-up {args.warmup}"
        + (f"; resumed from {args.resume}" if plan.meta is not None else ""))

    rows_log, losses = [], []
    t_run = time.perf_counter()
    for row in train_steps(model, opt, sampler, args, start, args.steps, rows, ddp,
                           grid.dp_group if dp_size > 1 else None, pipe, grid.world):
        step = row["step"]
        row["mfu"] = flops_step / row["step_time"] / peak
        losses.append(row["loss"])
        rows_log.append(row)
        if logf:
            logf.write(json.dumps(json_safe(row)) + "\n")
        if (step - start) % log_every == 0 or step == args.steps - 1 or row["skipped"]:
            exposed = f" (exposed {row['exposed_comm_s'] * 1e3:.1f} ms)" if ddp is not None else ""
            scaling = "" if not mixed or not opt.scaler.dynamic else f" | scale {row['loss_scale']:g}"
            say(f"step {step:5d} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | norm {row['grad_norm']:7.3f} | "
                f"{row['tokens_per_s']:8.0f} tok/s | MFU {row['mfu']:5.1%} | comm {human_bytes(row['comm_bytes'])}"
                + exposed + scaling + (" | skipped (inf/NaN gradient)" if row["skipped"] else ""))
        if args.save and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save_checkpoint(args.save, model, opt, cfg, args, step + 1, tokens, grid)
    elapsed = time.perf_counter() - t_run
    steps_run = args.steps - start
    tp_ledger = tensor_parallel.traffic()                # the training steps' only (not validation)

    replicated = dp_size > 1 and args.zero != 3          # stage 3: every dp rank holds other shards
    digest = data_parallel.check_replicas(model.parameters(), grid.dp_group) if replicated else None
    if args.save:
        save_checkpoint(args.save, model, opt, cfg, args, args.steps, tokens, grid)
    val = data.Sampler(tokens, T, B, args.seed, split="val")
    evaluate = getattr(model, "evaluate", lambda x, y: model(x, y).item())   # a pipeline: collective
    with no_grad():
        val_loss = float(np.mean([evaluate(*val.batch(s)) for s in range(4)]))
    stages = pipe.gather_stats() if pipe is not None else None        # collective over pp
    mem = memory_report(model, opt)
    P_bytes = sum(p.data.nbytes for p in model.parameters())
    grad_sync = float(np.mean([r["grad_sync_bytes"] for r in rows_log]))
    theory = 2 * (dp_size - 1) / dp_size * P_bytes
    exposed = float(np.mean([r["exposed_comm_s"] for r in rows_log]))
    step_time = float(np.mean([r["step_time"] for r in rows_log]))
    summary = {"summary": True, "params_count": model.num_params(), "steps": steps_run,
               "first_loss": losses[0], "final_loss": losses[-1], "val_loss": val_loss,
               "unigram_entropy": data.unigram_entropy(tokens),
               "tokens_per_s": B * T * steps_run / elapsed, "mfu": flops_step * steps_run / elapsed / peak,
               "peak_flops": peak, "seconds": elapsed, "memory": mem,
               "layout": {"dp": dp_size, "tp": grid.tp_size, "pp": grid.pp_size, "zero": args.zero},
               "data_parallel": {"mode": f"zero{args.zero}" if args.zero else args.dp_mode if ddp else None,
                                 "buckets": len(ddp.units) if args.zero else
                                 len(ddp.buckets) if ddp is not None and args.dp_mode == "bucketed" else 0,
                                 "grad_sync_bytes_per_step": grad_sync, "theory_bytes_per_step": theory,
                                 "exposed_comm_s_per_step": exposed, "step_time_s": step_time,
                                 "replicas_sha256_16": digest}}
    if args.zero:
        zb = float(np.mean([r["zero_bytes"] for r in rows_log]))
        summary["zero"] = {**mem["zero"], "bytes_per_step": zb, "theory_bytes_per_step": ddp.traffic_theory(M),
                           "plain_dp_bytes_per_step": theory}
    skips = [r["step"] for r in rows_log if r["skipped"]]
    if mixed:
        summary["precision"] = {"mode": args.precision, "storage_dtype": opt.dtype.name,
                                "loss_scale_final": opt.scaler.scale, "dynamic_scaling": opt.scaler.dynamic,
                                "skipped_steps": len(skips), "first_skipped": skips[:10],
                                "optimizer_steps": opt.step_count}
    f = mem["formula"]
    say(f"summary: {steps_run} steps in {elapsed:.1f} s, {summary['tokens_per_s']:,.0f} tok/s, "
        f"MFU {summary['mfu']:.1%} of {world} x {peak / world / 1e9:.0f} GFLOP/s {args.dtype} matmul peak")
    say(f"  loss {losses[0]:.3f} -> {losses[-1]:.3f} (val {val_loss:.3f}); a model that ignores context "
        f"scores {summary['unigram_entropy']:.3f} nats (the unigram entropy of the data)")
    say(f"  memory per rank: params {human_bytes(mem['params'])}, grads {human_bytes(mem['grads'])}, "
        f"optimizer {human_bytes(mem['optimizer'])}; formula {f['text']} = "
        f"{human_bytes(f['params'])} + {human_bytes(f['grads'])} + {human_bytes(f['optimizer'])}")
    if mixed:
        say(f"  precision {args.precision}: {len(skips)} of {steps_run} steps skipped"
            + (f" (steps {', '.join(map(str, skips[:10]))}{' ...' if len(skips) > 10 else ''})" if skips else "")
            + (f"; loss scale now {opt.scaler.scale:g}, {opt.scaler.good_steps} clean steps since its last change"
               if opt.scaler.dynamic else ""))
    if args.zero:
        z = summary["zero"]
        ratio = z["bytes_per_step"] / z["theory_bytes_per_step"] if z["theory_bytes_per_step"] else float("nan")
        calls = {1: "reduce-scatter + all-gather", 2: f"{M} reduce-scatter(s) + all-gather",
                 3: f"{M} x (2 all-gathers + reduce-scatter)"}[args.zero]
        say(f"  ZeRO {args.zero}: sent {human_bytes(z['bytes_per_step'])}/step per rank; theory {calls} of "
            f"(N-1)/N x {human_bytes(z['P_padded'] * ddp.dtype.itemsize)} = {human_bytes(z['theory_bytes_per_step'])} "
            f"(ratio {ratio:.3f}); plain data parallelism would send {human_bytes(theory)}"
            + (f" (x{z['bytes_per_step'] / theory:.2f})" if theory else "")
            + f"; waiting for reduce-scatters after backward {exposed * 1e3:.1f} ms/step")
        if digest is not None:
            say(f"  replicas identical across {dp_size} dp ranks (weights sha256 {digest})")
    elif ddp is not None:
        ratio = grad_sync / theory if theory else float("nan")
        say(f"  data parallel: gradient all-reduce sent {human_bytes(grad_sync)}/step per rank; theory "
            f"2(p-1)/p x {human_bytes(P_bytes)} = {human_bytes(theory)} (ratio {ratio:.3f}); exposed comm "
            f"{exposed * 1e3:.1f} ms/step ({exposed / step_time:.0%} of the step)")
        say(f"  replicas identical across {dp_size} dp ranks (weights sha256 {digest})")
    if stages is not None:                                # pp rank 0 (world rank 0 among them)
        summary["pipeline"] = pipeline_summary(args, pipe, stages, rows_log)
        pl = summary["pipeline"]
        say(f"  pipeline: {args.schedule}, p={pp}, m={M}: bubble measured {pl['bubble_measured']:.3f} (mean over "
            f"stages; per stage " + " ".join(f"{b:.3f}" for b in pl["bubble_per_stage"])
            + f"), theory {pl['bubble_theory']:.3f}; sent {human_bytes(pl['bytes_sent_per_step'])}/step by stage 0")
        say("  saved activations at peak per stage: " + ", ".join(
            f"{human_bytes(b)} ({b / max(u, 1):.1f} micro-batches)" for b, u in
            zip(pl["peak_activation_bytes"], pl["microbatch_activation_bytes"])))
        if rank == 0:
            timeline = [r for st in stages for r in st["timeline"]]
            say(f"  last step's timeline ({pl['step_time_s'][0] * 1e3:.1f} ms on stage 0; F forward, "
                f"B backward, digits the micro-batch, '.' idle):")
            say("\n".join("    " + line for line in schedules.ascii_gantt(timeline, pp, width=100).splitlines()))
            if args.timeline:
                with open(args.timeline, "w") as f:
                    f.write(pipeline.timeline_svg(
                        timeline, pp, f"{args.schedule} p={pp} m={M}: bubble {pl['bubble_measured']:.3f} "
                                      f"(theory {pl['bubble_theory']:.3f})"))
                say(f"  timeline drawn in {args.timeline}")
    if grid.tp_size > 1:
        calls, elems = tensor_parallel.megatron_count(cfg, B // dp_size // M, T)
        if pp > 1:                                       # stage 0's layers (rank 0 prints)
            calls, elems = pipeline.megatron_count_stage(cfg, grid.pp_rank, pp, B // dp_size // M, T)
        tp_calls = sum(v["calls"] for k, v in tp_ledger.items() if k != "grad_norm")
        tp_elems = sum(v["elements"] for k, v in tp_ledger.items() if k != "grad_norm")
        tp_bytes = float(np.mean([r["tp_bytes"] for r in rows_log]))
        summary["tensor_parallel"] = {"tp": grid.tp_size, "all_reduces_per_step": tp_calls / steps_run,
                                      "elements_per_step": tp_elems / steps_run, "bytes_per_step": tp_bytes,
                                      "megatron_all_reduces_per_step": calls * M, "megatron_elements_per_step": elems * M}
        say(f"  tensor parallel: {tp_calls / steps_run:.0f} all-reduces/step of {tp_elems / steps_run:,.0f} elements "
            f"(Megatron: {'(4L+5)' if pp == 1 else 'stage 0, 4 x its layers + 1'} x {M} micro-batch(es) = "
            f"{calls * M}, {elems * M:,} elements), "
            f"{human_bytes(tp_bytes)}/step sent per rank, + 1 for the global grad norm")
    if args.save:
        writers = world if args.zero else world // dp_size                # see save_checkpoint
        who = "one process" if world == 1 else "every rank" if writers == world else "dp rank 0 of each (tp, pp)"
        say(f"  checkpoint: {args.save} (step {args.steps}): model.npz and {writers} optimizer shard(s) in "
            f"{args.save}/optim, written by {who}")

    if args.verify:
        state = canonical_state(model, opt)
        if rank == 0:
            say(f"verify: re-running steps {start}..{args.steps - 1} on one process ...")
            ref_losses, ref_state = run_twin(plan, args, start, args.steps)
            d = compare(losses, ref_losses, state, ref_state)
            tol = VERIFY_RTOL[args.precision if mixed else args.dtype]
            # fp16/bf16: the losses are judged, the parameters only reported (VERIFY_RTOL)
            d["tolerance"], d["ok"] = tol, d["loss_rel"] <= tol and (mixed or d["param_rel"] <= tol)
            summary["verify"] = d
            say(f"verify: {grid.describe()}{f' zero={args.zero}' if args.zero else ''} vs 1 process over {steps_run} steps: loss max |diff| {d['loss_abs']:.3e} "
                f"(rel {d['loss_rel']:.3e}), parameters max |diff| {d['param_abs']:.3e} (rel {d['param_rel']:.3e}, "
                f"{d['worst_param']}" + (f"; whole model rel {d['param_rel_global']:.3e}, not judged" if mixed else "")
                + f"; key biases, not judged: max |diff| {d['key_bias_abs']:.1e}"
                + f"); tolerance {tol:g} relative" + (" on losses" if mixed else "")
                + f" -> {'OK' if d['ok'] else 'FAILED'}")
    if logf:
        logf.write(json.dumps(summary) + "\n")
        logf.close()
    if args.sample > 0 and (grid.tp_size > 1 or pp > 1 or args.zero == 3):   # from the consolidated model
        full = canonical_state(model, opt)                # (collective over tp, pp, dp; whole on rank 0)
        if rank == 0:
            model = GPT(cfg, seed=args.seed, dtype=plan.dtype)
            model.load_state_dict(full)
    if args.sample > 0 and rank == 0:
        prompt = "The pipeline"
        out = model.generate(data.encode(prompt)[None].astype(np.int64), args.sample,
                             rng=np.random.default_rng(args.seed))
        say("sample:\n  " + data.decode(out[0]).replace("\n", "\n  "))
    return summary


# --verify's relative tolerances (compare()). float64 and float32: losses and every parameter
# tensor. fp16/bf16: the twin is a different rounding of the same computation (its gradients
# are summed over the whole batch before the 2-byte rounding, not per dp rank), and two such
# trajectories drift apart in weight space while learning equally well: measured on
# L=2 C=64 with dp=2, losses agree to 2e-6 (fp16) / 4e-5 (bf16) over 20 steps and to
# 1e-2 to 2e-2 over 100 to 400 steps, while the whole-model parameter difference grows from
# 1e-4 to 1e-1. So the losses are judged, at 5e-2, and the parameters only reported.
VERIFY_RTOL = {"float64": 1e-10, "float32": 1e-4, "fp16": 5e-2, "bf16": 5e-2}


def json_safe(row: dict) -> dict:
    """inf and NaN (a skipped step's gradient norm) as null: the log stays strict JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def pipeline_summary(args, pipe, stages, rows_log) -> dict:
    """DESIGN 2.7's `pipeline` figures from every stage's stats (gathered on pp rank 0).
    bubble_measured: 1 - sum of busy time / (p * makespan), the mean over stages of each
    stage's idle fraction of the step's longest stage span, averaged over the steps after
    the first (the first pays for warming caches); pipeline.py's docstring."""
    return {"schedule": args.schedule, "stages": pipe.model.n_stages, "micro_batches": args.micro_batches,
            "bubble_measured": float(np.mean([st["bubble_mean"] for st in stages])),
            "bubble_per_stage": [st["bubble_mean"] for st in stages],
            "bubble_theory": pipe.bubble_theory,
            "peak_activation_bytes": [st["peak_activation_bytes"] for st in stages],
            "microbatch_activation_bytes": [st["microbatch_activation_bytes"] for st in stages],
            "step_time_s": [st["step_time"] for st in stages],
            "bytes_sent_per_step": float(np.mean([r["pp_bytes"] for r in rows_log])),
            "last_step_timeline": [list(r) for st in stages for r in st["timeline"]]}


def end_job(code: int):
    """End every rank of the job now (several ranks: MPI_Abort), so that none is left
    waiting for this one; one process: return, and the caller exits."""
    from mpi4py import MPI                                   # noqa: PLC0415
    if MPI.COMM_WORLD.Get_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(code)
        os._exit(code)             # Abort returns if another rank's abort is already ending the job


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
