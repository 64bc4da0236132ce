"""Memory per device, by formula: model states and saved activations at the schedule's peak,
the trainer's check of a layout against what a rank may use, and the longest sequence that
fits a budget.

Memory per device (ZeRO, Rajbhandari et al. 2020, arXiv:1910.02054, section 3):
    s   bytes per stored parameter and gradient (`itemsize`): 4 (fp32), 8 (float64),
        2 (fp16, bf16)
    K   optimizer bytes per parameter: AdamW's m and v, 2s; fp16/bf16 12 (fp32 master, m, v),
        which gives the paper's 2P + 2P + KP with K = 12
    P_local  parameters the device holds after tp and pp slicing (pipeline.local_tensors):
             the stage's tensors (schedules.stage_param_names; the last stage keeps a copy
             of a tied wte), split ones / tp, vocabulary ones padded to Vp = tp*ceil(V/tp)
             rows first
    P_pad    ZeRO's layout: P_local cut into units (zero.unit_names), each padded to a
             multiple of N = dp*cp (zero.padded)
    S        the ranks a unit is sharded over: N, or with --shard-group S (hybrid sharding,
             zero/hybrid.py) the S ranks of a shard group, each shard replicated over R = N/S
             (layout.zero_split): the table below with S in place of N
                   params        grads         optimizer        (zero.formula)
        zero 0     s P_local     s P_local     K P_local
        zero 1     s P_pad       s P_pad       K P_pad / S
        zero 2     s P_pad       s P_pad / S   K P_pad / S
        zero 3     s P_pad / S   s P_pad / S   K P_pad / S
    (fp16, no padding, flat: 16P, 4P + 12P/N, 2P + 14P/N, 16P/N.)
    activations: the bytes minipar's ops save for backward (activation_bytes), per
    micro-batch of b = B/(dp*M) sequences, at the stage's peak: its own instruction list
    walked, + a chunk's bytes at each Forward, - at its Backward (at its WeightGrad with
    zb-h1/zb-h2), the largest sum (activations.peak_in_flight_bytes). Whole micro-batches
    for V = 1: 1 without a pipeline and with the naive schedule, M with GPipe,
    min(M, pp - stage) with 1F1B; --virtual-stages V > 1 counts chunk-micro-batches.

The sequence-length ceiling (--memory-budget M): the longest T, a multiple of 2*cp (and of
cp*tp with --sp), whose per-device peak (model states + activations at the schedule's peak,
the largest stage's) fits in M, for cp = 1 and for the given cp, each with the same dp, tp,
pp (the learned positions' table grows with T: the planner takes the block size to be T).
The peak only grows with T (activations per token times T, the softmax's T^2, wpe's T*C
parameters, ZeRO's padding of them), so the search is a bisection: double T from 2*cp
while it fits, then halve the interval between the last T that fits and the first that does not.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

from minipar.config import flags as config
from minipar.model.gpt import GPTConfig
from minipar.parallel.layout import Layout
from minipar.parallel.zero import formulas as zero
from minipar.parallel.zero.units import padded, unit_names
from minipar.plan import activations
from minipar.plan.layout import chunks, device_tensors, itemsizes, sync_groups, zero_split, zero_units
from minipar.comm.ledger import human_bytes


def model_states(P_local: int, P_pad: int, itemsize: int, K: int, zero_stage: int, N: int) -> dict:
    """Bytes of parameters, gradients and optimizer state on one device (zero.formula), and
    their sum."""
    f = zero.formula(zero_stage, P_local, P_pad, N, itemsize, K)
    return {"params": f["params"], "grads": f["grads"], "optimizer": f["optimizer"],
            "model_states": f["params"] + f["grads"] + f["optimizer"]}


def activation_bytes(cfg: GPTConfig, stage: int, pp: int, tp: int, rows: int, itemsize: int,
                     compute_itemsize: int, sp: bool = False, recompute: str = "none") -> int:
    """Bytes one micro-batch of `rows` sequences leaves saved for backward on a device of
    `stage`: activations.stage_bytes (the formula, term by term, and Korthikanti's Table 2)."""
    return activations.stage_bytes(cfg, stage, pp, tp, rows, itemsize, compute_itemsize, sp, recompute)


def device_memory(cfg: GPTConfig, lay, stage: int) -> dict:
    """What a device of `stage` holds at its peak: model states (ZeRO over dp*cp ranks, or
    over the S of a shard group) and the saved activations of the micro-batches its schedule
    holds at once."""
    itemsize, compute_itemsize, K = itemsizes(lay)
    V = chunks(lay)
    tensors = device_tensors(cfg, lay, stage)
    states, P_pad = {}, 0
    for ts, g in sync_groups(tensors, lay):          # with --ep, ZeRO's expert units over their replicas
        units = zero_units(ts, g.grad_ranks, cfg.family)
        part = model_states(sum(n for _, n in ts), sum(units), itemsize, K, lay.zero, zero_split(lay, g)[0])
        states = {k: states.get(k, 0) + v for k, v in part.items()}
        P_pad += sum(units)
    act, held = activations.peak_in_flight_bytes(cfg, lay.schedule, stage, lay.pp, V, lay.micro_batches, lay.tp,
                                                 lay.rows, itemsize, compute_itemsize, lay.sp, lay.recompute,
                                                 cp=lay.cp, ep=lay.ep, cp_impl=lay.cp_impl,
                                                 cp_ulysses=lay.cp_ulysses)
    gathered = gathered_bytes(cfg, lay, tensors, itemsize)
    return {**states, "activations": act, "gathered": gathered, "total": states["model_states"] + act + gathered,
            "stage": stage, "micro_batches_in_flight": held, "params_local": sum(n for _, n in tensors),
            "params_padded": P_pad}


def gathered_bytes(cfg: GPTConfig, lay, tensors: list, itemsize: int) -> int:
    """ZeRO-3's gathered parameters at their peak (zero.formulas.gathered_peak, what the
    trainer's summary measures): the embedding-side units and the largest --prefetch + 1
    consecutive blocks, or every block with --reshard-after-forward off; 0 below stage 3."""
    if lay.zero != 3:
        return 0
    size, N = dict(tensors), lay.grad_ranks
    units = unit_names([n for n, _ in tensors], cfg.family)
    outer, blocks = 0, {}
    for names in units:
        b = padded(sum(size[n] for n in names), N) * itemsize
        i = cfg.family.block_of(names[0])
        if i is None:
            outer += b
        else:
            blocks[i] = blocks.get(i, 0) + b
    return zero.gathered_peak(outer, [blocks[i] for i in sorted(blocks)], lay.prefetch,
                                       lay.reshard_after_forward)


def peak_memory(cfg: GPTConfig, lay) -> int:
    """The largest device's total: the budget a layout needs per device."""
    return max(device_memory(cfg, lay, stage)["total"] for stage in range(lay.pp))


# --- the trainer's check ----------------------------------------------------------------------

UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
         "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_size(text: str) -> int | None:
    """'16GiB', '512MiB', '8e9', '8GB' as bytes; None if it is no positive, finite size."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmgt]i?b|b)?\s*", text.lower())
    if not m or not math.isfinite(float(m.group(1))) or float(m.group(1)) <= 0:
        return None
    return int(float(m.group(1)) * UNITS[m.group(2) or ""])


def memory_limit(args) -> tuple[int, str]:
    """(bytes a rank may use, where that figure comes from): --max-memory, or this machine's
    memory (MemTotal) shared by the ranks the launcher started on it."""
    if args.max_memory is not None:
        size = parse_size(args.max_memory)
        if size is None or size < 1:
            raise config.ConfigError(f"--max-memory wants a size of at least a byte, such as 8GiB, 512MiB or 2e9, "
                              f"got {args.max_memory!r}")
        return size, f"--max-memory {args.max_memory}"
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    local = int(os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or 1)
    shared = f", {human_bytes(total)}, shared by the {local} ranks on it" if local > 1 else ""
    return total // max(local, 1), "this machine's MemTotal" + shared


def check_fits(args, cfg: GPTConfig, lay: Layout):
    """The trainer's memory check (run and --dry-run, every rank, before any message): the
    planner's peak bytes for a rank of this layout (model states and saved activations) against
    what a rank may use; a layout that cannot fit is refused (config.ConfigError) before
    anything is allocated, instead of ending in a MemoryError. --shard-group host is not
    resolved yet (the hosts are known once the grid is made): counted flat here."""
    need = peak_memory(cfg, lay)
    limit, source = memory_limit(args)
    if need > limit:
        raise config.ConfigError(f"this layout needs {human_bytes(need)} per rank by the planner's count (model states "
                          f"and activations, as python -m minipar.plan prints them), more than the "
                          f"{human_bytes(limit)} a rank may use ({source}; --max-memory sets another limit)")


# --- the longest sequence that fits -----------------------------------------------------------

def seq_ceiling(cfg: GPTConfig, lay, budget: int) -> dict:
    """The longest sequence T (a multiple of `step` = 2*cp, and of tp with --sp) whose peak
    per device fits in `budget` bytes, the model's block size taken to be T; None if not
    even T = step fits. peak_memory only grows with T, so: double k (T = k*step) while it
    fits, then bisect between the last k that fits and the first that does not."""
    step = math.lcm(2 * lay.cp, lay.cp * lay.tp if lay.sp else 1)   # --sp: tp divides each cp rank's T/cp

    def peak(k: int) -> int:
        return peak_memory(dataclasses.replace(cfg, block_size=k * step), lay)

    out = {"cp": lay.cp, "step": step, "T": None, "bytes_at_T": None, "bytes_at_next": peak(1)}
    if out["bytes_at_next"] > budget:
        return out
    lo = 1
    while peak(2 * lo) <= budget:
        lo *= 2
    hi = 2 * lo                                           # peak(lo) fits, peak(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= budget else (lo, mid)
    return {**out, "T": lo * step, "bytes_at_T": peak(lo), "bytes_at_next": peak(lo + 1)}


def ceilings(cfg: GPTConfig, lay, budget: int) -> dict:
    """seq_ceiling without cp (cp = 1, the same dp, tp, pp) and with the layout's cp."""
    return {"memory_budget": budget, "without_cp": seq_ceiling(cfg, lay.but(cp=1), budget),
            "with_cp": seq_ceiling(cfg, lay, budget)}
