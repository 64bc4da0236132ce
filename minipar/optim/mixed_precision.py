"""Mixed precision: fp16 or bf16 storage, fp32 compute, fp32 master weights, loss scaling
(Micikevicius et al., "Mixed Precision Training", 2018; PyTorch's GradScaler).

What is stored in which precision (`--precision fp16|bf16`; fp32 changes nothing):

    model parameters p.data        fp16/bf16   2 bytes  what forward and backward read
    gradients p.grad               fp16/bf16   2 bytes  what backward writes, and what data
                                                        parallelism all-reduces (half the bytes)
    activations between ops        fp16/bf16            (saved ones partly fp32, see below)
    master weights                 fp32        4 bytes  } in the optimizer:
    Adam's m and v                 fp32        8 bytes  } MixedPrecisionAdamW
    the loss, the loss scale       fp32
                                   -> 2P + 2P + 12P bytes for P parameters (fp32: 4P + 4P + 8P)

Compute is fp32. Every op widens its float16/bfloat16 inputs to float32 (`compute`), does
its arithmetic there and rounds what it returns back to the storage dtype (`store`):
matmuls accumulate in fp32 as tensor cores do (NumPy's own float16 matmul is ~40x slower
than float32), and reductions such as LayerNorm's mean never sum in 11 bits. Ops that save
fp32 intermediates for backward (LayerNorm, GELU, attention) keep them in fp32.

Why fp32 master weights. An AdamW step moves a weight by about lr or less (2e-3 down to
1e-4 with the default schedule). Near 1.0 (a LayerNorm gain) fp16's numbers are 2^-10 =
9.8e-4 apart and bf16's 2^-7 = 7.8e-3, so `w -= update` done in 2 bytes rounds back to w
whenever the update is under half that spacing, and weight decay's factor 1 - lr*wd =
0.9998 is exactly 1 in both: the model would stop learning. The optimizer therefore keeps
an fp32 copy of every weight, applies the update to it, and rounds the result into the
model's 2-byte parameter after each step (`p.data[...] = master`), so small updates
accumulate in the master until they show.

Why loss scaling (fp16 only). fp16 has 5 exponent bits: gradients below 2^-14 lose
precision and below 2^-24 become zero. Multiplying the loss by S (in practice: seeding backward with S instead of 1)
shifts every gradient up by S into fp16's range; the optimizer divides by S again, in
fp32, before clipping and AdamW. Too large an S overflows to inf. PyTorch GradScaler's
dynamic rule (its defaults): start at S = 2^16; if any gradient on any rank is inf or NaN,
skip the step (no parameter, no m, v, no step count changes) and halve S; after 2000
clean steps in a row, double S. bf16 has fp32's 8 exponent bits, so it needs no scaling:
its scale stays 1, but a non-finite gradient still skips the step (it would poison the
master weights) -- it never happens in a healthy run.

Agreeing on a skip: each rank checks the gradients it holds (`local_found_inf`), then the
trainer (train.train_step) all-reduces that flag with op max over the whole world (one
all-reduce of 8 bytes per step), so an overflow in any gradient on any rank skips the step on every rank, and the
tp shards, pp stages and dp replicas stay in step. (Megatron all-reduces its found_inf over
the model-parallel group only: dp replicas hold the same summed gradients, into which any
replica's inf has flowed. The world is one group more than needed, never wrong.)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar.autograd.dtypes import bfloat16
from minipar.optim.adamw import AdamW, adamw_update

PRECISIONS = ("fp32", "fp16", "bf16")


def storage_dtype(precision: str):
    """The 2-byte dtype parameters and gradients are stored in, or None for fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r} ({', '.join(PRECISIONS)})")
    if precision == "fp32":
        return None
    return np.dtype(np.float16) if precision == "fp16" else bfloat16()


# --- dynamic loss scaling ---------------------------------------------------------------------

@dataclass
class LossScaler:
    """PyTorch GradScaler's rule. dynamic=False (bf16): the scale stays put, but a
    non-finite gradient still skips the step."""
    scale: float = 2.0 ** 16        # the loss is multiplied by this before backward
    growth_factor: float = 2.0      # after growth_interval clean steps in a row
    backoff_factor: float = 0.5     # on a step with an inf/NaN gradient (the step is skipped)
    growth_interval: int = 2000
    good_steps: int = 0             # clean steps since the last change of scale
    dynamic: bool = True

    def update(self, found_inf: bool):
        """After every step: back off (the step was skipped) or count towards growth."""
        if not self.dynamic:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "growth_interval": self.growth_interval,
                "dynamic": self.dynamic}

    def load_state_dict(self, state: dict):
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
        self.growth_interval, self.dynamic = int(state["growth_interval"]), bool(state["dynamic"])


def make_scaler(precision: str, init_scale: float | None = None, growth_interval: int | None = None) -> LossScaler:
    """fp16: dynamic, from init_scale (default 2^16), doubling after growth_interval clean
    steps (default 2000); bf16: a fixed scale of 1."""
    if precision == "fp16":
        return LossScaler(scale=2.0 ** 16 if init_scale is None else float(init_scale),
                          growth_interval=2000 if growth_interval is None else int(growth_interval))
    return LossScaler(scale=1.0, dynamic=False)


def backward_seed(scale: float):
    """The gradient to start backward from: d(S * loss)/d loss = S (None: the default 1)."""
    return None if scale == 1.0 else np.asarray(scale, dtype=np.float32)


# --- fp32 master weights in the optimizer ------------------------------------------------------

def optimizer_bytes_per_param(mixed: bool, itemsize: int) -> int:
    """K, the optimizer's bytes per parameter: AdamW's m and v in the parameters' dtype,
    2 * itemsize; with fp16/bf16 (mixed) the fp32 master weights, m and v, 4 + 4 + 4 = 12."""
    return 12 if mixed else 2 * itemsize


class MixedPrecisionAdamW(AdamW):
    """AdamW on fp32 master weights for a model whose parameters are stored in 2 bytes.

    Built on the model's parameters while they are still float32: their values become the
    master weights (held here), and the parameters are rounded to `dtype` in place. Its
    state is master + m + v, all float32: 12 bytes per parameter.

    step(grad_scale): each low-precision gradient is widened to fp32 and multiplied by
    grad_scale (= clip coefficient / loss scale: unscaling and clipping in fp32), AdamW
    updates the master weights, and the parameter gets the master rounded to `dtype`.
    A skipped step is simply not calling step(): nothing here changes, not even step_count.
    """

    def __init__(self, params, dtype, lr: float = 3e-4, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.1, scaler: LossScaler | None = None):
        params = list(params)
        for p in params:
            if p.data.dtype != np.float32:
                raise ValueError(f"master weights are taken from float32 parameters; {p.name} is {p.data.dtype}")
        super().__init__(params, lr, betas, eps, weight_decay)       # m, v: float32 like p.data
        self.dtype = np.dtype(dtype)
        self.master = [p.data for p in params]                        # the fp32 weights move here
        for p in params:
            p.data = p.data.astype(self.dtype)                        # the model keeps a 2-byte copy
        self.scaler = scaler if scaler is not None else LossScaler(scale=1.0, dynamic=False)

    def step(self, grad_scale: float = 1.0):
        self.step_count += 1
        for p, w, m, v in zip(self.params, self.master, self.m, self.v):
            if p.grad is None:
                continue
            g = p.grad.astype(np.float32)                             # (..) fp32
            wd = self.weight_decay if w.ndim >= 2 else 0.0            # unscale (and clip) in fp32:
            adamw_update(w, g, m, v, self.step_count, self.lr, self.betas, self.eps, wd,
                         grad_scale=grad_scale)                       # inside AdamW's passes
            p.data[...] = w                                           # round into the model

    def load_master(self, arrays):
        """Set the master weights (fp32, this rank's shapes) and round them into the model."""
        for p, w, a in zip(self.params, self.master, arrays):
            w[...] = a
            p.data[...] = w

    def state_bytes(self) -> int:
        return super().state_bytes() + sum(w.nbytes for w in self.master)


def local_found_inf(params) -> bool:
    """Does any gradient this rank holds contain inf or NaN? (The trainer then all-reduces
    the answer over the world: see the module docstring.)"""
    return any(p.grad is not None and not np.isfinite(p.grad).all() for p in params)


def summary(mode: str, storage_dtype: str, scaler, optimizer_steps: int, rows_log: list) -> tuple[dict, list[str]]:
    """The summary's `precision` figures: the steps skipped on an inf/NaN (the rows'
    "skipped"), the loss scaler's state at the end, the optimizer steps taken."""
    skips = [r["step"] for r in rows_log if r["skipped"]]
    out = {"mode": mode, "storage_dtype": storage_dtype, "loss_scale_final": scaler.scale,
           "dynamic_scaling": scaler.dynamic, "skipped_steps": len(skips), "first_skipped": skips[:10],
           "optimizer_steps": optimizer_steps}
    return out, [f"  precision {mode}: {len(skips)} of {len(rows_log)} steps skipped"
                 + (f" (steps {', '.join(map(str, skips[:10]))}{' ...' if len(skips) > 10 else ''})"
                    if skips else "")
                 + (f"; loss scale now {scaler.scale:g}, {scaler.good_steps} clean steps since its last change"
                    if scaler.dynamic else "")]
