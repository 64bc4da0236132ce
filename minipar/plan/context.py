"""The planner's context parallelism: the four ways a cp group can attend (--cp-impl), side by
side for one layout, and the cheapest marked.

    python -m minipar.plan --model llama3-8b --block-size 131072 --world 8 --cp 8 --precision bf16 \\
        --batch-size 1 --ranks-per-host 8 --intra-node-gbps 3600 --inter-node-gbps 400

For each of ring, ulysses, allgather and hybrid, on the layout's own dp, tp, pp, batch and
recomputation (docs/context-parallel.md):
    runs?       ulysses.head_split: Ulysses over U ranks gives each whole query heads (U divides
                H/tp) and whole KV heads (U divides, or is divided by, Hkv/tp: the copies);
                hybrid's U is --cp-ulysses or the cp ranks of a host
                (context_parallel.hybrid_degree, on the placed cp group)
    memory      the device's peak (model states + activations, memory.device_memory), its
                attention's part by activations.cp_attention_bytes: the ring's K, V of its T/C
                tokens, allgather's of all T, Ulysses' of its heads over all T
    bytes       a step's cp messages (context_parallel.call_traffic on the placed groups):
                inside its host and across
    time        those bytes under the link model (hosts.py: bytes / bandwidth + messages across
                hosts x latency), when a bandwidth flag is given
The cheapest is the one that runs in the least time under the link model, or, without link
speeds, with the fewest bytes; ties go to the least memory. Nothing is overlapped: the ring
hides its messages behind its blocks' compute, so for the ring this is an upper bound. Nor is
compute compared: the planner's FLOPs are the model's (T/C x T score products a rank, the same
for all four), while the ring skips the sub-blocks the causal mask empties (2C + 1 of 4C with
the zig-zag split) that Ulysses and the all-gather compute and mask (scripts/bench_cp.py
measures what that is worth).
"""
from __future__ import annotations

from minipar.comm.ledger import human_bytes
from minipar.parallel.context import context_parallel
from minipar.parallel.context.ulysses import head_split
from minipar.plan import activations, hosts as plan_hosts
from minipar.plan.comm_bytes import cp_bytes
from minipar.plan.layout import itemsizes
from minipar.plan.memory import device_memory

WHY = {   # impl: what it keeps and sends, in a few words
    "ring": "K, V of T/C tokens; 2n(C-1) per pass round the ring, overlapped with compute",
    "ulysses": "heads H/U over all T; four all-to-alls of (U-1)/U, constant as T and C grow together",
    "allgather": "the gathered K, V of all T tokens; all-gather + reduce-scatter of 2n(C-1)",
    "hybrid": "Ulysses' all-to-alls inside its U ranks, the ring across C/U",
}


def cp_group(lay, hosts: plan_hosts.Hosts, stage: int = 0, c: int = 0) -> plan_hosts.Placed:
    """The placed cp group of the device at (stage, dp 0, cp c, tp 0)."""
    g = plan_hosts.ring_and_expert_groups(lay, hosts, stage)["cp"]
    return plan_hosts.Placed(g.world_ranks, c, g.per_host)


def with_impl(cfg, lay, impl: str, hosts: plan_hosts.Hosts):
    """lay with --cp-impl impl and hybrid's U resolved (context_parallel.hybrid_degree on the
    placed cp group: --cp-ulysses, else the cp ranks of a host); ValueError (one line) for a
    layout it cannot run (ulysses.head_split's limits)."""
    U = None
    if impl == "ulysses":
        U = lay.cp
    elif impl == "hybrid":
        U = context_parallel.hybrid_degree(cp_group(lay, hosts), lay.cp_ulysses)
    if U is not None:
        head_split(cfg.n_head // lay.tp, max(1, cfg.kv_heads // lay.tp), U)
    return lay.but(cp_impl=impl, cp_ulysses=U if impl == "hybrid" else None)


def groups(lay, hosts: plan_hosts.Hosts, stage: int, c: int = 0) -> dict:
    """context_parallel.call_traffic's groups of cp rank c, placed: the cp group, hybrid's
    Ulysses group (the U consecutive cp ranks c is one of) and its ring (every U-th)."""
    g = cp_group(lay, hosts, stage, c)
    U = lay.cp if lay.cp_impl == "ulysses" else lay.cp_ulysses or 1
    ranks, K = g.world_ranks, g.per_host
    return {"cp": g, "ulysses": plan_hosts.Placed(ranks[c - c % U:c - c % U + U], c % U, K),
            "ring": plan_hosts.Placed(ranks[c % U::U], c // U, K)}


def slowest(cfg, lay, hosts: plan_hosts.Hosts, stage: int) -> plan_hosts.Traffic:
    """The cp traffic of the stage's cp rank that takes longest under the link model (or sends
    most across hosts, then most in all): the ring's rank at a host's edge, say."""
    compute_itemsize = itemsizes(lay)[1]
    sent = [plan_hosts.as_traffic(cp_bytes(cfg, stage, lay, compute_itemsize, groups(lay, hosts, stage, c)))
            for c in range(lay.cp)]
    return max(sent, key=lambda t: (hosts.seconds(t) or 0.0, t.inter, t.bytes))


def attention_bytes(cfg, lay) -> int:
    """What one layer's attention keeps for one micro-batch (activations.cp_attention_bytes):
    also what --recompute full holds again while a layer's backward runs."""
    tp, hs = lay.tp, cfg.head_size
    return activations.cp_attention_bytes(lay.cp_impl, lay.rows, cfg.block_size // lay.cp, lay.cp, cfg.n_head // tp,
                                          cfg.n_head // tp * hs, context_parallel.kv_width(cfg, tp), hs,
                                          itemsizes(lay)[1], lay.cp_ulysses)[0]


def compare(cfg, lay, hosts: plan_hosts.Hosts) -> list[dict]:
    """One row per --cp-impl (the module's docstring): runs (and why not), U, the peak memory
    and activations of the largest stage, what one layer's attention keeps, the cp bytes of
    the slowest cp rank of any stage (inside and across hosts, messages across), the seconds
    under the link model; the cheapest marked."""
    rows = []
    for impl in context_parallel.IMPLS:
        try:
            li = with_impl(cfg, lay, impl, hosts)
        except ValueError as e:
            rows.append({"impl": impl, "runs": False, "why_not": str(e), "cheapest": False})
            continue
        memory = max((device_memory(cfg, li, s) for s in range(li.pp)), key=lambda m: m["total"])
        sent = max((slowest(cfg, li, hosts, s) for s in range(li.pp)),
                   key=lambda t: (hosts.seconds(t) or 0.0, t.inter, t.bytes))
        U = li.cp if impl == "ulysses" else li.cp_ulysses
        rows.append({"impl": impl, "runs": True, "ulysses": U, "memory": memory["total"],
                     "activations": memory["activations"], "attention_per_layer": attention_bytes(cfg, li),
                     "bytes_per_step": sent.bytes, "inter_host": sent.inter,
                     "inter_host_messages": sent.inter_messages, "seconds": hosts.seconds(sent), "cheapest": False})
    running = [r for r in rows if r["runs"]]
    if running:
        cost = "seconds" if hosts.timed else "bytes_per_step"
        min(running, key=lambda r: (r[cost], r["memory"], r["attention_per_layer"]))["cheapest"] = True
    return rows


def lines(rows: list[dict], chosen: str, timed: bool, budget: int | None = None) -> list[str]:
    """The side-by-side block of the table (plan()'s "cp_impls")."""
    out = ["", "  context parallelism, four ways (--cp-impl; this run's >): memory of the largest stage, bytes and "
               "time of the slowest cp rank",
           f"    {'impl':<11}{'peak memory':>13}{'activations':>13}{'attn/layer':>12}{'cp bytes/step':>15}"
           f"{'across hosts':>14}{'time':>11}  keeps and sends"]
    for r in rows:
        mark = ">" if r["impl"] == chosen else " "
        name = r["impl"] + (f" U={r['ulysses']}" if r["impl"] == "hybrid" and r["runs"] else "")
        if not r["runs"]:
            out.append(f"  {mark} {name:<11}cannot run: {r['why_not']}")
            continue
        seconds = plan_hosts.human_seconds(r["seconds"]) if r["seconds"] is not None else "-"
        over = "" if budget is None or r["memory"] <= budget else "  (over --memory-budget)"
        out.append(f"  {mark} {name:<11}{human_bytes(r['memory']):>13}{human_bytes(r['activations']):>13}"
                   f"{human_bytes(r['attention_per_layer']):>12}{human_bytes(r['bytes_per_step']):>15}"
                   f"{human_bytes(r['inter_host']):>14}{seconds:>11}  {WHY[r['impl']]}"
                   f"{' <- cheapest' if r['cheapest'] else ''}{over}")
    running = [r for r in rows if r["runs"]]
    if running:
        b = next(r for r in rows if r["cheapest"])
        by = (f"the least time under the link model ({plan_hosts.human_seconds(b['seconds'])} a step of cp "
              f"messages)" if timed else f"the fewest bytes ({human_bytes(b['bytes_per_step'])} a step; "
                                         f"--intra-node-gbps / --inter-node-gbps time them)")
        least = min(running, key=lambda r: (r["memory"], r["attention_per_layer"]))
        out.append(f"    cheapest: {b['impl']}, {by}; least memory: {least['impl']} ({human_bytes(least['memory'])}, "
                   f"{human_bytes(least['attention_per_layer'])} of attention a layer); nothing overlapped (the "
                   f"ring hides its messages behind compute)")
    return out
