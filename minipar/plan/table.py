"""The planner: what does training this model on this layout cost, per device?

    python -m minipar.plan --model gpt2-large --dp 2 --tp 4 --pp 4 --precision fp16
    python -m minipar.plan --n-layer 2 --n-embd 64 --dp 2 --tp 2      # the trainer's flags
    python -m minipar.plan --params 7.5e9 --dp 64 --zero 3 --precision fp16   # model states only
    python -m minipar.plan --model gpt2 --cp 4 --memory-budget 16GiB          # the longest T that fits
    python -m minipar.plan --model gpt2 --moe-experts 8 --moe-every 2 --dp 8 --ep 4   # mixture of experts
    python -m minipar.plan --model llama3-8b --world 64 --tp 8 --pp 2 --precision bf16 # the Llama family
    python -m minipar.plan --model mixtral-8x7b --world 64 --ep 8 --pp 2 --precision bf16   # Mixtral
    python -m minipar.plan --model llama3-70b --world 64 --tp 2 --zero 3 --ranks-per-host 8 \
        --inter-node-gbps 400 --memory-budget 80GiB       # ZeRO's shard groups compared (shards.py)

Layout flags are the trainer's (same names, same defaults), so one set of flags describes
one run; tests/test_plan*.py hold every figure to what minipar measures on such runs.
Where a mechanism has a formula of its own, the planner calls it rather than restating it:
pipeline.local_tensors (what a device holds), zero.formula and zero.calls_of (ZeRO's
memory and collectives, flat or in shard groups), tensor_parallel.megatron_calls, schedules.bubble_theory,
activations.peak_in_flight_bytes, the schedule's instructions (schedules.schedule),
ring_attention.ring_traffic (context parallelism's bytes), expert_parallel.ep_bytes (the
all-to-alls'), model.train_flops_per_token (FLOPs per token, active parameters).
plan() gathers the figures of layout.py (what a device holds), memory.py, flops.py and
comm_bytes.py (bytes sent, and across hosts hosts.py) into one dict; render.py prints it.

Context parallelism (--cp, docs/design.md §6): world = dp*cp*tp*pp; each rank keeps T/cp
tokens of every sequence (zig-zag or contiguous, the same bytes either way), so
    activations  per token on T/cp tokens, and what --cp-impl's attention keeps instead of the
                 T x T softmax (activations.py's second table; the ring's d sbh/c (4 + 2/h +
                 17/t + a/ht)); with --sp the tp ranks split each rank's T/cp tokens
    dp           gradients are summed, and ZeRO shards, over dp*cp ranks (ProcessGrid.grad_group):
                 the dp formulas (comm_bytes.py) with p = dp*cp
    tp, pp       their messages carry b*(T/cp)*C instead of b*T*C
    cp           per micro-batch and layer of the device, one attention call by --cp-impl:
                 context_parallel.call_traffic (the ring's ring_traffic(n, cp, compute itemsize,
                 forwards)[1], n = b*(T/cp)*C/tp; Ulysses' all-to-alls, the all-gather's
                 collectives, by the algorithm comm picks), forwards 2 with --recompute full;
                 the four side by side: plan/context.py
    FLOPs        T/cp of the T rows of every product (the ring computes all cp key blocks of
                 a query block, masked afterwards: T/cp x T, as minipar's T x T products are)

The Llama family (--arch llama, or a --model llama* preset: every GPTConfig field it sets, so
a family's preset carries its own fields; model/llama.py): its parameters are param_specs',
and each formula asks the family where GPT-2 and Llama differ:
    activations  activations.block_bytes: llama_layer_bytes (RMSNorm, q with k and v of Hkv
                 heads, SwiGLU's [gate|up]; no fused weights kept), no positions
    FLOPs        K and V of Hkv heads, SwiGLU's three matrices (flops.py)
    tp           Megatron's 4 all-reduces per block as GPT-2's, + the shared key/value heads'
                 gradient sums when tp > Hkv (tensor_parallel.kv_grad_count); --sp sums the two
                 RMSNorm weights of a block (sequence_parallel.replicated_sums), no wpe rows
    cp           the ring carries the Hkv key/value heads (context_parallel.kv_width)
    dp, ZeRO, pp its tensors by name (ZeRO's units: embed_tokens, each layer, the rest)

bubble: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/p for the naive schedule, (p-1)/(Vm+p-1)
interleaved, (p-1)/(3m+p-1) for zb-h1 and zb-h2 (schedules.bubble_theory, every op of one length).

Mixture of experts (--moe-experts E --moe-top-k K --moe-every N --moe-capacity-factor F,
--ep P: moe.py, parallel/expert_parallel.py): block i is a MoE block when (i + 1) % N == 0,
its MLP replaced by a router (C, E) and E expert MLPs; a rank's micro-batch of n = b*T
tokens is one routing group, cap = ceil(F n K / E) slots per expert (moe.capacity).
    parameters   total (every expert) and active per token (the K experts' MLPs and the
                 router of each MoE block, not all E: active_params)
    memory       a rank holds E/P experts of each MoE block (ep rank 0: the first E/P,
                 device_tensors); with --tp every tp rank holds them whole (the MoE layer
                 is replicated over tp); the rest as before. Activations of a MoE layer:
                 activations.py's third table, balanced routing assumed where it depends on
                 the data
    FLOPs        per token: K experts' MLPs and the router per MoE block
                 (model.train_flops_per_token); per device not divided by tp
    dp, ZeRO     ExpertParallelSync: the non-expert gradients summed over the dp group, each
                 expert's over its dp/P replicas, each bucketed on its own; ZeRO: each
                 block's experts a unit of their own, padded for and sharded over the
                 replicas, the rest over dp (sync_groups)
    tp           a MoE block has attention's f and g only (2 all-reduces, not 4)
    ep           per MoE layer of the device and micro-batch, 4 all-to-alls (6 with
                 --recompute full): expert_parallel.ep_bytes. With a capacity the padded
                 (E cap, C) tensor, exact; without, balanced routing's n K (P-1)/P rows each
                 way plus the row counts (the real figure depends on the routing; the
                 trainer's summary prints it beside ep_bytes of the rows it routed)
    other        the gradient norm without ZeRO: the experts' sum of squares all-reduced
                 over ep, not over dp (the other gradients are the same on every dp rank)
The Llama family's (--arch llama --moe-experts, --model mixtral-8x7b) is the same, with its
experts SwiGLU MLPs F_e wide (--moe-ffn-hidden; default the MLP's) and --moe-shared-experts S
on every token: activations.py's fifth table (the experts' rows, no weights kept), FLOPs
of K + S experts (flops.expert_weights), and with Mixtral's router (the family's default)
    pp           each pipeline message followed by its micro-batch's pooled counts (int64
                 (1, E); (0, E) before the first MoE block): comm_bytes.pooled_counts. The
                 planner has no --moe-aux-coef: it assumes the trainer's default 0.01 > 0
                 (with 0 the trainer sends no counts)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys

from minipar.config import flags as config
from minipar.model import moe
from minipar.model.gpt import GPTConfig, param_specs, train_flops_per_token
from minipar.optim import mixed_precision
from minipar.parallel.context import context_parallel
from minipar.parallel.context.ring_attention import LAYOUTS
from minipar.parallel.layout import Layout, LayoutError, check_layout
from minipar.parallel.pipeline import schedules
from minipar.parallel.zero import units as zero
from minipar.plan import activations, context as plan_context, hosts as plan_hosts, shards as plan_shards
from minipar.plan.comm_bytes import (cp_bytes, ep_bytes, ep_layer_bytes, flat_groups, grad_sync_bytes, other_parts,
                                     pp_bytes, tp_bytes)
from minipar.plan.flops import flop_components, flops, recompute_flops
from minipar.plan.layout import active_params, chunks, device_tensors, itemsizes, placed, zero_split
from minipar.plan.memory import ceilings, device_memory, model_states, parse_size
from minipar.comm.ledger import human_bytes
from minipar.plan.render import table

GPT2 = dict(arch="gpt2", vocab_size=50257, block_size=1024)
LLAMA3 = dict(arch="llama", vocab_size=128256, n_kv_head=8, rope_theta=500000.0, tie_embeddings=False)
PRESETS = {   # name: the GPTConfig fields it sets (the others: the trainer's defaults, MODEL_DEFAULTS)
    "gpt2": dict(GPT2, n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(GPT2, n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": dict(GPT2, n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": dict(GPT2, n_layer=48, n_head=25, n_embd=1600),
    "gpt3-175b": dict(GPT2, n_layer=96, n_head=96, n_embd=12288, block_size=2048),
    # Meta's params.json (dim, n_layers, n_heads, n_kv_heads, ffn_dim_multiplier, multiple_of,
    # rope_theta) and Hugging Face's config.json (vocab_size, max_position_embeddings): F by
    # Llama's rule, 11008, 14336, 28672, 53248. 405B is Llama 3.1's (128K positions; its
    # rope_scaling changes the angles, not a figure here).
    "llama2-7b": dict(arch="llama", vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096,
                      multiple_of=256, tie_embeddings=False),
    "llama3-8b": dict(LLAMA3, block_size=8192, n_layer=32, n_head=32, n_embd=4096, ffn_multiplier=1.3,
                      multiple_of=1024),
    "llama3-70b": dict(LLAMA3, block_size=8192, n_layer=80, n_head=64, n_embd=8192, ffn_multiplier=1.3,
                       multiple_of=4096),
    "llama3-405b": dict(LLAMA3, block_size=131072, n_layer=126, n_head=128, n_embd=16384, ffn_multiplier=1.2,
                        multiple_of=4096),
    # Mixtral 8x7B's config.json (Mistral AI, arXiv:2401.04088): every block MoE, 8 SwiGLU
    # experts of intermediate_size 14336, top-2, Mixtral's router; 46,702,792,704 parameters.
    "mixtral-8x7b": dict(arch="llama", vocab_size=32000, block_size=32768, n_layer=32, n_head=32, n_embd=4096,
                         n_kv_head=8, ffn_hidden=14336, rope_theta=1e6, norm_eps=1e-5, tie_embeddings=False,
                         moe_experts=8, moe_top_k=2, moe_every=1, moe_router="mixtral"),
}
SHAPE_FLAGS = ("vocab_size", "n_layer", "n_head", "n_embd", "block_size")
MOE_FLAGS = ("moe_experts", "moe_top_k", "moe_every", "moe_capacity_factor", "moe_router", "moe_shared_experts",
             "moe_ffn_hidden")
FAMILY_FLAGS = ("arch", "n_kv_head", "ffn_hidden", "ffn_multiplier", "multiple_of", "norm_eps", "rope_theta")


class PlanError(config.ConfigError):
    """Flags that describe no run: one line on stderr, exit code 2 (the checks shared with
    the trainer raise its ConfigError)."""


# --- the plan ---------------------------------------------------------------------------------

def moe_summary(cfg: GPTConfig, lay, itemsize: int, compute_itemsize: int) -> dict | None:
    """The mixture of experts at a glance (None without): its blocks, the capacity of a
    rank's micro-batch of n = b*T tokens (its routing group), the balanced routing the
    estimates assume (n K / E assignments per expert: M kept, R through the rank's experts),
    what an ep rank holds, one MoE layer's saved bytes and all-to-all bytes per micro-batch."""
    E, K = cfg.moe_experts, cfg.moe_top_k
    if not E:
        return None
    n = lay.rows * cfg.block_size
    cap = moe.capacity(n, K, E, cfg.moe_capacity_factor)
    blocks = [i for i in range(cfg.n_layer) if cfg.is_moe(i)]
    layer = activations.moe_layers(cfg, n, lay.ep)[blocks[0]]
    kept, received = layer.rows(n)
    return {"experts": E, "top_k": K, "every": cfg.moe_every, "capacity_factor": cfg.moe_capacity_factor,
            "blocks": blocks, "block_word": cfg.family.block_word, "shared_experts": cfg.moe_shared_experts,
            "expert_hidden": cfg.expert_hidden, "router": cfg.moe_router, "tokens_per_group": n, "capacity": cap,
            "balanced_per_expert": n * K / E,
            "kept": kept, "received": received, "ep": lay.ep, "experts_per_rank": E // lay.ep,
            "expert_replicas": lay.grad_ranks // lay.ep,
            "layer_activation_bytes": activations.block_bytes(cfg, lay.rows, lay.tp, itemsize, compute_itemsize,
                                                              recompute=lay.recompute, moe_layer=layer),
            "all_to_all_bytes_per_layer": (round(ep_layer_bytes(cfg, lay, itemsize, 2)) if lay.ep > 1 else 0),
            "all_to_all_exact": lay.ep > 1 and cap is not None}


def moe_notes(m: dict | None) -> list[str]:
    """What the MoE figures assume: balanced routing where the data decides."""
    if m is None:
        return []
    out = []
    if m["capacity"] is not None or m["ep"] > 1:
        out.append(f"MoE activations assume balanced routing, every expert chosen n K / E = "
                   f"{m['balanced_per_expert']:g} times in a micro-batch of n = {m['tokens_per_group']} tokens: "
                   f"{m['kept']} assignments kept, {m['received']} rows through this rank's experts "
                   f"(the real counts depend on the routing)")
    if m["ep"] > 1 and m["capacity"] is None:
        out.append("ep all-to-all bytes: balanced routing's n K (P-1)/P rows each way per all-to-all, + the row "
                   "counts; the real figure depends on the routing (the trainer's summary prints it beside "
                   "expert_parallel.ep_bytes of the rows it routed)")
    if m["ep"] > 1 and m["capacity"] is not None:
        out.append(f"ep all-to-all bytes exact: every message is the padded (E cap, C) tensor, cap = "
                   f"{m['capacity']}; each rank's experts run on E cap = {m['experts'] * m['capacity']} rows, "
                   f"padding included (FLOPs count the K experts a token uses)")
    return out


def plan(cfg: GPTConfig | None, lay, params: int | None = None, device_tflops: float | None = None,
         hosts: plan_hosts.Hosts | None = None, memory_budget: int | None = None) -> dict:
    """The whole estimate as a dict (what --json prints). cfg None: `params` alone, model
    states only (no shapes: P/(tp*pp) per device, one ZeRO unit). hosts: where the ranks
    run and their links (None: every rank on one host). memory_budget: bytes per device,
    for the sequence-length ceiling (seq_ceiling)."""
    hosts = hosts or plan_hosts.Hosts()
    spread = hosts.n_hosts(lay.world) > 1
    itemsize, compute_itemsize, K = itemsizes(lay)
    N, pp, M, V = lay.grad_ranks, lay.pp, lay.micro_batches, chunks(lay)
    bubble = schedules.bubble_theory(lay.schedule, pp, M, V)
    out = {"model": None, "layout": {**dataclasses.asdict(lay), "sp": lay.sp, "recompute": lay.recompute,
                                     "virtual_stages": lay.virtual_stages, "cp": lay.cp,
                                     "cp_layout": lay.cp_layout, "world": lay.world,
                                     "micro_batch_rows": lay.rows if cfg else None, "bytes_per_param": itemsize,
                                     "optimizer_bytes_per_param": K},
           "params": params, "params_active": None, "moe": None, "notes": [], "seq_ceiling": None,
           "zero_shard_groups": None}
    if cfg is None:
        P_local = -(-params // (lay.tp * pp))
        mem = {**model_states(P_local, zero.padded(P_local, N), itemsize, K, lay.zero, zero_split(lay)[0]),
               "activations": None, "total": None, "stage": None, "micro_batches_in_flight": None,
               "params_local": P_local, "params_padded": zero.padded(P_local, N)}
        out.update(memory=mem, memory_per_stage=[mem], flops=None, flops_per_stage=None, comm=None,
                   comm_per_stage=None, bubble=bubble, step_time_s=None,
                   hosts=plan_hosts.summary(placed(lay), hosts, None, None))
        out["notes"].append("--params alone: model states only, spread evenly over tp*pp "
                            "(no shapes: FLOPs, activations and communication unavailable)")
        return out
    out["model"] = cfg.to_dict()                          # every GPTConfig field: GPTConfig(**r["model"])
    out["shape"] = {"description": cfg.family.describe(cfg), "hidden": cfg.hidden, "kv_heads": cfg.kv_heads,
                    "head_size": cfg.head_size}
    out["params"] = sum(math.prod(shape) for _, shape, _ in param_specs(cfg))
    out["params_active"] = active_params(cfg)
    mem_st, flops_st, comm_st = [], [], []
    for stage in range(pp):
        tensors = device_tensors(cfg, lay, stage)
        mem_st.append(device_memory(cfg, lay, stage))
        stage_flops = flops(flop_components(cfg, lay.tp, stage, pp, V, lay.cp), lay.batch_size // lay.dp)
        flops_st.append({"stage": stage, **stage_flops})
        groups = plan_hosts.device_groups(placed(lay), hosts, stage) if spread else flat_groups(lay, stage)
        axes = {"dp": grad_sync_bytes(tensors, lay, itemsize, groups["dp"], cfg.family),
                "tp": tp_bytes(cfg, stage, lay, itemsize, compute_itemsize, groups["tp"]),
                "pp": pp_bytes(cfg, stage, lay, itemsize, groups["pp"])}
        groups.update(plan_hosts.ring_and_expert_groups(lay, hosts, stage) if spread else {})
        row = plan_hosts.comm_row(stage, axes, other_parts(stage, lay, groups), bool(lay.zero), hosts)
        cp_groups = plan_context.groups(lay, hosts, stage) if spread and lay.cp > 1 else None
        row = plan_hosts.add_axis(row, "cp", cp_bytes(cfg, stage, lay, compute_itemsize, cp_groups), hosts)
        comm_st.append(plan_hosts.add_axis(row, "ep", ep_bytes(cfg, stage, lay, itemsize, groups.get("ep")), hosts))
    whole = flop_components(cfg)
    tokens = lay.batch_size * cfg.block_size
    out["flops"] = {**flops(whole, lay.batch_size), "six_nd": 6 * out["params_active"] * tokens,
                    "per_token": train_flops_per_token(cfg),
                    "per_device": max(flops_st, key=lambda r: r["total"]),
                    "recompute_added": recompute_flops(cfg, lay)}
    out["moe"] = moe_summary(cfg, lay, itemsize, compute_itemsize)
    out["activations_per_layer"] = {
        "this_run": activations.block_bytes(cfg, lay.rows, lay.tp, itemsize, compute_itemsize, lay.sp and lay.tp > 1,
                                            lay.recompute, lay.cp, None, lay.cp_impl, lay.cp_ulysses),
        "setting": activations.setting_of(lay.tp, lay.sp, lay.recompute) if lay.cp == 1 else None,
        "cp": lay.cp, "cp_impl": lay.cp_impl,
        "cp_formula": activations.cp_formula(lay.recompute, cfg.arch, lay.cp_impl) if lay.cp > 1 else None,
        "table": activations.family_table(cfg, lay.rows, lay.tp, itemsize, compute_itemsize)}
    out.update(memory=max(mem_st, key=lambda r: r["total"]), memory_per_stage=mem_st,
               flops_per_stage=flops_st, comm=max(comm_st, key=lambda r: r["bytes_per_step"]),
               comm_per_stage=comm_st, bubble=bubble, step_time_s=None)
    tp_note = plan_hosts.tp_note(placed(lay), hosts,
                                 lambda stage, g: tp_bytes(cfg, stage, lay, itemsize, compute_itemsize, g))
    out["hosts"] = plan_hosts.summary(placed(lay), hosts, comm_st, tp_note)
    if tp_note:
        out["notes"].append(plan_hosts.tp_note_line(tp_note, human_bytes))
    if device_tflops:
        out["layout"]["device_tflops"] = device_tflops
        seconds = out["flops"]["per_device"]["total"] / (device_tflops * 1e12)
        out["step_time_s"] = seconds
        out["step_time_with_bubble_s"] = seconds / (1 - out["bubble"])
    if lay.zero == 3 and pp > 1:
        out["notes"].append("minipar's trainer refuses --zero 3 with --pp > 1 (as DeepSpeed does): "
                            "these are the formulas' figures")
    if lay.tp > 1:
        out["notes"].append("activations with tp > 1: the token ids a vocabulary slice keeps "
                            "depend on the data; 1/tp of them assumed")
    out["notes"] += moe_notes(out["moe"])
    if memory_budget is not None:
        out["seq_ceiling"] = ceilings(cfg, lay, memory_budget)
    out["cp_impls"] = plan_context.compare(cfg, lay, hosts) if lay.cp > 1 else None
    shown = hosts.ranks_per_host is not None or lay.shard_group is not None
    out["zero_shard_groups"] = plan_shards.compare(cfg, lay, hosts, memory_budget) if shown else None
    return out


# --- the command line -------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    def error(self, message):                             # one line, exit 2 (as the trainer)
        raise PlanError(message)


def build_parser() -> argparse.ArgumentParser:
    trainer = config.build_parser()                       # the trainer's defaults
    default = {k: trainer.get_default(k) for k in ("batch_size", "micro_batches", "schedule", "virtual_stages",
                                                    "dtype", "precision", "tp", "pp", "zero", "cp", "ep")}
    parser = Parser(prog="python -m minipar.plan",
                    description="Memory, FLOPs and communication per device of training a GPT-2 or Llama "
                                "model on a dp x cp x tp x pp layout, as minipar would run it.")
    model = parser.add_argument_group("model: --model, or the trainer's shape flags, or --params alone")
    model.add_argument("--model", choices=tuple(PRESETS), help="a standard shape (shape flags override it)")
    model.add_argument("--params", type=float, metavar="N",
                       help="a parameter count alone (e.g. 7.5e9): model states only")
    model.add_argument("--vocab-size", type=int, metavar="V", help="vocabulary [256: minipar's bytes]")
    for key, letter, what in (("n_layer", "L", "transformer blocks"), ("n_head", "H", "attention heads"),
                              ("n_embd", "C", "channels"), ("block_size", "T", "context length")):
        model.add_argument(f"--{key.replace('_', '-')}", type=int, metavar=letter,
                           help=f"{what} [{config.MODEL_DEFAULTS[key]}]")
    config.add_family_arguments(model)
    config.add_tie_arguments(model)
    config.add_moe_arguments(model, "0: no capacity (all-to-all bytes then estimated for balanced routing)")
    layout = parser.add_argument_group("layout (the trainer's flags and defaults)")
    layout.add_argument("--dp", type=int, metavar="D",
                        help="data-parallel replicas [1, or world/(cp*tp*pp) with --world]")
    layout.add_argument("--world", type=int, metavar="W",
                        help="ranks, as mpirun -n W gives the trainer: --dp defaults to W/(cp*tp*pp), and "
                             "dp*cp*tp*pp must be W")
    layout.add_argument("--cp", type=int, default=default["cp"], metavar="C",
                        help="context parallelism: each sequence split over C ranks, attention by ring "
                             "attention; the block size must divide by 2C [%(default)s]")
    layout.add_argument("--cp-layout", choices=LAYOUTS, default=None,
                        help="--cp: which tokens each rank keeps (the same bytes either way) [zigzag]")
    layout.add_argument("--cp-impl", choices=context_parallel.IMPLS, default=None,
                        help="--cp: how the cp group attends, as the trainer's flag; the table also shows "
                             "all four side by side [ring]")
    layout.add_argument("--cp-ulysses", type=int, default=None, metavar="U",
                        help="--cp-impl hybrid: Ulysses over U consecutive cp ranks, the ring across "
                             "[the cp ranks of a host, --ranks-per-host]")
    layout.add_argument("--tp", type=int, default=default["tp"], metavar="T",
                        help="tensor-parallel ranks [%(default)s]")
    layout.add_argument("--pp", type=int, default=default["pp"], metavar="P", help="pipeline stages [%(default)s]")
    layout.add_argument("--ep", type=int, default=default["ep"], metavar="P",
                        help="expert parallelism: the experts split over groups of P dp ranks, tokens sent "
                             "to them by all-to-all; P divides dp and --moe-experts [%(default)s]")
    layout.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=default["zero"], metavar="{0,1,2,3}",
                        help="ZeRO stage over the dp group: shard the optimizer state (1), and the gradients "
                             "(2), and the parameters (3) [%(default)s]")
    layout.add_argument("--shard-group", type=config.shard_group_value, nargs="?", const="host", default=None,
                        metavar="S|host",
                        help="--zero: hybrid sharding, ZeRO inside groups of S consecutive dp x cp ranks "
                             "(host, or the flag alone: the ranks of a host, --ranks-per-host), replicated "
                             "across the groups; "
                             "with --ranks-per-host the table compares every shard group [flat: all dp x cp]")
    layout.add_argument("--prefetch", type=int, default=None, metavar="K",
                        help="--zero 3: the next K blocks gathered ahead; their gathered parameters "
                             "count in the peak [0]")
    layout.add_argument("--reshard-after-forward", choices=("on", "off"), default=None,
                        help="--zero 3: off keeps every block gathered from forward to backward (the "
                             "whole model at the peak) and makes no all-gather in backward [on]")
    layout.add_argument("--qwz", type=int, default=None, metavar="B",
                        help="--zero 3, ZeRO++: the weights' all-gathers as int8 codes, a float32 scale per "
                             "block of B [off]")
    layout.add_argument("--qgz", type=int, default=None, metavar="B",
                        help="--zero 3, ZeRO++: the gradients reduced as int8 blocks of B by all-to-alls "
                             "inside the host, then across [off]")
    layout.add_argument("--hpz", action="store_true",
                        help="--zero 3, ZeRO++: backward's all-gathers from a secondary copy sharded "
                             "inside the host")
    layout.add_argument("--micro-batches", type=int, default=default["micro_batches"], metavar="M",
                        help="micro-batches per step on each dp rank [%(default)s]")
    layout.add_argument("--batch-size", type=int, default=default["batch_size"], metavar="B",
                        help="global batch in sequences [%(default)s]")
    layout.add_argument("--precision", choices=tuple(mixed_precision.PRECISIONS), default=default["precision"],
                        help="fp16/bf16: 2-byte parameters, gradients, activations; 12-byte optimizer "
                             "[%(default)s]")
    layout.add_argument("--dtype", choices=tuple(config.DTYPES), default=default["dtype"],
                        help="parameter dtype with --precision fp32 (8 bytes for float64) [%(default)s]")
    layout.add_argument("--schedule", choices=tuple(schedules.SCHEDULES), default=default["schedule"],
                        help="pipeline schedule [%(default)s]")
    layout.add_argument("--virtual-stages", type=int, default=default["virtual_stages"], metavar="V",
                        help="--schedule interleaved: model chunks per pipeline rank [%(default)s]")
    layout.add_argument("--sp", action="store_true",
                        help="sequence parallelism inside the tp group (activations, tp bytes)")
    layout.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                        help="activation recomputation (activations, tp bytes, added FLOPs) [%(default)s]")
    layout.add_argument("--dp-mode", choices=("bucketed", "naive"),
                        help="--zero 0: gradient all-reduce per bucket or per parameter [bucketed]")
    layout.add_argument("--bucket-mb", type=float, metavar="X",
                        help="--zero 0, bucketed: bucket size in MiB [1.0]")
    plan_hosts.add_arguments(parser)
    output = parser.add_argument_group("output")
    output.add_argument("--device-tflops", type=float, metavar="X",
                        help="sustained TFLOP/s of one device: adds a step-time estimate")
    output.add_argument("--memory-budget", metavar="BYTES",
                        help="bytes per device (16GiB, 512MiB, 8e9): the longest sequence whose peak fits, "
                             "without cp and with --cp")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def resolve(args) -> tuple[GPTConfig | None, Layout, int | None]:
    """Flags -> (cfg or None, layout, params or None); PlanError for what cannot run,
    with the trainer's messages (config.validate, train/setup.prepare) where they exist."""
    given = [k for k in (*SHAPE_FLAGS, *MOE_FLAGS, *FAMILY_FLAGS) if getattr(args, k) is not None]
    for flag in ("dp", "cp", "tp", "pp"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise PlanError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    dp = args.dp
    if args.world is not None:                               # the trainer's check and default
        try:
            dp = check_layout(args.world, dp, args.tp, args.pp, args.cp)[0]
        except LayoutError as e:
            raise PlanError(str(e)) from None
    prefetch, reshard = config.resolve_gathers(args)       # ConfigError: --zero 3's, as the trainer says
    qwz, hpz, qgz = config.resolve_zpp(args)
    lay = Layout.from_flags(args, dp=1 if dp is None else dp, prefetch=prefetch, reshard_after_forward=reshard,
                            qwz=qwz, hpz=hpz, qgz=qgz)
    for flag in ("batch_size", "micro_batches"):
        if getattr(lay, flag) <= 0:
            raise PlanError(f"--{flag.replace('_', '-')} must be positive, got {getattr(lay, flag)}")
    if lay.batch_size % lay.micro_batches:
        raise PlanError(f"--batch-size {lay.batch_size} is not divisible by --micro-batches {lay.micro_batches}")
    if lay.precision != "fp32" and lay.dtype != "float32":
        raise PlanError(f"--precision {lay.precision} needs --dtype float32 (its master weights and "
                        f"optimizer state are float32), got --dtype {lay.dtype}")
    dp_mode, bucket_mb = config.resolve_dp_flags(lay)
    lay = lay.but(dp_mode=dp_mode, bucket_mb=bucket_mb)
    if args.params is None:                                  # --params: no batch to cut
        config.check_split(None, lay.dp, lay.tp, lay.pp, lay.batch_size, lay.micro_batches)
    if args.device_tflops is not None and not args.device_tflops > 0:
        raise PlanError(f"--device-tflops must be > 0, got {args.device_tflops}")
    if args.params is not None:
        if args.model or given or args.untied or args.tied:
            extra = "--model" if args.model else "--untied" if args.untied else "--tied" if args.tied \
                else f"--{given[0].replace('_', '-')}"
            raise PlanError(f"--params gives the size alone; drop {extra} (or drop --params)")
        if not (math.isfinite(args.params) and args.params >= 1):
            raise PlanError(f"--params must be a count >= 1, got {args.params:g}")
        config.check_schedule(None, lay.pp, lay.schedule, lay.virtual_stages, lay.micro_batches)
        lay = lay.but(cp_layout=config.check_context_split(None, lay))
        config.check_moe(GPTConfig(), moe_args(args), lay.dp)     # --ep needs experts: the trainer's line
        config.check_shard_group(lay, lay.grad_ranks)
        return None, lay, int(round(args.params))
    preset = PRESETS.get(args.model, {})
    if args.arch is not None and args.arch != preset.get("arch", args.arch):
        raise PlanError(f"--model {args.model} is a {preset['arch']} model: drop --arch {args.arch} (or --model)")
    base = {"vocab_size": 256, **config.MODEL_DEFAULTS, **preset}
    fields = {k: getattr(args, k) if getattr(args, k) is not None else base[k]
              for k in (*SHAPE_FLAGS, *MOE_FLAGS, *FAMILY_FLAGS)}
    for k in SHAPE_FLAGS:
        if fields[k] <= 0:
            raise PlanError(f"--{k.replace('_', '-')} must be positive, got {fields[k]}")
    tied = True if args.tied else False if args.untied else preset.get("tie_embeddings")   # None: the family's
    cfg = GPTConfig(tie_embeddings=tied, **fields)
    if cfg.n_embd % cfg.n_head:
        raise PlanError(f"--n-embd {cfg.n_embd} is not divisible by --n-head {cfg.n_head}")
    config.check_family(args, cfg)
    config.check_split(cfg, lay.dp, lay.tp, lay.pp, lay.batch_size, lay.micro_batches)
    config.check_sequence_split(cfg, lay.tp, lay.sp)
    lay = lay.but(cp_layout=config.check_context_split(cfg, lay))
    lay = lay.but(cp_impl=config.check_cp_impl(cfg, lay, lay.tp))
    config.check_moe(cfg, moe_args(args), lay.dp)
    config.check_schedule(cfg, lay.pp, lay.schedule, lay.virtual_stages, lay.micro_batches)
    config.check_shard_group(lay, lay.grad_ranks)
    return cfg, lay, None


def moe_args(args) -> argparse.Namespace:
    """The flags as config.check_moe reads them; the planner has no --moe-aux-coef or
    --moe-z-coef (the losses' weights cost nothing), so they are 0."""
    return argparse.Namespace(**{**vars(args), "moe_aux_coef": 0.0, "moe_z_coef": 0.0})


def memory_budget(args, cfg: GPTConfig | None) -> int | None:
    """--memory-budget as bytes (16GiB, 512MiB, 8e9, 8GB), or None; PlanError if it is no
    size or there is no model shape to search over."""
    text = args.memory_budget
    if text is None:
        return None
    size = parse_size(text)
    if size is None:
        raise PlanError(f"--memory-budget wants a size such as 16GiB, 512MiB or 8e9 (bytes), got {text!r}")
    if cfg is None:
        raise PlanError("--memory-budget searches over the sequence length: it needs the model's shape, "
                        "not --params")
    return size


def hybrid_layout(cfg: GPTConfig | None, lay, hosts: plan_hosts.Hosts):
    """lay with --cp-impl hybrid's Ulysses degree resolved (given, or the cp ranks of a host):
    PlanError when the hosts give none, or one the heads cannot take (the trainer's lines)."""
    if cfg is None or lay.cp_impl != "hybrid":
        return lay
    try:
        return plan_context.with_impl(cfg, lay, "hybrid", hosts)
    except ValueError as e:
        raise PlanError(f"{e} (--n-head {cfg.n_head}, {cfg.kv_heads} key/value heads, --tp {lay.tp}, "
                        f"Ulysses over {lay.cp_ulysses or 'the cp ranks of a host'})") from None


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
        cfg, lay, params = resolve(args)
        hosts = plan_hosts.Hosts.from_args(args)
        budget = memory_budget(args, cfg)
        lay = hybrid_layout(cfg, lay, hosts)
        lay = plan_shards.resolve(lay, hosts)
    except config.ConfigError as e:
        print(f"minipar.plan: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    r = plan(cfg, lay, params, args.device_tflops, hosts, budget)
    print(json.dumps(r) if args.json else table(r, args.model))


if __name__ == "__main__":
    main()
