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

CP_WORDS = {   # --cp-impl: how the summary says its attention talks
    "ring": "ring attention, K and V passing round {C} ranks",
    "ulysses": "Ulysses, all-to-alls from sequence shards to head shards over {C} ranks and back",
    "allgather": "all-gather of K and V over {C} ranks, reduce-scatter of their gradients",
    "hybrid": "hybrid, Ulysses' all-to-alls inside groups of consecutive cp ranks, ring attention across "
              "them ({C} ranks in all)",
}



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


def placement_warning(grid) -> str | None:
    """The tp group should sit inside one host: Megatron's all-reduces are on every layer's
    critical path; so should the cp group, whose ring passes K and V on every layer. A layout
    that puts either across hosts runs, with this warning."""
    if grid.tp_size > 1 and grid.tp_group.n_nodes > 1:
        return (f"  warning: the tp group of rank {grid.rank} spans hosts "
                f"{', '.join(grid.tp_group.hosts)}: every layer's all-reduces cross the link (the "
                f"summary measures it); place tp inside a host (e.g. mpirun -ppn a multiple of --tp "
                f"{grid.tp_size}, docs/cluster.md)")
    if grid.cp_size > 1 and grid.cp_group.n_nodes > 1:
        return (f"  warning: the cp group of rank {grid.rank} spans hosts {', '.join(grid.cp_group.hosts)}: "
                f"every layer's ring messages cross the link; place tp x cp inside a host (mpirun -ppn "
                f"a multiple of tp x cp = {grid.tp_size * grid.cp_size})")
    return None


def n_buckets(session) -> int:
    """Bucketed data parallelism's bucket count for this model (data_parallel.bucket_members)."""
    nbytes = [p.data.nbytes for p in session.model.parameters()]
    return len(data_parallel.bucket_members(nbytes, session.args.bucket_mb))


def mechanisms(session) -> str:
    """One line: which mechanisms this run exercises."""
    args, grid = session.args, session.grid
    out = []
    if grid.dp_size > 1:
        out.append(f"data parallelism over {grid.dp_size} ranks"
                   + (f" with ZeRO stage {args.zero}" if args.zero else f" ({args.dp_mode} all-reduce)"))
    elif args.zero and grid.grad_group.size > 1:
        out.append(f"ZeRO stage {args.zero} over the {grid.grad_group.size} cp ranks")
    elif args.zero:
        out.append(f"ZeRO stage {args.zero} (over a single dp rank: nothing to shard)")
    if grid.tp_size > 1:
        out.append(f"tensor parallelism over {grid.tp_size} ranks"
                   + (" with sequence parallelism" if args.sp else ""))
    elif args.sp:
        out.append("sequence parallelism over tp 1 (nothing to split)")
    if grid.cp_size > 1:
        out.append(f"context parallelism over {grid.cp_size} ranks ({args.cp_layout}, {args.cp_impl} attention)")
    if session.cfg.moe_experts:
        cfg = session.cfg
        out.append(f"mixture of experts (E={cfg.moe_experts}, top-{cfg.moe_top_k}, {cfg.moe_router}'s loss"
                   + (f", {cfg.moe_shared_experts} shared" if cfg.moe_shared_experts else "") + ")"
                   + (f", expert parallelism over {grid.ep_size} ranks" if grid.ep_size > 1 else ""))
    if grid.pp_size > 1:
        out.append(f"pipeline parallelism over {grid.pp_size} stages "
                   f"({args.schedule}, {args.micro_batches} micro-batches)")
    elif args.micro_batches > 1:
        out.append(f"gradient accumulation over {args.micro_batches} micro-batches")
    if args.precision != "fp32":
        out.append(f"mixed precision ({args.precision})")
    if args.recompute != "none":
        out.append(f"{args.recompute} activation recomputation")
    if getattr(args, "attention", "plain") == "tiled":
        out.append(f"tiled attention (blocks of {args.attn_block} queries and keys)")
    return "  mechanisms: " + ("; ".join(out) if out else
                               "none (one process, the single-process baseline)")


def describe(session) -> list[str]:
    """The start-up lines: model, mechanisms, layout and what each mechanism splits."""
    args, cfg, grid, model, opt = session.args, session.cfg, session.grid, session.model, session.opt
    B, T, M, dp = args.batch_size, cfg.block_size, args.micro_batches, grid.dp_size
    mixed = args.precision != "fp32"
    lines = [f"minipar: {cfg.family.describe(cfg)} T={T} V={cfg.vocab_size} "
             f"({'tied' if cfg.tie_embeddings else 'untied'}), "
             f"{model.num_params():,} params, {args.dtype}"
             + (f", --precision {args.precision}" if mixed else ""), mechanisms(session)]
    if mixed:
        sc = opt.scaler
        lines.append(f"  precision: parameters, gradients and activations in {opt.dtype.name}, "
                     f"matmuls and other "
                     f"ops computed in float32; fp32 master weights, m and v in the optimizer; "
                     + (f"dynamic loss scale from {sc.scale:g}, x{sc.growth_factor:g} "
                        f"after {sc.growth_interval} "
                        f"clean steps, x{sc.backoff_factor:g} and skip on inf/NaN" if sc.dynamic
                        else "no loss scaling (a step with an inf/NaN gradient is skipped)"))
    mode = "" if not session.has_dp or args.zero else (f", {args.dp_mode} gradient all-reduce" + (
        f" in {n_buckets(session)} bucket(s) of <= {args.bucket_mb:g} MiB"
        if args.dp_mode == "bucketed" else ""))
    lines.append(f"  layout: {session.world} process(es), {grid.describe()}{mode}")
    if grid.world.n_nodes > 1:
        w = grid.world
        lines.append(f"  hosts: {w.n_nodes}, " + "; ".join(
            f"{name}: ranks {', '.join(str(q) for q, n in enumerate(w.nodes) if n == h)}"
            for h, name in enumerate(w.hosts)))
        for axis, group in (("dp", grid.dp_group), ("cp", grid.cp_group), ("tp", grid.tp_group), ("pp", grid.pp_group)):
            if group is None:
                continue
            if comm.spans_hosts(group):
                lines.append(f"  {axis} group of rank 0: {group.size} ranks on {group.n_nodes} hosts: "
                             f"its all-reduces, reduce-scatters and all-gathers above "
                             f"{comm.ALL_REDUCE_DOUBLING_MAX_BYTES // 1024} KiB run "
                             f"hierarchically (inside each host, then across)")
        warning = placement_warning(grid)
        if warning:
            lines.append(warning)
    if grid.tp_size > 1:
        tp, Hkv = grid.tp_size, cfg.kv_heads
        kv = "" if cfg.arch == "gpt2" else (f"{Hkv // tp} of {Hkv} key/value heads, " if Hkv >= tp else
                                            f"1 of {Hkv} key/value heads (each on {tp // Hkv} ranks), ")
        lines.append(f"  tensor parallel: each tp rank holds {cfg.n_head // grid.tp_size} of "
                     f"{cfg.n_head} heads, {kv}1/{grid.tp_size} of every MLP, "
                     f"{model.vocab_per_rank} of {model.vocab_padded} vocabulary rows "
                     f"(V={cfg.vocab_size}"
                     f"{' padded' if model.vocab_padded != cfg.vocab_size else ''}); "
                     f"{model.num_local_params():,} of {model.num_params():,} parameters")
        if args.sp:
            lines.append(f"  sequence parallel: between the tensor-parallel layers each tp rank holds "
                         f"{T // grid.tp_size} of the {T} positions of every sequence (the norms, "
                         f"residual stream, embeddings); f and g all-gather and reduce-scatter "
                         f"along the sequence")
    if grid.cp_size > 1:
        C = grid.cp_size
        lines.append(f"  context parallel: each cp rank holds {T // C} of the {T} positions of every "
                     f"sequence ({args.cp_layout}: this rank "
                     + ", ".join(f"{p[0]}..{p[-1]}" for p in np.split(session.context.positions(T), 2))
                     + f"); attention: {CP_WORDS[args.cp_impl].format(C=C)}; gradients "
                       f"summed over dp x cp = {grid.grad_group.size} rank(s)")
    if session.pipe is not None:
        pp, V = grid.pp_size, args.virtual_stages
        held = [schedules.rank_layers(cfg.n_layer, r, pp, V) for r in range(pp)]
        lines.append(f"  pipeline: {pp} stages" + (f" of {V} chunks each (interleaved)" if V > 1 else "")
                     + ", layers " + ", ".join(" + ".join(f"{c.start}..{c.stop - 1}" for c in chunks)
                                               for chunks in held)
                     + (f" (stage 0 + wte/wpe, stage {pp - 1} + ln_f/head" if cfg.arch == "gpt2" else
                        f" (stage 0 + embed_tokens, stage {pp - 1} + norm/head")
                     + (f", tied {'wte' if cfg.arch == 'gpt2' else 'embed_tokens'} copied to the last stage"
                        if cfg.tie_embeddings else "")
                     + f"); {args.schedule} schedule over {M} micro-batch(es), bubble in theory "
                       f"{session.pipe.bubble_theory:.3f}")
    if args.zero:
        shards, z = grid.grad_group.size, session.sync
        hybrid = (f"; hybrid: sharded inside groups of {z.N}" + (" (the ranks of a host)" if args.shard_group == "host"
                                                                else "")
                  + f", replicated across {z.R}" if z.R > 1 else "")
        lines.append(f"  ZeRO stage {args.zero} over {shards} rank(s) (dp x cp"
                     + (f"; experts over their {grid.expert_group.size} replica(s)" if grid.ep_size > 1 else "")
                     + hybrid + "): "
                     + {1: "optimizer state", 2: "optimizer state and gradients",
                        3: "optimizer state, gradients and parameters"}[args.zero]
                     + f" sharded in {len(z.units)} units (wte, each block, the rest), "
                       f"each padded to a "
                       f"multiple of {shards} ({z.padding} padding elements on this rank)")
    lines.append(f"  batch: {B} x {T} tokens; each dp rank {B // dp} sequences in "
                 f"{M} micro-batch(es) of "
                 f"{B // dp // M}")
    lines.append(f"  data: {args.data or data.BUILTIN_NAME + ' corpus'}, "
                 f"{len(session.spec.tokens):,} tokens; steps "
                 f"{session.spec.start}..{args.steps - 1}; lr {args.lr:g} {args.lr_schedule}, warm-up {args.warmup}"
                 + (f"; resumed from {args.resume}" if session.spec.meta is not None else ""))
    return lines


def plan_lines(session) -> list[str]:
    """--dry-run: what the planner (python -m minipar.plan, the same flags) expects a rank of
    each pipeline stage to hold and send per step; the run's summary measures the same."""
    grid = session.grid
    r = table.plan(session.cfg, grid.layout)
    lines = []
    for mem, sent in zip(r["memory_per_stage"], r["comm_per_stage"]):
        where = f"a rank of stage {mem['stage']}" if grid.pp_size > 1 else "each rank"
        lines.append(f"  plan: {where} holds {human_bytes(mem['model_states'])} of model states + "
                     f"{human_bytes(mem['activations'])} of activations at peak, sends "
                     f"{human_bytes(sent['bytes_per_step'])}/step (dp {human_bytes(sent['dp'])}, "
                     f"tp {human_bytes(sent['tp'])}, pp {human_bytes(sent['pp'])}"
                     + (f", cp {human_bytes(sent['cp'])}" if grid.cp_size > 1 else "")
                     + (f", ep {human_bytes(sent['ep'])}" if grid.ep_size > 1 else "") + ")")
    return lines


def progress_line(session, row: dict) -> str:
    exposed = f" (exposed {row['exposed_comm_s'] * 1e3:.1f} ms)" if session.has_dp else ""
    dynamic = session.args.precision != "fp32" and session.opt.scaler.dynamic
    scaling = f" | scale {row['loss_scale']:g}" if dynamic else ""
    return (f"step {row['step']:5d} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
            f"norm {row['grad_norm']:7.3f} | "
            f"{row['tokens_per_s']:8.0f} tok/s | MFU {row['mfu']:5.1%} | "
            f"comm {human_bytes(row['comm_bytes'])}"
            + exposed + scaling + (" | skipped (inf/NaN gradient)" if row["skipped"] else ""))


def summarize(session, rows_log, elapsed, val_loss, digest, stages, tp_ledger) -> tuple[dict, list[str]]:
    """docs/design.md §8's summary object and the lines that print it: the common part (loss,
    memory, tokens/s, MFU, layout), then each mechanism in use reporting itself, in the fixed
    order of in_use (its dict under its key, its lines). stages: every pipeline stage's
    stats on pp rank 0 (else None); tp_ledger: tensor_parallel.traffic() of the training
    steps."""
    args, cfg, grid, model, opt = session.args, session.cfg, session.grid, session.model, session.opt
    losses = [r["loss"] for r in rows_log]
    B, T = args.batch_size, cfg.block_size
    steps_run = len(rows_log)
    mem = memory_report(model, opt)
    per_rank = memory_per_rank(grid.world, mem)                 # collective over the world
    summary = {"summary": True, "params_count": model.num_params(), "steps": steps_run,
               "first_loss": losses[0], "final_loss": losses[-1], "val_loss": val_loss,
               "unigram_entropy": data.unigram_entropy(session.spec.tokens),
               "tokens_per_s": B * T * steps_run / elapsed,
               "mfu": session.flops_step * steps_run / elapsed / session.peak,
               "peak_flops": session.peak, "seconds": elapsed, "memory": mem, "memory_per_rank": per_rank,
               "layout": {"dp": grid.dp_size, "cp": grid.cp_size, "tp": grid.tp_size, "pp": grid.pp_size,
                          "zero": args.zero},
               "data_parallel": None}      # always reported (in_use): its place in §8's key order
    f = mem["formula"]
    lines = [f"summary: {steps_run} steps in {elapsed:.1f} s, "
             f"{summary['tokens_per_s']:,.0f} tok/s, "
             f"MFU {summary['mfu']:.1%} of {session.world} x {session.peak / session.world / 1e9:.0f} GFLOP/s "
             f"{args.dtype} matmul peak",
             f"  loss {losses[0]:.3f} -> {losses[-1]:.3f} (val {val_loss:.3f}); "
             f"a model that ignores context "
             f"scores {summary['unigram_entropy']:.3f} nats (the unigram entropy of the data)",
             f"  memory per rank: params {human_bytes(mem['params'])}, "
             f"grads {human_bytes(mem['grads'])}, "
             f"optimizer {human_bytes(mem['optimizer'])}; formula {f['text']} = "
             f"{human_bytes(f['params'])} + {human_bytes(f['grads'])} + "
             f"{human_bytes(f['optimizer'])}"]
    for key, (out, more) in in_use(session, rows_log, mem, digest, stages, tp_ledger):
        if key is not None:
            summary[key] = out
        lines += more
    return summary, lines


def in_use(session, rows_log, mem, digest, stages, tp_ledger):
    """(its key in the summary or None, (its dict, its lines)) of each mechanism this run
    uses, in the summary's order: precision, ZeRO, data parallel (always; with the replicas'
    hash), hosts, pipeline, tensor or sequence parallel, context parallel, MoE, expert
    parallel, checkpoint. Each summary takes plain figures, read here from the session."""
    args, cfg, g, model, sync = session.args, session.cfg, session.grid, session.model, session.sync
    M = args.micro_batches
    P_bytes = sum(p.data.nbytes for p in model.parameters())
    n_sum = g.grad_group.size                                # the ranks gradients are summed over: dp x cp
    experts = None
    if g.ep_size > 1:                                       # experts: over their dp/ep replicas
        experts = (g.expert_group.size, sum(p.data.nbytes for n, p in model.named_parameters()
                                            if expert_parallel.expert_of(n) is not None))
    theory = data_parallel.grad_sync_theory(P_bytes, n_sum, experts)
    rows = args.batch_size // g.dp_size // M                  # sequences per micro-batch of this dp rank
    layers = [i for chunk in schedules.rank_layers(cfg.n_layer, g.pp_rank, g.pp_size, args.virtual_stages)
              for i in chunk]                             # the blocks this rank runs
    if args.precision != "fp32":
        yield "precision", mixed_precision.summary(args.precision, session.opt.dtype.name, session.opt.scaler,
                                                   session.opt.step_count, rows_log)
    if args.zero:
        yield "zero", zero_summary.summary(sync, mem, rows_log, M, theory, g.world.n_nodes)
    yield "data_parallel", data_parallel.summary(
        rows_log, mode=f"zero{args.zero}" if args.zero else args.dp_mode if session.has_dp else None,
        buckets=(len(sync.units) if args.zero
                 else n_buckets(session) if session.has_dp and args.dp_mode == "bucketed" else 0),
        theory=theory, P_bytes=P_bytes, digest=digest, ranks=n_sum, cp=g.cp_size, ep=g.ep_size)
    if g.world.n_nodes > 1:
        yield "hosts", grid.hosts_summary(g.world.hosts, [g.world.hosts[n] for n in g.world.nodes], rows_log,
                                          g.tp_group.n_nodes > 1)
    if stages is not None:                                # pp rank 0 (world rank 0 among them)
        pipe = session.pipe
        yield "pipeline", pipeline_summary.summary(args.schedule, pipe.model.n_stages, M, pipe.model.n_chunks,
                                                   pipe.bubble_theory, stages, rows_log, draw.ascii_gantt)
    if g.tp_size > 1:
        tp = sequence_parallel if args.sp else tensor_parallel
        yield "tensor_parallel", tp.summary(tp_ledger, rows_log, cfg, tp=g.tp_size, rows=rows, micro_batches=M,
                                            layers=len(layers), pp_rank=g.pp_rank, pp=g.pp_size,
                                            recompute=args.recompute, cp=g.cp_size,
                                            moe_blocks=sum(cfg.is_moe(i) for i in layers))
    if g.cp_size > 1:
        itemsize = 4 if args.precision != "fp32" else np.dtype(session.spec.dtype).itemsize   # fp16/bf16 attend in fp32
        yield "context_parallel", context_parallel.summary(
            rows_log, cfg, cp=g.cp_size, layout=args.cp_layout, rows=rows, micro_batches=M, layers=len(layers),
            tp=g.tp_size, itemsize=itemsize, recompute=args.recompute, impl=args.cp_impl,
            ulysses=session.context.ulysses, groups=session.context.sent())
    if cfg.moe_experts:
        yield "moe", moe.summary_lines(rows_log)
    if g.ep_size > 1:
        yield "expert_parallel", expert_parallel.summary(
            rows_log, cfg, ep=g.ep_size, expert_replicas=g.expert_group.size,
            moe_layers=sum(cfg.is_moe(i) for i in layers), micro_batches=M, recompute=args.recompute)
    if args.save:
        yield None, checkpoint.summary(args.save, args.steps, world=session.world, zero=args.zero, grad_ranks=n_sum,
                                       cp=g.cp_size, replicas=getattr(sync, "R", 1) if args.zero else 1)


def json_safe(row: dict) -> dict:
    """inf and NaN (a skipped step's gradient norm) as null: the log stays strict JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()}


def draw_timeline(session, summary: dict):
    """--timeline FILE.svg: the last step's pipeline timeline (rank 0)."""
    pl, args, pp = summary["pipeline"], session.args, session.grid.pp_size
    with open(args.timeline, "w") as f:
        f.write(draw.timeline_svg(pl["last_step_timeline"], pp,
                                  f"{args.schedule} p={pp} m={args.micro_batches}"
                                  + (f" V={args.virtual_stages}" if args.virtual_stages > 1 else "") + ": "
                                  f"bubble {pl['bubble_measured']:.3f} "
                                  f"(theory {pl['bubble_theory']:.3f})"))
    session.say(f"  timeline drawn in {args.timeline}")
