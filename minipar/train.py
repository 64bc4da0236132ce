"""The trainer: python -m minipar.train [flags]   (see --help, and DESIGN 2.7)

One process for now: the model, AdamW, the step-indexed sampler, gradient accumulation
over micro-batches, checkpoints, a JSONL log, a progress line and a closing summary.
Parallel layouts plug into the same loop as they land.

Each step:  for each micro-batch: loss = model(x, y, loss_denom=B*T); loss.backward()
            grad_norm = clip(grads); lr = schedule(step); AdamW step
Dividing every micro-batch loss by the global token count B*T (not by its own size) makes
the accumulated gradient exactly the gradient of the mean loss over the global batch.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

from minipar import checkpoint, data
from minipar.model import GPT, GPTConfig, train_flops_per_token
from minipar.optim import AdamW, clip_grad_norm, lr_at
from minipar.perf import human_bytes, keep_freed_memory, matmul_peak_flops
from minipar.tensor import no_grad

MODEL_DEFAULTS = dict(n_layer=4, n_head=4, n_embd=128, block_size=64)
DTYPES = {"float32": np.float32, "float64": np.float64}


class ConfigError(ValueError):
    """Bad flags: reported as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minipar.train",
        description="Train a small GPT-2 on a NumPy autograd engine (single process for now).")
    m = p.add_argument_group("model (unset: the checkpoint's value on --resume, else the default shown)")
    m.add_argument("--n-layer", type=int, metavar="L", help=f"transformer blocks [{MODEL_DEFAULTS['n_layer']}]")
    m.add_argument("--n-head", type=int, metavar="H", help=f"attention heads [{MODEL_DEFAULTS['n_head']}]")
    m.add_argument("--n-embd", type=int, metavar="C", help=f"channels, divisible by H [{MODEL_DEFAULTS['n_embd']}]")
    m.add_argument("--block-size", type=int, metavar="T", help=f"context length [{MODEL_DEFAULTS['block_size']}]")
    m.add_argument("--untied", action="store_true", help="separate lm_head.weight instead of wte.T")
    t = p.add_argument_group("training")
    t.add_argument("--batch-size", type=int, metavar="B", default=16, help="global batch B, in sequences [%(default)s]")
    t.add_argument("--micro-batches", type=int, metavar="M", default=1, help="gradient accumulation: B is split into M [%(default)s]")
    t.add_argument("--steps", type=int, metavar="S", default=600, help="the step number the run ends at (steps count from 0) [%(default)s]")
    t.add_argument("--lr", type=float, default=2e-3, help="peak learning rate [%(default)s]")
    t.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine", help="[%(default)s]")
    t.add_argument("--warmup", type=int, default=20, help="linear warm-up steps [%(default)s]")
    t.add_argument("--min-lr", type=float, default=1e-4, help="cosine decays to this [%(default)s]")
    t.add_argument("--weight-decay", type=float, default=0.1, help="[%(default)s]")
    t.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm; 0 disables [%(default)s]")
    t.add_argument("--seed", type=int, help="seeds init and data sampling [0; on --resume the checkpoint's]")
    t.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="[%(default)s]")
    io = p.add_argument_group("data, checkpoints, output")
    io.add_argument("--data", metavar="FILE", help="UTF-8 text to train on (default: the built-in corpus)")
    io.add_argument("--save", metavar="DIR", help="write a checkpoint here at the end (and every --save-every)")
    io.add_argument("--save-every", type=int, default=0, metavar="N", help="also checkpoint every N steps [%(default)s]")
    io.add_argument("--resume", metavar="DIR", help="continue exactly from this checkpoint")
    io.add_argument("--log", metavar="FILE.jsonl", help="one JSON object per step, then a summary object")
    io.add_argument("--log-every", type=int, default=0, metavar="N",
                    help="progress line every N steps (0: about 20 lines per run)")
    io.add_argument("--sample", type=int, default=200, metavar="N", help="bytes of text to generate at the end [%(default)s]")
    return p


def resolve_model(args, meta: dict | None) -> GPTConfig:
    """Explicit flag > checkpoint > default; an explicit flag that contradicts the checkpoint is an error."""
    saved = (meta or {}).get("config", {})
    values = {}
    for key, default in MODEL_DEFAULTS.items():
        flag = getattr(args, key)
        if flag is not None and key in saved and flag != saved[key]:
            raise ConfigError(f"--{key.replace('_', '-')} {flag} does not match the checkpoint "
                              f"{args.resume} ({key} = {saved[key]})")
        values[key] = flag if flag is not None else saved.get(key, default)
    tied = not args.untied
    if meta is not None and args.untied and saved.get("tie_embeddings", True):
        raise ConfigError(f"--untied does not match the checkpoint {args.resume} (tied embeddings)")
    if meta is not None:
        tied = saved.get("tie_embeddings", True)
    return GPTConfig(vocab_size=256, tie_embeddings=tied, **values)


def validate(args, cfg: GPTConfig):
    for flag in ("n_layer", "n_head", "n_embd", "block_size"):
        if getattr(cfg, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {getattr(cfg, flag)}")
    for flag in ("batch_size", "micro_batches", "steps"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if cfg.n_embd % cfg.n_head:
        raise ConfigError(f"--n-embd {cfg.n_embd} is not divisible by --n-head {cfg.n_head}")
    if args.batch_size % args.micro_batches:
        raise ConfigError(f"--batch-size {args.batch_size} is not divisible by --micro-batches {args.micro_batches}")
    if args.lr <= 0:
        raise ConfigError(f"--lr must be > 0, got {args.lr}")
    for flag in ("min_lr", "grad_clip", "warmup", "save_every", "weight_decay", "seed", "log_every", "sample"):
        if getattr(args, flag) < 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")


def memory_report(model: GPT, opt: AdamW) -> dict:
    """Bytes this process holds for model states, beside the formula (fp32/fp64: Adam keeps
    m and v, so params + grads + optimizer = s*P + s*P + 2s*P for an s-byte dtype)."""
    P, s = model.num_params(), model.dtype.itemsize
    return {
        "params": sum(p.data.nbytes for p in model.parameters()),
        "grads": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
        "optimizer": opt.state_bytes(),
        "formula": {"params": s * P, "grads": s * P, "optimizer": 2 * s * P,
                    "text": f"{s}P + {s}P + {2 * s}P"},
    }


def tokens_digest(tokens: np.ndarray) -> str:
    return hashlib.sha256(tokens.tobytes()).hexdigest()[:16]


def save_checkpoint(path, model: GPT, opt: AdamW, cfg: GPTConfig, args, next_step: int, tokens):
    names = [n for n, _ in model.named_parameters()]
    checkpoint.save(path, model.state_dict(),
                    {"step": opt.step_count, "m": dict(zip(names, opt.m)), "v": dict(zip(names, opt.v))},
                    {"config": cfg.to_dict(), "step": next_step, "dtype": args.dtype,
                     "layout": {"dp": 1, "tp": 1, "pp": 1, "zero": 0},
                     "data": {"source": args.data or data.BUILTIN_NAME, "tokens": int(len(tokens)),
                              "sha256_16": tokens_digest(tokens), "position": next_step},
                     "seed": args.seed, "batch_size": args.batch_size})


def restore(model: GPT, opt: AdamW, state, ostate, path):
    try:
        model.load_state_dict(state)
    except ValueError as e:
        raise ConfigError(f"checkpoint {path}/model.npz does not match the model: {e}") from None
    names = [n for n, _ in model.named_parameters()]
    missing = [n for n in names if n not in ostate["m"] or n not in ostate["v"]]
    if missing:
        raise ConfigError(f"checkpoint {path}/optim.npz lacks state for {missing[:3]}")
    opt.step_count = ostate["step"]
    for n, m, v in zip(names, opt.m, opt.v):
        m[...], v[...] = ostate["m"][n], ostate["v"][n]


class Printer:
    """Progress and summary on stdout (rank 0 only, once there are ranks)."""

    def __init__(self, enabled=True):
        self.enabled = enabled

    def __call__(self, *a, **k):
        if self.enabled:
            print(*a, **k, flush=True)


def run(args) -> dict:
    say = Printer()
    meta = None
    if args.resume:
        try:
            state, ostate, meta = checkpoint.load(args.resume)
        except checkpoint.CheckpointError as e:
            raise ConfigError(str(e)) from None
    cfg = resolve_model(args, meta)
    if args.seed is None:
        args.seed = int(meta.get("seed", 0)) if meta is not None else 0
    elif meta is not None and args.seed != meta.get("seed", args.seed):
        raise ConfigError(f"--seed {args.seed} does not match the checkpoint {args.resume} (seed {meta['seed']})")
    validate(args, cfg)
    dtype = DTYPES[args.dtype]
    if meta is not None and meta.get("dtype", args.dtype) != args.dtype:
        raise ConfigError(f"--dtype {args.dtype} does not match the checkpoint {args.resume} ({meta['dtype']})")
    try:
        tokens = data.load_tokens(args.data, cfg.block_size)
    except data.DataError as e:
        raise ConfigError(str(e)) from None
    if meta is not None:
        want = meta.get("data", {})
        if want.get("sha256_16") not in (None, tokens_digest(tokens)):
            raise ConfigError(f"data {args.data or data.BUILTIN_NAME!r} ({len(tokens):,} tokens) is not the data of the "
                              f"checkpoint {args.resume} ({want.get('source')!r}, {want.get('tokens'):,} tokens)")
    start = 0 if meta is None else int(meta["step"])
    if start >= args.steps:
        raise ConfigError(f"--steps {args.steps} is not beyond the checkpoint's step {start}: nothing to train")

    sampler = data.Sampler(tokens, cfg.block_size, args.batch_size, args.seed)
    model = GPT(cfg, seed=args.seed, dtype=dtype)
    opt = AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if meta is not None:
        restore(model, opt, state, ostate, args.resume)

    B, T, M = args.batch_size, cfg.block_size, args.micro_batches
    mb = B // M
    flops_step = train_flops_per_token(cfg, T) * B * T
    peak = matmul_peak_flops(dtype, seconds=0.1)
    log_every = args.log_every or max(1, (args.steps - start) // 20)
    try:
        logf = open(args.log, "w") if args.log else None
    except OSError as e:
        raise ConfigError(f"--log {args.log}: {e.strerror}") from None
    source = args.data or f"{data.BUILTIN_NAME} corpus"
    say(f"minipar: GPT L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd} T={T} V={cfg.vocab_size} "
        f"({'tied' if cfg.tie_embeddings else 'untied'}), {model.num_params():,} params, {args.dtype}")
    say(f"  layout: 1 process (dp=1 tp=1 pp=1); batch {B} x {T} tokens, {M} micro-batch(es) of {mb}")
    say(f"  data: {source}, {len(tokens):,} tokens; steps {start}..{args.steps - 1}; "
        f"lr {args.lr:g} {args.lr_schedule}, warm-up {args.warmup}"
        + (f"; resumed from {args.resume}" if meta is not None else ""))

    first_loss = None
    t_run = time.perf_counter()
    tok_total = 0
    for step in range(start, args.steps):
        t0 = time.perf_counter()
        lr = lr_at(step, args.lr, args.lr_schedule, args.warmup, args.steps, args.min_lr)
        opt.lr = lr
        opt.zero_grad()
        loss_sum = 0.0
        for k in range(M):
            x, y = sampler.batch(step, k * mb, (k + 1) * mb)          # (B/M, T)
            loss = model(x, y, loss_denom=B * T)
            loss.backward()
            loss_sum += loss.item()
        norm = clip_grad_norm(model.parameters(), args.grad_clip)
        opt.step()
        dt = time.perf_counter() - t0
        tok_total += B * T
        first_loss = loss_sum if first_loss is None else first_loss
        row = {"step": step, "loss": loss_sum, "lr": lr, "grad_norm": norm, "tokens_per_s": B * T / dt,
               "comm_bytes": 0, "mfu": flops_step / dt / peak, "step_time": dt}
        if logf:
            logf.write(json.dumps(row) + "\n")
        if (step - start) % log_every == 0 or step == args.steps - 1:
            say(f"step {step:5d} | loss {loss_sum:.4f} | lr {lr:.2e} | norm {norm:7.3f} | "
                f"{row['tokens_per_s']:8.0f} tok/s | MFU {row['mfu']:5.1%} | comm 0 B")
        if args.save and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            save_checkpoint(args.save, model, opt, cfg, args, step + 1, tokens)
    elapsed = time.perf_counter() - t_run

    if args.save:
        save_checkpoint(args.save, model, opt, cfg, args, args.steps, tokens)
    val = data.Sampler(tokens, T, B, args.seed, split="val")
    with no_grad():
        val_loss = float(np.mean([model(*val.batch(s)).item() for s in range(4)]))
    mem = memory_report(model, opt)
    summary = {"summary": True, "params_count": model.num_params(), "steps": args.steps - start,
               "first_loss": first_loss, "final_loss": loss_sum, "val_loss": val_loss,
               "unigram_entropy": data.unigram_entropy(tokens),
               "tokens_per_s": tok_total / elapsed, "mfu": flops_step * (args.steps - start) / elapsed / peak,
               "peak_flops": peak, "seconds": elapsed, "memory": mem,
               "layout": {"dp": 1, "tp": 1, "pp": 1, "zero": 0}}
    if logf:
        logf.write(json.dumps(summary) + "\n")
        logf.close()

    f = mem["formula"]
    say(f"summary: {summary['steps']} steps in {elapsed:.1f} s, {summary['tokens_per_s']:,.0f} tok/s, "
        f"MFU {summary['mfu']:.1%} of a {peak / 1e9:.0f} GFLOP/s {args.dtype} matmul peak")
    say(f"  loss {first_loss:.3f} -> {loss_sum:.3f} (val {val_loss:.3f}); a model that ignores context "
        f"scores {summary['unigram_entropy']:.3f} nats (the unigram entropy of the data)")
    say(f"  memory per rank: params {human_bytes(mem['params'])}, grads {human_bytes(mem['grads'])}, "
        f"optimizer {human_bytes(mem['optimizer'])}; formula {f['text']} = "
        f"{human_bytes(f['params'])} + {human_bytes(f['grads'])} + {human_bytes(f['optimizer'])}")
    if args.save:
        say(f"  checkpoint: {args.save} (step {args.steps})")
    if args.sample > 0:
        prompt = "The pipeline"
        out = model.generate(data.encode(prompt)[None].astype(np.int64), args.sample,
                             rng=np.random.default_rng(args.seed))
        say("sample:\n  " + data.decode(out[0]).replace("\n", "\n  "))
    return summary


def main(argv=None):
    args = build_parser().parse_args(argv)
    keep_freed_memory()
    try:
        run(args)
    except ConfigError as e:
        print(f"minipar.train: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
