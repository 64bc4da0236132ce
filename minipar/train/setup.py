"""A run's set-up, before anything runs: the flags checked (minipar/config/flags.py), the
outputs checked (minipar/config/outputs.py), the checkpoint and the data read, and the RunSpec
every rank derives from them on its own. `prepare` sends no message, so every rank reaches
the same verdict before the first one; `agree_on_errors` then makes all ranks exit together
if any one failed (a file only one rank could not read, say).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from minipar import comm
from minipar.config import outputs
from minipar.config.flags import (DTYPES, ConfigError, check_context_split, check_cp_impl, check_moe, check_numbers,
                                  check_schedule, check_sequence_split, check_shard_group, check_split,
                                  resolve_attention, resolve_dp_flags, resolve_gathers, resolve_model, resolve_zpp,
                                  validate)
from minipar.model.gpt import GPTConfig, param_specs
from minipar.parallel.layout import Layout, LayoutError, check_layout
from minipar.train import checkpoint, data, faults


def check_checkpoint(args, cfg: GPTConfig, state: dict, meta: dict):
    """The checkpoint's model.npz holds the model of the flags: every canonical tensor, with
    its shape and the run's dtype (checkpoint.load has already checked that the optimizer
    shards cover exactly these tensors)."""
    try:
        checkpoint.check_model(os.path.abspath(args.resume), state,
                               [(n, s) for n, s, _ in param_specs(cfg)])
    except checkpoint.CheckpointError as e:
        raise ConfigError(f"{e} (L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd} T={cfg.block_size}, "
                          f"{'tied' if cfg.tie_embeddings else 'untied'})") from None
    dtypes = sorted({a.dtype.name for a in state.values()})
    if dtypes != [meta.get("dtype", args.dtype)]:
        raise ConfigError(
            f"checkpoint file {os.path.join(os.path.abspath(args.resume), 'model.npz')} holds "
            f"{'/'.join(dtypes)} arrays, its meta.json says {meta.get('dtype', args.dtype)}")


def check_scaler_state(state, path: str):
    """meta.json's "loss_scaler" (fp16/bf16): a finite scale > 0, a clean-step count >= 0, a
    growth interval >= 1, a dynamic flag; anything else (a NaN scale would skip every step)
    is refused naming the checkpoint."""
    ok = (isinstance(state, dict) and isinstance(state.get("scale"), (int, float))
          and math.isfinite(state["scale"]) and state["scale"] > 0
          and isinstance(state.get("good_steps"), int) and state["good_steps"] >= 0
          and isinstance(state.get("growth_interval"), int) and state["growth_interval"] >= 1
          and isinstance(state.get("dynamic"), bool))
    if not ok:
        raise ConfigError(f"checkpoint {path}: meta.json's loss_scaler {state!r} is not a loss scaler's state "
                          f"(a finite scale > 0, good_steps >= 0, growth_interval >= 1, dynamic true or false)")


@dataclass
class RunSpec:
    """Everything a run needs, decided on every rank before the first message."""
    cfg: GPTConfig              # the model: flags > the checkpoint's > defaults
    dtype: type                 # np.float32 or np.float64 (--dtype)
    tokens: np.ndarray          # the whole corpus as byte tokens (--data or the built-in one)
    start: int                  # the first step to train: 0, or the checkpoint's step
    meta: dict | None           # --resume: the checkpoint's meta.json, else None
    state: dict | None          # --resume: its canonical model {name: array}
    ostate: dict | None         # --resume: its canonical optimizer state {"step", "m", "v"}
    layout: Layout              # the layout, world = dp * cp * tp * pp, with its flags resolved


def prepare(args, world: int) -> RunSpec:
    """Validate flags, outputs, layout, checkpoint and data. Raises ConfigError; sends nothing."""
    meta = state = ostate = None
    check_numbers(args)
    try:
        faults.load()
    except faults.FaultSpecError as e:
        raise ConfigError(str(e)) from None
    try:
        outputs.check(args)
    except outputs.OutputError as e:
        raise ConfigError(str(e)) from None
    if args.resume:
        try:
            state, ostate, meta = checkpoint.load(args.resume)
        except checkpoint.CheckpointError as e:
            raise ConfigError(str(e)) from None
    cfg = resolve_model(args, meta)
    if args.seed is None:
        args.seed = int(meta.get("seed", 0)) if meta is not None else 0
    elif meta is not None and args.seed != meta.get("seed", args.seed):
        raise ConfigError(f"--seed {args.seed} does not match the checkpoint {args.resume} "
                          f"(seed {meta['seed']})")
    validate(args, cfg)
    args.attn_block = resolve_attention(args)
    if meta is not None:
        check_checkpoint(args, cfg, state, meta)
    try:
        dp, tp, pp = check_layout(world, args.dp, args.tp, args.pp, args.cp)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    if args.timeline and pp == 1:
        raise ConfigError(f"--timeline {args.timeline} draws a pipeline: it needs --pp > 1")
    check_split(cfg, dp, tp, pp, args.batch_size, args.micro_batches)
    check_sequence_split(cfg, tp, args.sp)
    args.cp_layout = check_context_split(cfg, args)
    args.cp_impl = check_cp_impl(cfg, args, tp)
    check_moe(cfg, args, dp)
    check_schedule(cfg, pp, args.schedule, args.virtual_stages, args.micro_batches)
    args.dp_mode, args.bucket_mb = resolve_dp_flags(args)
    check_shard_group(args, dp * args.cp)
    args.prefetch, args.reshard_after_forward = resolve_gathers(args)
    args.qwz, args.hpz, args.qgz = resolve_zpp(args)
    if args.zero == 3 and pp > 1:
        raise ConfigError(f"--zero 3 does not combine with --pp {pp}: it would all-gather and "
                          f"release every stage's parameters around every micro-batch's forward "
                          f"and backward, as the schedule interleaves them (DeepSpeed does not "
                          f"combine them either); use --zero 1 or 2 with --pp")
    if meta is not None and meta.get("dtype", args.dtype) != args.dtype:
        raise ConfigError(f"--dtype {args.dtype} does not match the checkpoint {args.resume} "
                          f"({meta['dtype']})")
    if meta is not None and meta.get("precision", "fp32") != args.precision:
        raise ConfigError(f"--precision {args.precision} does not match "
                          f"the checkpoint {args.resume} "
                          f"({meta.get('precision', 'fp32')})")
    if meta is not None and "loss_scaler" in meta:
        check_scaler_state(meta["loss_scaler"], args.resume)
    if meta is not None and args.loss_scale_window is not None:
        raise ConfigError(f"--loss-scale-window sets a new run's scaler; --resume {args.resume} continues "
                          f"the checkpoint's (window "
                          f"{meta.get('loss_scaler', {}).get('growth_interval')})")
    if meta is not None and args.loss_scale is not None:
        raise ConfigError(f"--loss-scale sets a new run's initial scale; "
                          f"--resume {args.resume} continues "
                          f"the checkpoint's (scale {meta.get('loss_scaler', {}).get('scale')})")
    try:
        tokens = data.load_tokens(args.data, cfg.block_size)
    except data.DataError as e:
        raise ConfigError(str(e)) from None
    if tokens.max() >= cfg.vocab_size:
        raise ConfigError(f"the checkpoint {args.resume}'s vocabulary of {cfg.vocab_size} tokens does not hold "
                          f"the data's byte tokens (up to {tokens.max()}): the trainer's tokens are bytes")
    if meta is not None:
        want = meta.get("data", {})
        if want.get("sha256_16") not in (None, data.tokens_digest(tokens)):
            raise ConfigError(f"data {args.data or data.BUILTIN_NAME!r} "
                              f"({len(tokens):,} tokens) is not the data "
                              f"of the "
                              f"checkpoint {args.resume} "
                              f"({want.get('source')!r}, {want.get('tokens'):,} tokens)")
    start = 0 if meta is None else int(meta["step"])
    if start >= args.steps:
        raise ConfigError(f"--steps {args.steps} is not beyond the checkpoint's step {start}: "
                          f"nothing to train")
    return RunSpec(cfg, DTYPES[args.dtype], tokens, start, meta, state, ostate, Layout.from_flags(args, dp=dp))


def agree_on_errors(world_comm, err: ConfigError | None):
    """Every rank validated on its own; now all learn whether any failed, so that all exit 2
    together instead of the healthy ones waiting for the failed one. The lowest failing
    rank's message is the one printed."""
    g = comm.Group(world_comm)
    mine = np.array([g.rank if err is not None else g.size], dtype=np.int64)
    first = int(comm.all_reduce(g, mine, op="min")[0])
    if first == g.size:
        return g
    if err is not None and first == g.rank:
        raise err
    raise ConfigError(f"rank {first} rejected the configuration", quiet=True)
