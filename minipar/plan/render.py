"""The table `python -m minipar.plan` prints: plan()'s dict, human-readable (memory, FLOPs and
bytes sent by stage, the MoE, activations per layer, the sequence-length ceiling).
"""
from __future__ import annotations

from minipar.plan import context as plan_context, hosts as plan_hosts, shards as plan_shards
from minipar.comm.ledger import human_bytes


def _columns(pp: int) -> list:
    """Stages shown side by side: all of up to 4, else the first two and the last two."""
    return list(range(pp)) if pp <= 4 else [0, 1, pp - 2, pp - 1]


def _row(label: str, values, width: int = 14) -> str:
    return f"  {label:<22}" + "".join(f"{v:>{width}}" for v in values)


def _sci(x) -> str:
    return f"{x:.3e}"


def table(r: dict, name: str | None = None) -> str:
    """The human-readable form of plan()'s dict: memory, FLOPs and bytes sent, by stage."""
    lay, out = r["layout"], []
    what = f"{name}: " if name else ""
    if r["model"] is None:
        out.append(f"minipar.plan: {r['params']:,} parameters (--params: model states only)")
    else:
        shape = r["model"]
        active = f" ({r['params_active']:,} active per token)" if r["moe"] else ""
        out.append(f"minipar.plan: {what}{r['shape']['description']} T={shape['block_size']} V={shape['vocab_size']} "
                   f"({'tied' if shape['tie_embeddings'] else 'untied'}), {r['params']:,} parameters{active}")
    prec = lay["precision"] if lay["precision"] != "fp32" else lay["dtype"]
    devices = f"{lay['world']} device{'s' if lay['world'] > 1 else ''}"
    impl = lay["cp_impl"] or "ring"
    U = f", U={lay['cp_ulysses']}" if impl == "hybrid" else ""
    cp = f" cp={lay['cp']} ({impl}{U}, {lay['cp_layout']})" if lay["cp"] > 1 else ""
    ep = f" ep={lay['ep']}" if lay["ep"] > 1 else ""
    S = lay["shard_group"]
    shards = (f" in shard groups of {S} (R = {lay['dp'] * lay['cp'] // S} replicas)"
              if S is not None and S < lay["dp"] * lay["cp"] else "")
    out.append(f"  layout: dp={lay['dp']}{cp} tp={lay['tp']} pp={lay['pp']}{ep} ({devices}), "
               f"ZeRO {lay['zero']}{shards}, {prec}: {lay['bytes_per_param']} B per parameter and gradient, "
               f"{lay['optimizer_bytes_per_param']} B optimizer state")
    if r["model"] is not None:
        out.append(f"  batch: {lay['batch_size']} sequences; per dp rank {lay['micro_batches']} micro-batch(es) of "
                   f"{lay['micro_batch_rows']}" + (f"; {lay['schedule']} schedule"
                                                   + (f", V={lay['virtual_stages']}" if lay["virtual_stages"] > 1
                                                      else "") + f", bubble {r['bubble']:.3f}"
                                                   if lay["pp"] > 1 else ""))
    if r.get("moe"):
        out += moe_lines(r["moe"], r["model"]["n_layer"])
    h = r["hosts"]
    show_hosts = h["ranks_per_host"] is not None or h["inter_node_gbps"] or h["intra_node_gbps"]
    if show_hosts:
        out.append(plan_hosts.placement_line(r["hosts"]))
    cols = _columns(lay["pp"]) if r["model"] is not None else [0]
    mem = [r["memory_per_stage"][stage] for stage in cols]
    heads = [f"stage {stage}" for stage in cols] if r["model"] is not None else [""]
    out.append("")
    out.append(_row("memory per device", heads))
    out.append(_row("parameters held", [f"{row['params_local']:,}" for row in mem]))
    for key in ("params", "grads", "optimizer", "model_states"):
        out.append(_row(key.replace("_", " "), [human_bytes(row[key]) for row in mem]))
    if r["model"] is not None:
        out.append(_row("activations", [human_bytes(row["activations"]) for row in mem]))
        if lay["zero"] == 3:
            out.append(_row("ZeRO-3 gathered", [human_bytes(row["gathered"]) for row in mem]))
        held = "  micro-batches held" if lay["virtual_stages"] == 1 or lay["pp"] == 1 else "  chunk-micro-batches"
        out.append(_row(held, [row["micro_batches_in_flight"] for row in mem]))
        out.append(_row("total", [human_bytes(row["total"]) for row in mem]))
        fl = r["flops"]
        out.append("")
        out.append(_row("FLOPs per step", ["whole model"] + [f"stage {stage}" for stage in cols]))
        per = [r["flops_per_stage"][stage] for stage in cols]
        for key, v in fl["components"].items():
            out.append(_row(key.replace("_", " "), [_sci(v)] + [_sci(st["components"][key]) for st in per]))
        for key in ("forward", "backward", "total"):
            out.append(_row(key + (" (2x fwd)" if key == "backward" else ""),
                            [_sci(fl[key])] + [_sci(st[key]) for st in per]))
        out.append(_row("6ND" + (" (N active)" if r["moe"] else ""), [_sci(fl["six_nd"])]))
        if r["moe"]:                                      # the trainer's MFU numerator, K experts a token
            out.append(_row("per token (fwd+bwd)", [_sci(fl["per_token"])]))
        if fl["recompute_added"]:
            out.append(_row(f"+ {lay['recompute']} recompute", [_sci(fl["recompute_added"])]))
        out += activation_lines(r)
        out.append("")
        out.append(_row("comm sent per step", heads))
        sent = [r["comm_per_stage"][stage] for stage in cols]
        axes = (("dp", "dp (grads; ZeRO's)"), ("cp", f"cp ({lay['cp_impl'] or 'ring'})"), ("tp", "tp (Megatron)"),
                ("pp", "pp (point-to-point)"), ("ep", "ep (all-to-all)"), ("other", "other (8-byte scalars)"),
                ("bytes_per_step", "total"))
        for key, label in axes:
            if key not in ("cp", "ep") or lay[key] > 1:
                out.append(_row(label, [human_bytes(st[key]) for st in sent]))
        if show_hosts:
            out += plan_hosts.table_lines(r, cols, _row, human_bytes)
    if lay["pp"] > 4 and r["model"] is not None:
        out.append(f"  (stages {', '.join(map(str, cols))} of {lay['pp']} shown; --json has every stage)")
    if r.get("step_time_s") is not None:
        out.append(f"  step time at {r['layout']['device_tflops']:g} TFLOP/s per device: "
                   f"{r['step_time_s']:.3g} s of compute on the busiest stage"
                   + (f", {r['step_time_with_bubble_s']:.3g} s with the bubble" if lay["pp"] > 1 else ""))
    if r["seq_ceiling"] is not None:
        out += ceiling_lines(r["seq_ceiling"])
    if r.get("cp_impls"):
        budget = r["seq_ceiling"]["memory_budget"] if r["seq_ceiling"] else None
        out += plan_context.lines(r["cp_impls"], lay["cp_impl"] or "ring", r["hosts"]["inter_node_gbps"] is not None
                                  or r["hosts"]["intra_node_gbps"] is not None, budget)
    if r.get("zero_shard_groups"):
        out += plan_shards.lines(r["zero_shard_groups"])
    out += [f"  note: {n}" for n in r["notes"]]
    return "\n".join(out)


def moe_lines(m: dict, n_layer: int) -> list[str]:
    """The mixture of experts: its blocks and ep; the capacity of a micro-batch."""
    word = m.get("block_word", "h")
    blocks = ", ".join(f"{word}.{i}" for i in m["blocks"][:4]) + (", ..." if len(m["blocks"]) > 4 else "")
    ep = (f"; ep={m['ep']}: {m['experts_per_rank']} experts per rank, each summed over {m['expert_replicas']} "
          f"replica(s)" if m["ep"] > 1 else "")
    cap = (f"capacity factor {m['capacity_factor']:g}: {m['capacity']} slots per expert of a micro-batch's "
           f"{m['tokens_per_group']} tokens (balanced: {m['balanced_per_expert']:g} each)"
           if m["capacity"] is not None else "no capacity: nothing dropped")
    return [f"  moe: E={m['experts']} experts, top-{m['top_k']}, in {len(m['blocks'])} of {n_layer} blocks "
            f"({blocks}){ep}", f"       {cap}"]


def ceiling_lines(c: dict) -> list[str]:
    """The longest sequence that fits the budget, without cp and with it (seq_ceiling)."""
    out = ["", f"  longest sequence T in {human_bytes(c['memory_budget'])} per device (peak of model states "
               f"+ activations, the largest stage; block size = T)"]
    for key in ("without_cp", "with_cp"):
        s = c[key]
        label = "without cp" if key == "without_cp" else f"with cp={s['cp']}"
        if s["T"] is None:
            out.append(f"    {label:<14}none: T = {s['step']} already needs {human_bytes(s['bytes_at_next'])}")
            continue
        out.append(f"    {label:<14}T = {s['T']:>9,} ({human_bytes(s['bytes_at_T'])}; T + {s['step']} needs "
                   f"{human_bytes(s['bytes_at_next'])})")
    return out


def activation_lines(r: dict) -> list[str]:
    """Saved activations per layer, one micro-batch: minipar's formula in the six settings of
    Korthikanti et al. 2022 (Table 2) beside the paper's, this run's setting marked."""
    lay, a, shape = r["layout"], r["activations_per_layer"], r["model"]
    llama = shape["arch"] == "llama"                      # Table 2 is a GPT layer's: no paper's column
    letters = f" k={r['shape']['kv_heads']} f={r['shape']['hidden']}" if llama else ""
    width = max(32, *(len(row["minipar_formula"]) + 2 for row in a["table"]))
    paper = "" if llama else f"{'Korthikanti':>12}  Table 2 (2-byte values)"
    out = ["", f"  activations per layer, one micro-batch (s={shape['block_size']} b={lay['micro_batch_rows']} "
               f"h={shape['n_embd']} a={shape['n_head']}{letters} t={lay['tp']}, d={lay['bytes_per_param']}): "
               f"this run {human_bytes(a['this_run'])}",
           f"    {'setting':<17}{'minipar':>12}  {'formula':<{width}}{paper}".rstrip()]
    for row in a["table"]:
        mark = " <" if row["setting"] == a["setting"] else ""
        theirs = "" if llama else f"{human_bytes(row['korthikanti']):>12}  {row['korthikanti_formula']}"
        out.append(f"    {row['setting']:<17}{human_bytes(row['minipar']):>12}  "
                   f"{row['minipar_formula']:<{width if theirs else 0}}{theirs}{mark}")
    if llama:
        out.append("    (k/t is 1 when t > k)")
    if a["cp"] > 1:                                       # no row of Table 2: the ring's own
        out.append(f"    {'cp=' + str(a['cp']):<17}{human_bytes(a['this_run']):>12}  {a['cp_formula']:<{width}}"
                   f"{'' if llama else ' ' * 12}  (c = {a['cp']}: s/c tokens a rank, {a['cp_impl'] or 'ring'}, "
                   f"no softmax) <")
    m = r["moe"]
    if m:                                                 # no row of Table 2 either: activations.py's third table
        label = f"moe E={m['experts']} K={m['top_k']}"
        out.append(f"    {label:<17}{human_bytes(m['layer_activation_bytes']):>12}  "
                   f"a MoE block: the MLP's rows replaced by the router, the experts' R = {m['received']:,} rows "
                   f"and the combine's M = {m['kept']:,} (activations.py)")
    return out
