"""What a training run tells its user: the start-up description, the progress line, the
closing summary (docs/design.md §8's `summary` object and its printed lines), and --verify's
comparison with the single-process twin.

Every function here reads a trainer session `s` (train.Session: args, cfg, grid, model,
opt, sync, pipe, ...) and the figures the run measured; none sends a message but the
memory gather. The summary's common part (loss, memory, tokens/s, MFU, layout) is built
here; each mechanism reports itself, a `summary(...)` in its own file taking plain figures
(the rows, the layout's numbers, its statistics) -> (its dict, its lines), the same way:
what was measured (bytes from nbytes and the ledger, seconds from the clock) beside its
formula. in_use lists them in the summary's order.
"""
from __future__ import annotations

import math

import numpy as np

from minipar import comm
from minipar.train import checkpoint, data
from minipar.show import draw
from minipar.model import moe
from minipar.plan import table
from minipar.optim import mixed_precision
from minipar.optim.adamw import AdamW
from minipar.parallel.context import context_parallel
from minipar.parallel import data_parallel, grid
from minipar.parallel.expert import expert_parallel
from minipar.parallel.pipeline import stage as pipeline, schedules
from minipar.parallel.pipeline import summary as pipeline_summary
from minipar.parallel.tensor import sequence_parallel, tensor_parallel
from minipar.parallel.zero import formulas as zero, optimizer as zero_optimizer
from minipar.parallel.zero import summary as zero_summary
from minipar.comm.ledger import human_bytes



def memory_report(model, opt: AdamW) -> dict:
    """Bytes this process holds for model states, beside the formula (fp32/fp64: Adam keeps
    m and v, so params + grads + optimizer = s*P + s*P + 2s*P for an s-byte dtype, with P
    the parameters this rank holds: all of them, or tensor_parallel.local_param_count).
    --precision fp16/bf16: 2P + 2P + 12P (the optimizer adds fp32 master weights to m, v).
    With --zero, the ZeRO object's own report: its shards, beside zero.formula."""
    if isinstance(opt, zero_optimizer.ShardedAdamW):
        return opt.memory_report()
    tp = model.tp_size
    if isinstance(model, pipeline.PipelineStage):
        P = pipeline.local_param_count(model.cfg, model.stage, model.n_stages, tp, model.n_chunks)
    else:
        P = model.num_params() if tp == 1 else tensor_parallel.local_param_count(model.cfg, tp)
    placement = None if model.moe is None else model.moe.placement           # --ep: other ranks' experts
    if placement is not None:
        P -= expert_parallel.held_elsewhere(model.cfg, model.layers,
                                            placement.P)
    itemsize = model.dtype.itemsize
    K = mixed_precision.optimizer_bytes_per_param(isinstance(opt, mixed_precision.MixedPrecisionAdamW), itemsize)
    return {
        "params": sum(p.data.nbytes for p in model.parameters()),
        "grads": sum(p.grad.nbytes for p in model.parameters() if p.grad is not None),
        "optimizer": opt.state_bytes(),
        "formula": zero.formula(0, P, P, 1, itemsize, K),      # the table's zero-0 row
    }


_MEMORY_FIELDS = ("params", "grads", "optimizer")


def memory_per_rank(world, mem: dict) -> list[dict] | None:
    """Every rank's memory_report, on rank 0 (a gather over the world: 6 numbers a rank);
    None on the other ranks. Each: {"rank", "params", "grads", "optimizer" (bytes held),
    "formula": {the same three by formula}} (docs/design.md §8)."""
    f = mem["formula"]
    mine = np.array([mem[k] for k in _MEMORY_FIELDS] + [f[k] for k in _MEMORY_FIELDS], np.float64)
    rows = comm.gather(world, mine, 0) if world.size > 1 else mine
    if rows is None:
        return None
    rows = rows.reshape(world.size, 2 * len(_MEMORY_FIELDS)).astype(np.int64)
    return [{"rank": r, **dict(zip(_MEMORY_FIELDS, map(int, row[:3]))),
             "formula": dict(zip(_MEMORY_FIELDS, map(int, row[3:])))} for r, row in enumerate(rows)]


def placement_warning(g) -> str | None:
    """The tp group should sit inside one host: Megatron's all-reduces are on every layer's
    critical path; so should the cp group, whose ring passes K and V on every layer. A layout
    that puts either across hosts runs, with this warning."""
    if g.tp_size > 1 and g.tp_group.n_nodes > 1:
        return (f"  warning: the tp group of rank {g.rank} spans hosts "
                f"{', '.join(g.tp_group.hosts)}: every layer's all-reduces cross the link (the "
                f"summary measures it); place tp inside a host (e.g. mpirun -ppn a multiple of --tp "
                f"{g.tp_size}, docs/cluster.md)")
    if g.cp_size > 1 and g.cp_group.n_nodes > 1:
        return (f"  warning: the cp group of rank {g.rank} spans hosts {', '.join(g.cp_group.hosts)}: "
                f"every layer's ring messages cross the link; place tp x cp inside a host (mpirun -ppn "
                f"a multiple of tp x cp = {g.tp_size * g.cp_size})")
    return None


def n_buckets(s) -> int:
    """Bucketed data parallelism's bucket count for this model (data_parallel.bucket_members)."""
    return len(data_parallel.bucket_members([p.data.nbytes for p in s.model.parameters()], s.args.bucket_mb))


def mechanisms(s) -> str:
    """One line: which mechanisms this run exercises."""
    a, g = s.args, s.grid
    out = []
    if g.dp_size > 1:
        out.append(f"data parallelism over {g.dp_size} ranks"
                   + (f" with ZeRO stage {a.zero}" if a.zero else f" ({a.dp_mode} all-reduce)"))
    elif a.zero and g.grad_group.size > 1:
        out.append(f"ZeRO stage {a.zero} over the {g.grad_group.size} cp ranks")
    elif a.zero:
        out.append(f"ZeRO stage {a.zero} (over a single dp rank: nothing to shard)")
    if g.tp_size > 1:
        out.append(f"tensor parallelism over {g.tp_size} ranks"
                   + (" with sequence parallelism" if a.sp else ""))
    elif a.sp:
        out.append("sequence parallelism over tp 1 (nothing to split)")
    if g.cp_size > 1:
        out.append(f"context parallelism over {g.cp_size} ranks ({a.cp_layout} ring attention)")
    if s.cfg.moe_experts:
        out.append(f"mixture of experts (E={s.cfg.moe_experts}, top-{s.cfg.moe_top_k})"
                   + (f", expert parallelism over {g.ep_size} ranks" if g.ep_size > 1 else ""))
    if g.pp_size > 1:
        out.append(f"pipeline parallelism over {g.pp_size} stages "
                   f"({a.schedule}, {a.micro_batches} micro-batches)")
    elif a.micro_batches > 1:
        out.append(f"gradient accumulation over {a.micro_batches} micro-batches")
    if a.precision != "fp32":
        out.append(f"mixed precision ({a.precision})")
    if a.recompute != "none":
        out.append(f"{a.recompute} activation recomputation")
    return "  mechanisms: " + ("; ".join(out) if out else
                               "none (one process, the single-process baseline)")


def describe(s) -> list[str]:
    """The start-up lines: model, mechanisms, layout and what each mechanism splits."""
    a, cfg, g, model, opt = s.args, s.cfg, s.grid, s.model, s.opt
    B, T, M, dp = a.batch_size, cfg.block_size, a.micro_batches, g.dp_size
    mixed = a.precision != "fp32"
    lines = [f"minipar: GPT L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd} T={T} V={cfg.vocab_size} "
             f"({'tied' if cfg.tie_embeddings else 'untied'}), "
             f"{model.num_params():,} params, {a.dtype}"
             + (f", --precision {a.precision}" if mixed else ""), mechanisms(s)]
    if mixed:
        sc = opt.scaler
        lines.append(f"  precision: parameters, gradients and activations in {opt.dtype.name}, "
                     f"matmuls and other "
                     f"ops computed in float32; fp32 master weights, m and v in the optimizer; "
                     + (f"dynamic loss scale from {sc.scale:g}, x{sc.growth_factor:g} "
                        f"after {sc.growth_interval} "
                        f"clean steps, x{sc.backoff_factor:g} and skip on inf/NaN" if sc.dynamic
                        else "no loss scaling (a step with an inf/NaN gradient is skipped)"))
    mode = "" if not s.has_dp or a.zero else (f", {a.dp_mode} gradient all-reduce" + (
        f" in {n_buckets(s)} bucket(s) of <= {a.bucket_mb:g} MiB"
        if a.dp_mode == "bucketed" else ""))
    lines.append(f"  layout: {s.world} process(es), {g.describe()}{mode}")
    if g.world.n_nodes > 1:
        w = g.world
        lines.append(f"  hosts: {w.n_nodes}, " + "; ".join(
            f"{name}: ranks {', '.join(str(q) for q, n in enumerate(w.nodes) if n == h)}"
            for h, name in enumerate(w.hosts)))
        for axis, group in (("dp", g.dp_group), ("cp", g.cp_group), ("tp", g.tp_group), ("pp", g.pp_group)):
            if group is None:
                continue
            if comm.spans_hosts(group):
                lines.append(f"  {axis} group of rank 0: {group.size} ranks on {group.n_nodes} hosts: "
                             f"its all-reduces, reduce-scatters and all-gathers above "
                             f"{comm.ALL_REDUCE_DOUBLING_MAX_BYTES // 1024} KiB run "
                             f"hierarchically (inside each host, then across)")
        warning = placement_warning(g)
        if warning:
            lines.append(warning)
    if g.tp_size > 1:
        lines.append(f"  tensor parallel: each tp rank holds {cfg.n_head // g.tp_size} of "
                     f"{cfg.n_head} heads, 1/{g.tp_size} of every MLP, "
                     f"{model.vocab_per_rank} of {model.vocab_padded} vocabulary rows "
                     f"(V={cfg.vocab_size}"
                     f"{' padded' if model.vocab_padded != cfg.vocab_size else ''}); "
                     f"{model.num_local_params():,} of {model.num_params():,} parameters")
        if a.sp:
            lines.append(f"  sequence parallel: between the tensor-parallel layers each tp rank holds "
                         f"{T // g.tp_size} of the {T} positions of every sequence (LayerNorms, "
                         f"residual stream, embeddings); f and g all-gather and reduce-scatter "
                         f"along the sequence")
    if g.cp_size > 1:
        C = g.cp_size
        lines.append(f"  context parallel: each cp rank holds {T // C} of the {T} positions of every "
                     f"sequence ({a.cp_layout}: this rank "
                     + ", ".join(f"{p[0]}..{p[-1]}" for p in np.split(s.context.positions(T), 2))
                     + f"); attention by ring attention, K and V passing round {C} ranks; gradients "
                       f"summed over dp x cp = {g.grad_group.size} rank(s)")
    if s.pipe is not None:
        pp, V = g.pp_size, a.virtual_stages
        held = [schedules.rank_layers(cfg.n_layer, r, pp, V) for r in range(pp)]
        lines.append(f"  pipeline: {pp} stages" + (f" of {V} chunks each (interleaved)" if V > 1 else "")
                     + ", layers " + ", ".join(" + ".join(f"{c.start}..{c.stop - 1}" for c in chunks)
                                               for chunks in held)
                     + f" (stage 0 + wte/wpe, stage {pp - 1} + ln_f/head"
                     + (", tied wte copied to the last stage" if cfg.tie_embeddings else "")
                     + f"); {a.schedule} schedule over {M} micro-batch(es), bubble in theory "
                       f"{s.pipe.bubble_theory:.3f}")
    if a.zero:
        shards = g.grad_group.size
        lines.append(f"  ZeRO stage {a.zero} over {shards} rank(s) (dp x cp"
                     + (f"; experts over their {g.expert_group.size} replica(s)" if g.ep_size > 1 else "") + "): "
                     + {1: "optimizer state", 2: "optimizer state and gradients",
                        3: "optimizer state, gradients and parameters"}[a.zero]
                     + f" sharded in {len(s.sync.units)} units (wte, each block, the rest), "
                       f"each padded to a "
                       f"multiple of {shards} ({s.sync.padding} padding elements on this rank)")
    lines.append(f"  batch: {B} x {T} tokens; each dp rank {B // dp} sequences in "
                 f"{M} micro-batch(es) of "
                 f"{B // dp // M}")
    lines.append(f"  data: {a.data or data.BUILTIN_NAME + ' corpus'}, "
                 f"{len(s.spec.tokens):,} tokens; steps "
                 f"{s.spec.start}..{a.steps - 1}; lr {a.lr:g} {a.lr_schedule}, warm-up {a.warmup}"
                 + (f"; resumed from {a.resume}" if s.spec.meta is not None else ""))
    return lines


def plan_lines(s) -> list[str]:
    """--dry-run: what the planner (python -m minipar.plan, the same flags) expects a rank of
    each pipeline stage to hold and send per step; the run's summary measures the same."""
    g = s.grid
    r = table.plan(s.cfg, g.layout)
    lines = []
    for mem, sent in zip(r["memory_per_stage"], r["comm_per_stage"]):
        where = f"a rank of stage {mem['stage']}" if g.pp_size > 1 else "each rank"
        lines.append(f"  plan: {where} holds {human_bytes(mem['model_states'])} of model states + "
                     f"{human_bytes(mem['activations'])} of activations at peak, sends "
                     f"{human_bytes(sent['bytes_per_step'])}/step (dp {human_bytes(sent['dp'])}, "
                     f"tp {human_bytes(sent['tp'])}, pp {human_bytes(sent['pp'])}"
                     + (f", cp {human_bytes(sent['cp'])}" if g.cp_size > 1 else "")
                     + (f", ep {human_bytes(sent['ep'])}" if g.ep_size > 1 else "") + ")")
    return lines


def progress_line(s, row: dict) -> str:
    exposed = f" (exposed {row['exposed_comm_s'] * 1e3:.1f} ms)" if s.has_dp else ""
    dynamic = s.args.precision != "fp32" and s.opt.scaler.dynamic
    scaling = f" | scale {row['loss_scale']:g}" if dynamic else ""
    return (f"step {row['step']:5d} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
            f"norm {row['grad_norm']:7.3f} | "
            f"{row['tokens_per_s']:8.0f} tok/s | MFU {row['mfu']:5.1%} | "
            f"comm {human_bytes(row['comm_bytes'])}"
            + exposed + scaling + (" | skipped (inf/NaN gradient)" if row["skipped"] else ""))


def summarize(s, rows_log, elapsed, val_loss, digest, stages, tp_ledger) -> tuple[dict, list[str]]:
    """docs/design.md §8's summary object and the lines that print it: the common part (loss,
    memory, tokens/s, MFU, layout), then each mechanism in use reporting itself, in the fixed
    order of in_use (its dict under its key, its lines). stages: every pipeline stage's
    stats on pp rank 0 (else None); tp_ledger: tensor_parallel.traffic() of the training
    steps."""
    a, cfg, g, model, opt = s.args, s.cfg, s.grid, s.model, s.opt
    losses = [r["loss"] for r in rows_log]
    B, T = a.batch_size, cfg.block_size
    steps_run = len(rows_log)
    mem = memory_report(model, opt)
    per_rank = memory_per_rank(g.world, mem)                 # collective over the world
    summary = {"summary": True, "params_count": model.num_params(), "steps": steps_run,
               "first_loss": losses[0], "final_loss": losses[-1], "val_loss": val_loss,
               "unigram_entropy": data.unigram_entropy(s.spec.tokens),
               "tokens_per_s": B * T * steps_run / elapsed,
               "mfu": s.flops_step * steps_run / elapsed / s.peak,
               "peak_flops": s.peak, "seconds": elapsed, "memory": mem, "memory_per_rank": per_rank,
               "layout": {"dp": g.dp_size, "cp": g.cp_size, "tp": g.tp_size, "pp": g.pp_size, "zero": a.zero},
               "data_parallel": None}      # always reported (in_use): its place in §8's key order
    f = mem["formula"]
    lines = [f"summary: {steps_run} steps in {elapsed:.1f} s, "
             f"{summary['tokens_per_s']:,.0f} tok/s, "
             f"MFU {summary['mfu']:.1%} of {s.world} x {s.peak / s.world / 1e9:.0f} GFLOP/s "
             f"{a.dtype} matmul peak",
             f"  loss {losses[0]:.3f} -> {losses[-1]:.3f} (val {val_loss:.3f}); "
             f"a model that ignores context "
             f"scores {summary['unigram_entropy']:.3f} nats (the unigram entropy of the data)",
             f"  memory per rank: params {human_bytes(mem['params'])}, "
             f"grads {human_bytes(mem['grads'])}, "
             f"optimizer {human_bytes(mem['optimizer'])}; formula {f['text']} = "
             f"{human_bytes(f['params'])} + {human_bytes(f['grads'])} + "
             f"{human_bytes(f['optimizer'])}"]
    for key, (out, more) in in_use(s, rows_log, mem, digest, stages, tp_ledger):
        if key is not None:
            summary[key] = out
        lines += more
    return summary, lines


def in_use(s, rows_log, mem, digest, stages, tp_ledger):
    """(its key in the summary or None, (its dict, its lines)) of each mechanism this run
    uses, in the summary's order: precision, ZeRO, data parallel (always; with the replicas'
    hash), hosts, pipeline, tensor or sequence parallel, context parallel, MoE, expert
    parallel, checkpoint. Each summary takes plain figures, read here from the session."""
    a, cfg, g, model, sync = s.args, s.cfg, s.grid, s.model, s.sync
    M = a.micro_batches
    P_bytes = sum(p.data.nbytes for p in model.parameters())
    n_sum = g.grad_group.size                                # the ranks gradients are summed over: dp x cp
    experts = None
    if g.ep_size > 1:                                       # experts: over their dp/ep replicas
        experts = (g.expert_group.size, sum(p.data.nbytes for n, p in model.named_parameters()
                                            if expert_parallel.expert_of(n) is not None))
    theory = data_parallel.grad_sync_theory(P_bytes, n_sum, experts)
    rows = a.batch_size // g.dp_size // M                  # sequences per micro-batch of this dp rank
    layers = [i for chunk in schedules.rank_layers(cfg.n_layer, g.pp_rank, g.pp_size, a.virtual_stages)
              for i in chunk]                             # the blocks this rank runs
    if a.precision != "fp32":
        yield "precision", mixed_precision.summary(a.precision, s.opt.dtype.name, s.opt.scaler,
                                                   s.opt.step_count, rows_log)
    if a.zero:
        yield "zero", zero_summary.summary(sync, mem, rows_log, M, theory)
    yield "data_parallel", data_parallel.summary(
        rows_log, mode=f"zero{a.zero}" if a.zero else a.dp_mode if s.has_dp else None,
        buckets=len(sync.units) if a.zero else n_buckets(s) if s.has_dp and a.dp_mode == "bucketed" else 0,
        theory=theory, P_bytes=P_bytes, digest=digest, ranks=n_sum, cp=g.cp_size, ep=g.ep_size)
    if g.world.n_nodes > 1:
        yield "hosts", grid.hosts_summary(g.world.hosts, [g.world.hosts[n] for n in g.world.nodes], rows_log,
                                          g.tp_group.n_nodes > 1)
    if stages is not None:                                # pp rank 0 (world rank 0 among them)
        pipe = s.pipe
        yield "pipeline", pipeline_summary.summary(a.schedule, pipe.model.n_stages, M, pipe.model.n_chunks,
                                                   pipe.bubble_theory, stages, rows_log, draw.ascii_gantt)
    if g.tp_size > 1:
        tp = sequence_parallel if a.sp else tensor_parallel
        yield "tensor_parallel", tp.summary(tp_ledger, rows_log, cfg, tp=g.tp_size, rows=rows, micro_batches=M,
                                            layers=len(layers), pp_rank=g.pp_rank, pp=g.pp_size,
                                            recompute=a.recompute)
    if g.cp_size > 1:
        itemsize = 4 if a.precision != "fp32" else np.dtype(s.spec.dtype).itemsize   # fp16/bf16 attend in fp32
        yield "context_parallel", context_parallel.summary(
            rows_log, cfg, cp=g.cp_size, layout=a.cp_layout, rows=rows, micro_batches=M, layers=len(layers),
            tp=g.tp_size, itemsize=itemsize, recompute=a.recompute)
    if cfg.moe_experts:
        yield "moe", moe.summary_lines(rows_log)
    if g.ep_size > 1:
        yield "expert_parallel", expert_parallel.summary(
            rows_log, cfg, ep=g.ep_size, expert_replicas=g.expert_group.size,
            moe_layers=sum(cfg.is_moe(i) for i in layers), micro_batches=M, recompute=a.recompute)
    if a.save:
        yield None, checkpoint.summary(a.save, a.steps, world=s.world, zero=a.zero, grad_ranks=n_sum, cp=g.cp_size)


def json_safe(row: dict) -> dict:
    """inf and NaN (a skipped step's gradient norm) as null: the log stays strict JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()}


def draw_timeline(s, summary: dict):
    """--timeline FILE.svg: the last step's pipeline timeline (rank 0)."""
    pl, a, pp = summary["pipeline"], s.args, s.grid.pp_size
    with open(a.timeline, "w") as f:
        f.write(draw.timeline_svg(pl["last_step_timeline"], pp,
                                  f"{a.schedule} p={pp} m={a.micro_batches}"
                                  + (f" V={a.virtual_stages}" if a.virtual_stages > 1 else "") + ": "
                                  f"bubble {pl['bubble_measured']:.3f} "
                                  f"(theory {pl['bubble_theory']:.3f})"))
    s.say(f"  timeline drawn in {a.timeline}")
