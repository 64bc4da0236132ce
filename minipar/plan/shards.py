"""ZeRO's shard groups in the planner: --shard-group resolved on the planner's hosts, and every
candidate shard group side by side, the recommended one marked.

    python -m minipar.plan --model llama3-70b --world 64 --tp 2 --zero 3 --precision bf16 \\
        --ranks-per-host 8 --inter-node-gbps 400 --intra-node-gbps 3600 --memory-budget 80GiB

Hybrid sharding (zero/hybrid.py): the N = dp*cp ranks that sum a gradient are cut into
R = N/S shard groups of S consecutive ranks; a unit (padded to a multiple of N) is sharded
over the S ranks of a group and replicated over the R groups. The planner counts it as the
trainer runs it:
    memory   zero.formula with S in place of N (memory.device_memory, layout.zero_split)
    bytes    each unit's reduce-scatters and all-gathers inside the device's shard group and
             its n/S shard all-reduced across the R replicas once a step (formulas.calls_of,
             comm_bytes.zero_bytes), walked message by message on the placed groups
             (hosts.Placed.split): the bytes inside and across hosts, the time on the links
--shard-group host: S = the gradient group's ranks on one host (zero.hybrid.host_shard_size
on the placed group of each stage), so that only the replicas' all-reduce crosses hosts.

The candidates: every divisor S of N that is a whole number of hosts' worth of the gradient
group's ranks (h per host) or fits in one host (S divides h), flat (S = N) and a host's
(S = h) among them. For each: the peak memory per device (model states + activations, the
largest stage) and ZeRO's bytes per step on the device whose ZeRO traffic takes longest
(ranks: dp rank 0, tp rank 0 of each stage). Recommended: of those whose peak fits
--memory-budget (all, without it), the one whose ZeRO communication takes least time on
the link model (--inter-node-gbps, --intra-node-gbps, --inter-node-latency-us); without a
bandwidth flag, the fewest bytes across hosts, then in all; ties go to the smaller memory.
"""
from __future__ import annotations

from minipar.config import flags as config
from minipar.parallel.zero import hybrid
from minipar.plan import hosts as plan_hosts
from minipar.plan.comm_bytes import Flat, grad_sync_bytes
from minipar.plan.layout import device_tensors, itemsizes, placed, sync_groups, zero_split
from minipar.plan.memory import device_memory
from minipar.comm.ledger import human_bytes


def host_ranks(lay, hosts: plan_hosts.Hosts, stage: int = 0) -> int:
    """The gradient group's ranks on each host (zero.hybrid.host_shard_size on the placed
    group of dp rank 0, tp rank 0 of `stage`); ValueError when hosts hold unequal numbers."""
    return hybrid.host_shard_size(plan_hosts.device_groups(placed(lay), hosts, stage)["dp"])


def resolve(lay, hosts: plan_hosts.Hosts):
    """lay with --shard-group host made a number (config.ConfigError, one line, when it needs
    --ranks-per-host, or hosts hold unequal shares of a gradient group, or the stages' groups
    sit differently on them); a whole number S or flat as it is. With --ep, the experts'
    replicas must fall evenly into the shard groups too (layout.zero_split)."""
    if lay.shard_group != "host":
        for _, gl in sync_groups([], lay):
            zero_split(lay, gl)
        return lay
    if hosts.ranks_per_host is None:
        raise config.ConfigError("--shard-group host shards over the ranks of a host: give --ranks-per-host K "
                                 "(or --shard-group S)")
    try:
        per_stage = {host_ranks(lay, hosts, stage) for stage in range(lay.pp)}
    except ValueError as e:
        raise config.ConfigError(str(e)) from None
    if len(per_stage) > 1:
        raise config.ConfigError(f"--shard-group host: the pipeline stages' gradient groups sit differently on "
                                 f"hosts of {hosts.ranks_per_host} ranks ({sorted(per_stage)} ranks of one on a "
                                 f"host): give --shard-group S")
    return resolve(lay.but(shard_group=per_stage.pop()), hosts)


def candidates(N: int, h: int | None) -> list:
    """Divisors S of N that are whole hosts' worth (h ranks a host) or fit in one, ascending."""
    return [S for S in range(1, N + 1) if N % S == 0 and (h is None or S % h == 0 or h % S == 0)]


def zero_traffic(cfg, lay, hosts: plan_hosts.Hosts, stage: int):
    """ZeRO's bytes of one step on dp rank 0, tp rank 0 of `stage` (Traffic)."""
    itemsize = itemsizes(lay)[0]
    spread = hosts.n_hosts(lay.world) > 1
    g = plan_hosts.device_groups(placed(lay), hosts, stage)["dp"] if spread else Flat(lay.grad_ranks)
    return plan_hosts.as_traffic(grad_sync_bytes(device_tensors(cfg, lay, stage), lay, itemsize, g, cfg.family))


def row(cfg, lay, hosts: plan_hosts.Hosts, S: int, h: int | None) -> dict:
    """One candidate: the layout with shard groups of S, its peak memory and ZeRO's traffic."""
    N = lay.grad_ranks
    cand = lay.but(shard_group=None if S == N else S)
    mem = max((device_memory(cfg, cand, stage) for stage in range(lay.pp)), key=lambda m: m["total"])
    sent = [(hosts.seconds(t), t, stage) for stage in range(lay.pp)
            for t in [zero_traffic(cfg, cand, hosts, stage)]]
    seconds, t, stage = max(sent, key=lambda x: (x[0] or 0.0, x[1].inter, x[1].bytes))
    return {"S": S, "R": N // S, "hosts_per_group": S / h if h else None, "flat": S == N,
            "model_states": mem["model_states"], "peak": mem["total"], "memory_stage": mem["stage"],
            "intra": t.intra, "inter": t.inter, "inter_messages": t.inter_messages, "bytes": t.bytes,
            "seconds": seconds, "stage": stage, "fits": None, "recommended": False}


def compare(cfg, lay, hosts: plan_hosts.Hosts, budget: int | None = None) -> dict | None:
    """Every candidate shard group of a ZeRO layout (the module docstring), the recommended
    one marked; None without a model shape, ZeRO or more than one rank to shard over."""
    N = lay.grad_ranks
    if cfg is None or not lay.zero or N == 1:
        return None
    try:
        h = host_ranks(lay, hosts) if hosts.ranks_per_host is not None else None
    except ValueError:                                    # hosts with unequal shares: every divisor
        h = None
    rows = []
    for S in candidates(N, h):
        try:
            rows.append(row(cfg, lay, hosts, S, h))
        except config.ConfigError:                        # --ep: experts in unequal shard groups
            continue
    for r in rows:
        r["fits"] = budget is None or r["peak"] <= budget
    timed = hosts.timed
    fitting = [r for r in rows if r["fits"]]
    if fitting:
        best = min(fitting, key=lambda r: ((r["seconds"] if timed else 0.0), r["inter"], r["bytes"], r["peak"]))
        best["recommended"] = True
    current = lay.shard_group if isinstance(lay.shard_group, int) else N
    return {"ranks": N, "host_ranks": h, "memory_budget": budget, "ranked_by": "seconds" if timed else "bytes",
            "current": current, "recommended": next((r["S"] for r in rows if r["recommended"]), None),
            "rows": rows}


def _span(r: dict) -> str:
    k = r["hosts_per_group"]
    if k is None:
        return "flat" if r["flat"] else ""
    word = f"{k:g} host{'s' if k > 1 else ''}" if k >= 1 else f"1/{round(1 / k)} host"
    return word + (", flat" if r["flat"] else "")


def lines(c: dict, stage_word: str = "ZeRO") -> list[str]:
    """The table of compare(): one line per shard group, the recommended one marked."""
    h = c["host_ranks"]
    timed = c["ranked_by"] == "seconds"
    out = ["", f"  ZeRO shard groups (--shard-group S): the {c['ranks']} dp x cp ranks in R = {c['ranks']}/S groups"
               + (f", {h} of them on a host" if h else "") + "; peak memory per device, ZeRO's bytes per step "
               "(the slowest stage's device)",
           f"    {'S':>6} {'R':>6}  {'spans':<14}{'model states':>14}{'peak':>12}{'inside':>12}{'across':>12}"
           + (f"{'time':>12}" if timed else "")]
    for r in c["rows"]:
        mark = (" < recommended" if r["recommended"] else "") + (" (this layout)" if r["S"] == c["current"] else "")
        fits = "" if r["fits"] else " (over budget)"
        out.append(f"    {r['S']:>6} {r['R']:>6}  {_span(r):<14}{human_bytes(r['model_states']):>14}"
                   f"{human_bytes(r['peak']):>12}{human_bytes(r['intra']):>12}{human_bytes(r['inter']):>12}"
                   + (f"{plan_hosts.human_seconds(r['seconds']):>12}" if timed else "") + fits + mark)
    budget = (f", of those whose peak fits {human_bytes(c['memory_budget'])}" if c["memory_budget"] is not None
              else " (no --memory-budget: every shard group counted as fitting)")
    key = ("the least ZeRO time on the links" if timed
           else "the fewest bytes across hosts, then in all (no bandwidth flag to time them)")
    if c["recommended"] is None:
        out.append(f"  recommended: none: no shard group's peak fits {human_bytes(c['memory_budget'])}")
    else:
        S = c["recommended"]
        flag = "flat (no --shard-group)" if S == c["ranks"] else f"--shard-group {S}" + (" (host)" if S == h else "")
        out.append(f"  recommended: {flag}: {key}{budget}")
    return out
