"""--verify: the run checked against its single-process twin (docs/design.md §10).

After the last step every rank hands rank 0 its part of the canonical model; rank 0 then
re-runs the same steps on one process (train.py's own loop, from the same initial weights,
the same data and the same flags, with no parallelism) and compares, step by step:

    the losses               |a - b| / |b| per step
    the gradient norms       the norm clipping uses, before clipping, over every rank's
                             gradients with each parameter counted once
    the parameters           max|a - b| / max|b| per tensor, at the end

and judges each at VERIFY_RTOL of the run's dtype (fp16/bf16: the losses only). The run
exits 1 when any is beyond it. The verdict line prints every figure, the worst tensor and
what is reported but not judged (the key biases: `judged`).
"""
from __future__ import annotations

import argparse
import math

import numpy as np

from minipar.train import data
from minipar import trace
from minipar.train.checkpoint import canonical_state

# The relative tolerances (compare()). float64 and float32: losses and every parameter
# tensor. fp16/bf16: the twin is a different rounding of the same computation (its gradients
# are summed over the whole batch before the 2-byte rounding, not per dp rank), and two such
# trajectories drift apart in weight space while learning equally well: measured on
# L=2 C=64 with dp=2, losses agree to 2e-6 (fp16) / 4e-5 (bf16) over 20 steps and to
# 1e-2 to 2e-2 over 100 to 400 steps, while the whole-model parameter difference grows from
# 1e-4 to 1e-1. So the losses are judged, at 5e-2, and the parameters only reported.
VERIFY_RTOL = {"float64": 1e-10, "float32": 1e-4, "fp16": 5e-2, "bf16": 5e-2}
# ZeRO++'s qwZ and qgZ (zero/zpp.py) compute with int8-coded weights and gradients: each
# number within half its block's scale, max|block|/127, of the exact one. The twin computes
# with the exact ones, so the run is judged like fp16/bf16, on the losses, at the codes'
# resolution: a loss further than one code step, 1/127 relative, from the twin's is no
# rounding. (docs/zero.md gives the distances measured.)
QUANTIZED_RTOL = 1 / 127


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


def max_diff(a, b) -> tuple[float, float]:
    """(max |a - b|, max |a - b| / |b|). An entry non-finite in both (a gradient norm of a
    step that both runs skipped: inf) is left out; non-finite in one only, or a NaN loss,
    makes the difference NaN, which no tolerance accepts."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    keep = ~(np.isinf(a) & (a == b))
    if not keep.any():
        return 0.0, 0.0
    with np.errstate(invalid="ignore"):         # inf - inf: a NaN difference, which fails
        d = np.abs(a[keep] - b[keep])
        return float(d.max()), float(np.max(d / np.maximum(np.abs(b[keep]), 1e-300)))


def compare(losses, ref_losses, state, ref_state, norms=(), ref_norms=()) -> dict:
    """Largest absolute and relative differences; relative = |a - b| / |b| for losses and
    gradient norms (before clipping: the norm over every rank's gradients, each parameter
    once), and max|a - b| / max|b| per parameter tensor (biases start at 0: no elementwise
    ratio), without the key biases (`judged`; their largest difference is key_bias_abs).
    param_rel_global = ||a - b|| / ||b|| over all parameters at once: what --verify reports
    with --precision fp16/bf16 (see VERIFY_RTOL)."""
    loss_abs, loss_rel = max_diff(losses, ref_losses)
    norm_abs, norm_rel = max_diff(norms, ref_norms)
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
    return {"loss_abs": loss_abs, "loss_rel": loss_rel, "norm_abs": norm_abs, "norm_rel": norm_rel,
            "param_abs": p_abs, "param_rel": p_rel,
            "worst_param": worst, "param_rel_global": math.sqrt(diff_sq / max(ref_sq, 1e-300)),
            "key_bias_abs": key_bias}


def verdict(session, rows_log, ref_losses, ref_norms, state, ref_state) -> tuple[dict, str]:
    """compare() judged at VERIFY_RTOL (fp16/bf16, and ZeRO++'s quantized messages at
    QUANTIZED_RTOL: the losses judged, the gradient norms and parameters only reported), and
    the line that says so."""
    args = session.args
    quantized = bool(getattr(args, "qwz", 0) or getattr(args, "qgz", 0))
    mixed = args.precision != "fp32" or quantized
    d = compare([r["loss"] for r in rows_log], ref_losses, state, ref_state,
                [r["grad_norm"] for r in rows_log], ref_norms)
    tol = max(VERIFY_RTOL[args.precision if args.precision != "fp32" else args.dtype],
              QUANTIZED_RTOL if quantized else 0)
    d["tolerance"] = tol
    d["ok"] = d["loss_rel"] <= tol and (mixed or (d["norm_rel"] <= tol and d["param_rel"] <= tol))
    zero = f" zero={args.zero}" if args.zero else ""
    line = (f"verify: {session.grid.describe()}{zero} vs 1 process over {len(rows_log)} "
            f"steps: loss max |diff| {d['loss_abs']:.3e} (rel {d['loss_rel']:.3e}), grad norm rel "
            f"{d['norm_rel']:.3e}, parameters max |diff| "
            f"{d['param_abs']:.3e} (rel {d['param_rel']:.3e}, {d['worst_param']}"
            + (f"; whole model rel {d['param_rel_global']:.3e}, not judged" if mixed else "")
            + f"; key biases, not judged: max |diff| {d['key_bias_abs']:.1e}"
            + f"); tolerance {tol:g} relative" + (" on losses" if mixed else "")
            + (" (ZeRO++'s int8 codes: one code step)" if quantized else "")
            + f" -> {'OK' if d['ok'] else 'FAILED'}")
    return d, line


def run_twin(spec, args, start: int, stop: int):
    """The same steps on one process, from the same weights and data (and the same
    --precision: the fp32 master weights are compared), attending plainly (--attention tiled is
    checked against the plain attention). -> (losses, gradient norms before clipping, the
    final canonical state)."""
    from minipar.train import trainer as train          # noqa: PLC0415 - the twin is the trainer's own loop
    args = argparse.Namespace(**{**vars(args), "attention": "plain", "attn_block": None})
    model, opt = train.init_model(spec, args)
    sampler = data.Sampler(spec.tokens, spec.cfg.block_size, args.batch_size, args.seed)
    s = train.Session(args, model, opt, sampler, spec=spec)
    rows = list(train.train_steps(s, start, stop))
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows], canonical_state(s.model, s.opt)


def verify(session, rows_log, summary: dict):
    """Rank 0 re-runs the steps on one process and compares; summary["verify"] gets the
    figures and the verdict line is printed. Collective: every rank hands in its state."""
    state = canonical_state(session.model, session.opt)                 # collective over tp, pp (and dp with ZeRO)
    if session.grid.rank != 0:
        return
    session.say(f"verify: re-running steps {session.spec.start}..{session.args.steps - 1} on one process ...")
    with trace.span("verify twin", "verify"), trace.paused():     # --trace: one span
        ref_losses, ref_norms, ref_state = run_twin(session.spec, session.args, session.spec.start, session.args.steps)
    summary["verify"], line = verdict(session, rows_log, ref_losses, ref_norms, state, ref_state)
    session.say(line)
