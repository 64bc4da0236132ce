"""What a training run tells its user: the start-up description, the progress line, the
closing summary (docs/design.md §8's `summary` object and its printed lines), and --verify's
comparison with the single-process twin.

Every function here reads a trainer session `s` (train.Session: args, cfg, grid, model,
opt, sync, pipe, ...) and the figures the run measured; none sends a message. Each
mechanism reports the same way: what was measured (bytes from nbytes and the ledger,
seconds from the clock) beside its formula.
"""
from __future__ import annotations

import math

import numpy as np

from minipar import comm
from minipar.train import data
from minipar.show import draw
from minipar.model import moe
from minipar.plan import layout, table
from minipar.optim import mixed_precision
from minipar.optim.adamw import AdamW
from minipar.parallel.context import context_parallel
from minipar.parallel import data_parallel
from minipar.parallel.expert import expert_parallel
from minipar.parallel.pipeline import stage as pipeline, schedules, zero_bubble
from minipar.parallel.tensor import sequence_parallel, tensor_parallel
from minipar.parallel.zero import formulas as zero, optimizer as zero_optimizer
from minipar.plan.peak import human_bytes



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
    placement = getattr(model.moe, "placement", None)           # --ep: other ranks' experts
    if placement is not None:
        P -= expert_parallel.held_elsewhere(model.cfg, getattr(model, "layers", range(model.cfg.n_layer)),
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


def hosts_summary(g, rows_log) -> dict:
    """A job across hosts: where the ranks are, and the bytes per step this rank sent by
    axis, in all and across hosts (the ledger's bytes_sent_inter)."""
    axes = sorted({a for r in rows_log for a in r["bytes_by_axis"]})
    return {"hosts": list(g.world.hosts), "rank_host": [g.world.hosts[n] for n in g.world.nodes],
            "bytes_per_step": {a: float(np.mean([r["bytes_by_axis"].get(a, 0) for r in rows_log])) for a in axes},
            "inter_host_bytes_per_step": {a: float(np.mean([r["inter_host_bytes_by_axis"].get(a, 0)
                                                            for r in rows_log])) for a in axes},
            "tp_spans_hosts": g.tp_group.n_nodes > 1}


def hosts_line(h: dict) -> str:
    per = ", ".join(f"{a} {human_bytes(h['inter_host_bytes_per_step'][a])} of {human_bytes(n)}"
                    for a, n in h["bytes_per_step"].items())
    return f"  across {len(h['hosts'])} hosts: sent per step to other hosts (of all sent), by axis: {per}"


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
    a, g = s.args, s.grid
    lay = layout.Layout(dp=g.dp_size, tp=g.tp_size, pp=g.pp_size, zero=a.zero, micro_batches=a.micro_batches,
                      batch_size=a.batch_size, precision=a.precision, dtype=a.dtype, schedule=a.schedule,
                      dp_mode=a.dp_mode, bucket_mb=a.bucket_mb, sp=a.sp, recompute=a.recompute,
                      virtual_stages=a.virtual_stages, cp=g.cp_size, cp_layout=a.cp_layout, ep=g.ep_size)
    r = table.plan(s.cfg, lay)
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
    """docs/design.md §8's summary object and the lines that print it. stages: every pipeline
    stage's stats on pp rank 0 (else None); tp_ledger: tensor_parallel.traffic() of the
    training steps."""
    a, cfg, g, model, opt, sync = s.args, s.cfg, s.grid, s.model, s.opt, s.sync
    losses = [r["loss"] for r in rows_log]
    B, T, M, dp, pp = a.batch_size, cfg.block_size, a.micro_batches, g.dp_size, g.pp_size
    steps_run = len(rows_log)
    mixed = a.precision != "fp32"
    mem = memory_report(model, opt)
    per_rank = memory_per_rank(g.world, mem)                 # collective over the world
    P_bytes = sum(p.data.nbytes for p in model.parameters())
    grad_sync = float(np.mean([r["grad_sync_bytes"] for r in rows_log]))
    n_sum = g.grad_group.size                                # the ranks gradients are summed over: dp x cp
    theory = 2 * (n_sum - 1) / n_sum * P_bytes
    if g.ep_size > 1:                                       # experts: over their dp/ep replicas
        ne, Pe = g.expert_group.size, sum(p.data.nbytes for n, p in model.named_parameters()
                                          if expert_parallel.expert_of(n) is not None)
        theory = 2 * (n_sum - 1) / n_sum * (P_bytes - Pe) + 2 * (ne - 1) / ne * Pe
    exposed = float(np.mean([r["exposed_comm_s"] for r in rows_log]))
    step_time = float(np.mean([r["step_time"] for r in rows_log]))
    summary = {"summary": True, "params_count": model.num_params(), "steps": steps_run,
               "first_loss": losses[0], "final_loss": losses[-1], "val_loss": val_loss,
               "unigram_entropy": data.unigram_entropy(s.spec.tokens),
               "tokens_per_s": B * T * steps_run / elapsed,
               "mfu": s.flops_step * steps_run / elapsed / s.peak,
               "peak_flops": s.peak, "seconds": elapsed, "memory": mem, "memory_per_rank": per_rank,
               "layout": {"dp": dp, "cp": g.cp_size, "tp": g.tp_size, "pp": pp, "zero": a.zero},
               "data_parallel": {"mode": f"zero{a.zero}" if a.zero else
                                 a.dp_mode if s.has_dp else None,
                                 "buckets": len(sync.units) if a.zero else
                                 n_buckets(s) if s.has_dp and a.dp_mode == "bucketed" else 0,
                                 "grad_sync_bytes_per_step": grad_sync,
                                 "theory_bytes_per_step": theory,
                                 "exposed_comm_s_per_step": exposed,
                                 "step_time_s": step_time,
                                 "replicas_sha256_16": digest}}
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
    if mixed:
        skips = [r["step"] for r in rows_log if r["skipped"]]
        sc = opt.scaler
        summary["precision"] = {"mode": a.precision, "storage_dtype": opt.dtype.name,
                                "loss_scale_final": sc.scale, "dynamic_scaling": sc.dynamic,
                                "skipped_steps": len(skips), "first_skipped": skips[:10],
                                "optimizer_steps": opt.step_count}
        lines.append(f"  precision {a.precision}: {len(skips)} of {steps_run} steps skipped"
                     + (f" (steps {', '.join(map(str, skips[:10]))}"
                        f"{' ...' if len(skips) > 10 else ''})"
                        if skips else "")
                     + (f"; loss scale now {sc.scale:g}, "
                        f"{sc.good_steps} clean steps since its last change"
                        if sc.dynamic else ""))
    if a.zero:
        z = summary["zero"] = {
            **mem["zero"], "bytes_per_step": float(np.mean([r["zero_bytes"] for r in rows_log])),
            "theory_bytes_per_step": sync.traffic_theory(M), "plain_dp_bytes_per_step": theory}
        ratio = (z["bytes_per_step"] / z["theory_bytes_per_step"] if z["theory_bytes_per_step"]
                 else float("nan"))
        calls = {1: "reduce-scatter + all-gather", 2: f"{M} reduce-scatter(s) + all-gather",
                 3: f"{M} x (2 all-gathers + reduce-scatter)"}[a.zero]
        lines.append(f"  ZeRO {a.zero}: sent {human_bytes(z['bytes_per_step'])}/step per rank; "
                     f"theory {calls} of "
                     f"(N-1)/N x {human_bytes(z['P_padded'] * sync.dtype.itemsize)} = "
                     f"{human_bytes(z['theory_bytes_per_step'])} (ratio {ratio:.3f}); "
                     f"plain data parallelism would send {human_bytes(theory)}"
                     + (f" (x{z['bytes_per_step'] / theory:.2f})" if theory else "")
                     + f"; waiting for reduce-scatters after backward {exposed * 1e3:.1f} ms/step")
    elif s.has_dp:
        ratio = grad_sync / theory if theory else float("nan")
        lines.append(f"  data parallel: gradient all-reduce sent {human_bytes(grad_sync)}/step "
                     f"per rank; theory 2(p-1)/p x {human_bytes(P_bytes)}"
                     + (" (experts' p: their replicas)" if g.ep_size > 1 else "") + f" = {human_bytes(theory)} "
                     f"(ratio {ratio:.3f}); exposed comm "
                     f"{exposed * 1e3:.1f} ms/step ({exposed / step_time:.0%} of the step)")
    if digest is not None:
        lines.append(f"  replicas identical across {n_sum} " + ("dp" if g.cp_size == 1 else "dp x cp")
                     + f" ranks (weights sha256 {digest})")
    if g.world.n_nodes > 1:
        summary["hosts"] = hosts_summary(g, rows_log)
        lines.append(hosts_line(summary["hosts"]))
    if stages is not None:                                # pp rank 0 (world rank 0 among them)
        pl = summary["pipeline"] = pipeline_summary(a, s.pipe, stages, rows_log)
        V = pl["virtual_stages"]
        lines.append(f"  pipeline: {a.schedule}, p={pp}, m={M}" + (f", V={V}" if V > 1 else "")
                     + f": bubble measured {pl['bubble_measured']:.3f} (mean "
                     f"over stages; per stage "
                     + " ".join(f"{b:.3f}" for b in pl["bubble_per_stage"])
                     + f"), theory {pl['bubble_theory']:.3f} with equal op times, "
                       f"{pl['bubble_theory_from_times']:.3f} with the measured ones, "
                       f"{pl['bubble_simulated']:.3f} simulated with each stage's own; "
                       f"sent {human_bytes(pl['bytes_sent_per_step'])}/step "
                       f"by stage 0")
        lines.append("  one micro-batch's F / B / W per stage (ms): " + "; ".join(
            "/".join(f"{t * 1e3:.2f}" for t in ops) for ops in pl["op_seconds_per_stage"])
            + (" (B is the whole backward: no W)" if not a.schedule.startswith("zb") else ""))
        unit = "micro-batches" if V == 1 else "chunk graphs of the largest"   # interleaved: a chunk's graph
        lines.append("  saved activations at peak per stage: " + ", ".join(
            f"{human_bytes(b)} ({b / max(u, 1):.1f} {unit})" for b, u in
            zip(pl["peak_activation_bytes"], pl["microbatch_activation_bytes"])))
        timeline = [r for st in stages for r in st["timeline"]]
        lines.append(f"  last step's timeline ({pl['step_time_s'][0] * 1e3:.1f} ms on stage 0; "
                     f"F forward, B backward" + (", W weight gradients" if a.schedule.startswith("zb") else "")
                     + (", lower case chunk 1" if V > 1 else "") + ", digits the micro-batch, '.' idle):")
        lines += ["    " + line for line in draw.ascii_gantt(timeline, pp, width=100).splitlines()]
    if g.tp_size > 1:
        summary["tensor_parallel"], line = tensor_parallel_summary(s, rows_log, tp_ledger)
        lines.append(line)
    if g.cp_size > 1:
        summary["context_parallel"], line = context_parallel.summary(s, rows_log)
        lines.append(line)
    if s.cfg.moe_experts:
        summary["moe"], more = moe.summary_lines(rows_log)
        lines += more
    if g.ep_size > 1:
        summary["expert_parallel"], line = expert_parallel.summary(s, rows_log)
        lines.append(line)
    if a.save:
        writers = s.world if a.zero else s.world // n_sum             # see checkpoint.save_run
        who = ("one process" if s.world == 1 else "every rank" if writers == s.world
               else "dp rank 0 of each (tp, pp)" if g.cp_size == 1 else "dp rank 0, cp rank 0 of each (tp, pp)")
        lines.append(f"  checkpoint: {a.save} (step {a.steps}): model.npz and "
                     f"{writers} optimizer shard(s) in "
                     f"{a.save}/optim, written by {who}")
    return summary, lines


def tensor_parallel_summary(s, rows_log: list, tp_ledger: dict) -> tuple[dict, str]:
    """What tensor (and sequence) parallelism sent on this rank, per step, beside the
    formula: Megatron's 4L + 5 all-reduces (tensor_parallel.megatron_count), or with --sp
    sequence_parallel.sp_count's gathers, scatters and sums; of this rank's pipeline stage."""
    a, cfg, g = s.args, s.cfg, s.grid
    M, pp, T = a.micro_batches, g.pp_size, cfg.block_size
    rows = a.batch_size // g.dp_size // M
    layers = sum(len(c) for c in schedules.rank_layers(cfg.n_layer, g.pp_rank, pp, a.virtual_stages))
    first, last = g.pp_rank == 0, g.pp_rank == pp - 1
    steps_run = len(rows_log)
    tp_bytes = float(np.mean([r["tp_bytes"] for r in rows_log]))
    kinds = {k: v for k, v in tp_ledger.items() if k != "grad_norm"}
    calls = sum(v["calls"] for v in kinds.values()) / steps_run
    elements = sum(v["elements"] for v in kinds.values()) / steps_run
    out = {"tp": g.tp_size, "sequence_parallel": a.sp,
           ("collectives_per_step" if a.sp else "all_reduces_per_step"): calls,
           "elements_per_step": elements, "bytes_per_step": tp_bytes}
    if a.sp:
        want = sequence_parallel.sp_count(cfg, rows, T, g.tp_size, layers, first, last, a.recompute)
        out["by_kind"] = {k: {"calls": v["calls"] / steps_run, "elements": v["elements"] / steps_run,
                              "formula_calls": M * want[k][0], "formula_elements": M * want[k][1]}
                          for k, v in kinds.items()}
        exact = all(v["calls"] == v["formula_calls"] and v["elements"] == v["formula_elements"]
                    for v in out["by_kind"].values()) and set(kinds) == set(want)
        return out, (f"  sequence parallel: {calls:.0f} collectives/step of {elements:,.0f} elements "
                     f"({', '.join(f'{k} {v[0] * M}' for k, v in want.items())}: "
                     f"{'= sp_count' if exact else 'NOT sp_count'} x {M} micro-batch(es)), "
                     f"{human_bytes(tp_bytes)}/step sent per rank, + 1 for the global grad norm")
    want_calls, want_elems = tensor_parallel.megatron_count(cfg, rows, T, layers, first, last, a.recompute)
    out.update(megatron_all_reduces_per_step=want_calls * M, megatron_elements_per_step=want_elems * M)
    return out, (f"  tensor parallel: {calls:.0f} all-reduces/step of {elements:,.0f} elements (Megatron: "
                 f"{'(4L+5)' if pp == 1 else 'stage ' + str(g.pp_rank) + ', 4 x its layers + ends'}"
                 f"{' + 2L again (full recompute)' if a.recompute == 'full' else ''} x {M} "
                 f"micro-batch(es) = {want_calls * M}, {want_elems * M:,} elements), "
                 f"{human_bytes(tp_bytes)}/step sent per rank, + 1 for the global grad norm")


def simulated_bubble(schedule: str, p: int, m: int, V: int, stages) -> float:
    """The schedule run by schedules.check with each stage's own measured F, B and W of a
    micro-batch (a chunk's: 1/V of them): the theory for this pipeline as it is, unequal
    stages included, with messages free."""
    ops = [st["op_seconds"] for st in stages]
    split = schedule.startswith("zb")
    return schedules.check(p, m, schedule, virtual=V, forward_time=[f / V for f, _, _ in ops],
                           backward_time=[(b + w) / V for _, b, w in ops],
                           weight_time=[w / V for _, _, w in ops] if split else None).bubble


def pipeline_summary(args, pipe, stages, rows_log) -> dict:
    """docs/design.md §8's `pipeline` figures from every stage's stats (gathered on pp rank 0).
    bubble_measured: 1 - sum of busy time / (p * makespan), the mean over stages of each
    stage's idle fraction of the step's longest stage span, averaged over the steps after
    the first (the first pays for warming caches); pipeline.py's docstring."""
    f, b, w = np.mean([st["op_seconds"] for st in stages], axis=0)
    p, m, V = pipe.model.n_stages, args.micro_batches, pipe.model.n_chunks
    return {"schedule": args.schedule, "stages": p, "virtual_stages": V,
            "micro_batches": m,
            "bubble_measured": float(np.mean([st["bubble_mean"] for st in stages])),
            "bubble_per_stage": [st["bubble_mean"] for st in stages],
            "bubble_theory": pipe.bubble_theory,
            "op_seconds_per_stage": [st["op_seconds"] for st in stages],
            "bubble_theory_from_times": zero_bubble.bubble_from_times(args.schedule, p, m, f, b, w, V),
            "bubble_simulated": simulated_bubble(args.schedule, p, m, V, stages),
            "peak_activation_bytes": [st["peak_activation_bytes"] for st in stages],
            "microbatch_activation_bytes": [st["microbatch_activation_bytes"] for st in stages],
            "step_time_s": [st["step_time"] for st in stages],
            "bytes_sent_per_step": float(np.mean([r["pp_bytes"] for r in rows_log])),
            "last_step_timeline": [list(r) for st in stages for r in st["timeline"]]}


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
