"""ZeRO's sharded optimizer: AdamW on this rank's shard of every unit, beside the stage's
gradient synchroniser (stage1.py, stage2.py, stage3.py), whose units it shares.
"""
from __future__ import annotations

import numpy as np

from minipar import comm
from minipar.optim.adamw import adamw_update
from minipar.optim.mixed_precision import MixedPrecisionAdamW, optimizer_bytes_per_param
from minipar.parallel.zero.formulas import formula


class ShardedAdamW:
    """The sharded optimizer (lr, step, step_count, scaler, and the state checkpoints read:
    units[i].m, .v, .master, gather_local). Built from the plain optimizer (AdamW or
    MixedPrecisionAdamW) after any checkpoint has been loaded into it; its state lives on in
    the units' shards (build.build drops the full one). layout: the stage (Stage1, Stage2
    or Stage3), which keeps the parameters and the gradient shards the update reads."""

    def __init__(self, opt, units: list, layout):
        self.units, self.layout = units, layout
        self.lr, self.betas, self.eps, self.weight_decay = opt.lr, opt.betas, opt.eps, opt.weight_decay
        self.step_count = opt.step_count
        self.mixed = isinstance(opt, MixedPrecisionAdamW)                # fp32 master weights
        self.scaler = opt.scaler if self.mixed else None
        self.dtype = layout.dtype                                        # storage dtype

    def step(self, grad_scale: float = 1.0):
        """AdamW on this rank's shards, then (stages 1 and 2) the all-gather that rebuilds
        the full parameters. grad_scale: the clip factor (over the loss scale with mixed precision)."""
        self.step_count += 1
        for u in self.units:
            w_shard = self.layout.own_params(u)
            for p, sh, _ in u.segments:
                g = u.grad_shard[sh].astype(np.float32) if self.mixed else u.grad_shard[sh]
                wd = self.weight_decay if p.data.ndim >= 2 else 0.0
                target = u.master[sh] if self.mixed else w_shard[sh]
                adamw_update(target, g, u.m[sh], u.v[sh], self.step_count, self.lr, self.betas, self.eps, wd,
                             grad_scale=grad_scale)
                if self.mixed:
                    w_shard[sh] = target                                  # round into the model
            self.layout.after_update(u, w_shard)

    # --- the memory report ------------------------------------------------------------------
    def state_bytes(self) -> int:
        return sum(u.m.nbytes + u.v.nbytes + (u.master.nbytes if self.mixed else 0) for u in self.units)

    def memory_report(self) -> dict:
        """Bytes this rank holds in its persistent buffers, beside the formula."""
        z = self.layout
        itemsize = self.dtype.itemsize
        K = optimizer_bytes_per_param(self.mixed, itemsize)
        f = formula(z.stage, z.P, z.P_pad, z.N, itemsize, K)
        hybrid = f", shard groups of N ranks, R = {z.R} replicas of each shard" if z.R > 1 else ""
        f["text"] = f"{f['text']} (P = {z.P:,} on this rank, N = {z.N}{hybrid}, padded to {z.P_pad:,})"
        spread = [u for u in self.units if u.N != z.N]              # experts: over their replicas
        if spread:
            f = self._formula_with_experts(spread, itemsize, K)
        return {"params": z.param_bytes(), "grads": z.grad_bytes(), "optimizer": self.state_bytes(), "formula": f,
                "zero": {"stage": z.stage, "N": z.N, "R": z.R, "P": z.P, "P_padded": z.P_pad,
                         "padding": z.padding, "units": len(self.units)}}

    def _formula_with_experts(self, spread, itemsize, K) -> dict:
        """The formula, summed over the two kinds of unit: P over N dp ranks, and the experts'
        P_e over their N_e replicas."""
        z = self.layout
        ids = {id(u) for u in spread}
        plain = [u for u in self.units if id(u) not in ids]
        P, P_pad = sum(u.n for u in plain), sum(u.n_pad for u in plain)
        Pe, Pe_pad, Ne = sum(u.n for u in spread), sum(u.n_pad for u in spread), spread[0].N
        a = formula(z.stage, P, P_pad, z.N, itemsize, K)
        b = formula(z.stage, Pe, Pe_pad, Ne, itemsize, K)
        f = {k: a[k] + b[k] for k in ("params", "grads", "optimizer")}
        f["text"] = (f"{a['text']} + experts' {b['text'].replace('P', 'P_e').replace('N', 'N_e')} (P = {P:,}, "
                     f"N = {z.N}; P_e = {Pe:,}, N_e = {Ne}; padded)")
        return f

    # --- whole tensors again (checkpoints, --verify, the replica check) ---------------------
    def gather_local(self, kind: str) -> dict:
        """{name: this rank's (tp/pp-local) full array} of "params", "master", "m" or "v":
        each unit's shards all-gathered over dp (collective)."""
        out = {}
        for u in self.units:
            if kind == "params" or (kind == "master" and not self.mixed):
                shard = self.layout.own_params(u)
            else:
                shard = getattr(u, kind)
            flat = comm.all_gather(u.group, np.ascontiguousarray(shard))
            for n, a in zip(u.names, u.unflatten(flat)):
                out[n] = a.copy()
        return out
