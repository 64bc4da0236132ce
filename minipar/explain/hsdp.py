"""Hybrid sharding in python -m minipar.explain (hsdp, 4 ranks): one short run of python -m
minipar.train --zero 3 --shard-group 2 with its own --trace and --log, and a drawing of who
talks to whom: the R = P/S shard groups of S consecutive ranks (ZeRO inside each: the
all-gathers and reduce-scatters), the S replica groups across them (the ranks that hold the
same shard: one all-reduce of it a step), and each rank's bytes of a step in each.

Read from the trace: every call of the "zero" axis in the last step, by its op and its group
(the world ranks it ran on, the comm slice's args). Checked, rank by rank (a PROBLEM line each,
in red, and exit 1):
  groups  the all-gathers and reduce-scatters run on the rank's shard group, hybrid.blocks' S
          consecutive ranks; the all-reduces on its replica group, the ranks in the same place
          of every shard group; nothing else on the zero axis
  calls   per unit (fsdp.model_of) formulas.collectives_per_step's all-gathers and
          reduce-scatters, and one all-reduce; each call's bytes_sent those of plan.comm_bytes'
          all_gather_sent and reduce_scatter_sent over S ranks, all_reduce_sent of the n_pad/S
          shard over R (recursive doubling for a small shard, as comm picks): compared as sets
  bytes   the step's sum = formulas.traffic_theory with R = the log's zero_bytes
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from minipar.explain.common import BOLD, _text, svg_end
from minipar.explain.fsdp import FSDP_MODEL, FSDP_STEPS, load_run, model_of

HSDP_RANKS, HSDP_S = (4,), 2
COLOURS = {"shard": "#f58518", "replica": "#b279a2"}
OPS = {"all_gather": "shard", "reduce_scatter": "shard", "all_reduce": "replica"}


def hsdp_argv(trace_path: str, log_path: str) -> list[str]:
    return [*FSDP_MODEL, "--zero", "3", "--shard-group", str(HSDP_S), "--steps", str(FSDP_STEPS), "--sample", "0",
            "--trace", trace_path, "--log", log_path]


@dataclass
class HsdpPicture:
    title: str
    p: int
    S: int
    R: int
    step: int
    groups: dict                # rank -> {"shard": ranks, "replica": ranks}, as hybrid.blocks makes them
    sent: dict                  # rank -> {"shard": B, "replica": B}, from the trace
    formula: dict               # {"shard": B, "replica": B} per rank; "flat": flat ZeRO-3's, all in one group
    log_bytes: float
    problems: list = field(default_factory=list)


def hsdp_picture(trace_path: str, log_path: str, step: int = FSDP_STEPS - 1) -> HsdpPicture:
    from minipar.config import flags                                    # noqa: PLC0415
    from minipar.parallel.zero import formulas                          # noqa: PLC0415
    from minipar.plan import comm_bytes                                 # noqa: PLC0415
    from minipar.show import traceview                                  # noqa: PLC0415
    run = load_run(None, trace_path, log_path)
    meta = run.trace["otherData"]["minipar"]
    m, p = model_of(meta), meta["world"]
    S = flags.build_parser().parse_args(meta["argv"]).shard_group
    R, s, problems = p // S, m["itemsize"], traceview.audit(run.trace)
    n_rs, n_ag = formulas.collectives_per_step(3, m["M"], m["reshard"])
    groups = {r: {"shard": [q for q in range(p) if q // S == r // S], "replica": list(range(r % S, p, S))}
              for r in range(p)}
    sent, formula = {}, {}
    events = traceview.spans(run.trace, "comm")
    for r in range(p):
        window = [e for e in traceview.spans(run.trace, "step", r) if e["args"]["step"] == step]
        calls = [e["args"] for e in events if e["pid"] == r and e["args"]["axis"] == "zero" and window
                 and window[0]["ts"] <= e["ts"] <= window[0]["end"]]
        want = defaultdict(Counter)
        for u in m["units"]:
            n = u.nbytes // s
            want["all_gather"][comm_bytes.all_gather_sent(n // S, s, S)] += n_ag
            want["reduce_scatter"][comm_bytes.reduce_scatter_sent(n, s, S, r % S)] += n_rs
            want["all_reduce"][comm_bytes.all_reduce_sent(n // S, s, R, r // S)] += 1
        sent[r] = {"shard": 0, "replica": 0}
        for op in sorted({a["op"] for a in calls} | set(want)):
            mine = [a for a in calls if a["op"] == op]
            if op not in OPS:
                problems.append(f"rank {r}: {len(mine)} {op}(s) on the zero axis, which hybrid ZeRO-3 does not send")
                continue
            kind = OPS[op]
            for g in sorted({tuple(a["group"]) for a in mine} - {tuple(groups[r][kind])}):
                problems.append(f"rank {r}: {op} on ranks {list(g)}, not on its {kind} group {groups[r][kind]}")
            got = Counter(a["bytes_sent"] for a in mine)
            if got != want[op]:
                problems.append(f"rank {r}: its {op}s send {_bag(got)} B; the formulas {_bag(want[op])} B")
            sent[r][kind] += sum(a["bytes_sent"] for a in mine)
        formula = {k: sum(b * c for op, bag in want.items() if OPS[op] == k for b, c in bag.items())
                   for k in ("shard", "replica")}
    theory = formulas.traffic_theory(3, sum(u.nbytes for u in m["units"]) // s, S, s, m["M"], R, m["reshard"])
    formula["flat"] = formulas.traffic_theory(3, sum(u.nbytes for u in m["units"]) // s, p, s, m["M"], 1, m["reshard"])
    row = next((x for x in run.rows if x.get("step") == step), {})
    for r in range(p):
        if abs(sum(sent[r].values()) - theory) > 0.5:
            problems.append(f"rank {r}: ZeRO sent {sum(sent[r].values())} B in step {step}; formulas.traffic_theory "
                            f"with R = {R}: {theory:.0f} B")
    if abs(row.get("zero_bytes", -1) - theory) > 0.5:
        problems.append(f"the log's zero_bytes of step {step} is {row.get('zero_bytes')}; formulas.traffic_theory "
                        f"with R = {R}: {theory:.0f} B")
    title = (f"hybrid sharding: --zero 3 --shard-group {S} on {p} ranks, {R} shard groups of S = {S}, R = {R} "
             f"replicas of a shard")
    return HsdpPicture(title, p, S, R, step, groups, sent, formula, row.get("zero_bytes", 0), problems)


def _bag(c: Counter) -> str:
    return ", ".join(f"{n} x {b:,}" for b, n in sorted(c.items())) or "none"


def hsdp_lines(pic: HsdpPicture) -> list[str]:
    f = pic.formula
    return [f"step {pic.step}: what each rank sent in its shard group (all-gathers, reduce-scatters) and across its "
            f"replicas (all-reduces)"] + [
        f"rank {r}: in its shard group {pic.groups[r]['shard']} {pic.sent[r]['shard']:,} B (formula {f['shard']:,}), "
        f"across its replica group {pic.groups[r]['replica']} {pic.sent[r]['replica']:,} B (formula {f['replica']:,})"
        for r in range(pic.p)] + [
        f"shard group, per unit: 2 all-gathers + 1 reduce-scatter of (S-1)/S its bytes (comm_bytes, S = {pic.S})",
        f"replica group, per unit: 1 all-reduce of its 1/S shard over R = {pic.R} (comm_bytes.all_reduce_sent)",
        f"in all {sum(f[k] for k in ('shard', 'replica')):,} B a rank (the log: {pic.log_bytes:,.0f}); flat ZeRO-3 "
        f"over {pic.p} ranks would send {f['flat']:,.0f} B, all of it in one group"]


def hsdp_text(pic: HsdpPicture) -> str:
    out = [pic.title, "", " " * 16 + "".join(f"place {q}".ljust(14) for q in range(pic.S))]
    for b in range(pic.R):
        out.append(f"shard group {b}   " + "".join(f"[rank {b * pic.S + q}]".ljust(14, "-" if q < pic.S - 1 else " ")
                                                    for q in range(pic.S)))
        if b < pic.R - 1:
            out.append(" " * 16 + "".join(f"{':':^8}".ljust(14) for _ in range(pic.S)))
    out += ["--- a shard group (all-gathers, reduce-scatters); : a replica group (the all-reduce of a shard)", ""]
    return "\n".join(out + hsdp_lines(pic) + [f"PROBLEM: {line}" for line in pic.problems])


def hsdp_svg(pic: HsdpPicture, width: int = 1000) -> str:
    box_w, box_h, gap_x, gap_y, x0, y0 = 300, 92, 90, 60, 150, 72
    big = max([v for r in pic.sent.values() for v in r.values()] + [1])
    body = [_text(10, 22, pic.title, ' font-size="14"' + BOLD), _text(10, 40, hsdp_lines(pic)[0])]
    for b in range(pic.R):
        y = y0 + b * (box_h + gap_y)
        body += [f'<rect x="{x0 - 12}" y="{y - 12}" width="{pic.S * box_w + (pic.S - 1) * gap_x + 24}" '
                 f'height="{box_h + 24}" rx="10" fill="none" stroke="{COLOURS["shard"]}" stroke-width="3"/>',
                 _text(10, y + box_h / 2 + 4, f"shard group {b}", BOLD)]
    for q in range(pic.S):
        x = x0 + q * (box_w + gap_x) + box_w / 2
        body.append(f'<line x1="{x}" y1="{y0 + box_h}" x2="{x}" y2="{y0 + (pic.R - 1) * (box_h + gap_y)}" '
                    f'stroke="{COLOURS["replica"]}" stroke-width="3" stroke-dasharray="8 5"/>')
        body.append(_text(x + 8, y0 + box_h + gap_y / 2 + 4, f"replica group {pic.groups[q]['replica']}"))
    for r in range(pic.p):
        x, y = x0 + (r % pic.S) * (box_w + gap_x), y0 + (r // pic.S) * (box_h + gap_y)
        body += [f'<rect x="{x}" y="{y}" width="{box_w}" height="{box_h}" fill="#f7f7f7" stroke="#555"/>',
                 _text(x + 8, y + 18, f"rank {r}", BOLD)]
        for i, kind in enumerate(("shard", "replica")):
            w, n = (box_w - 16) * pic.sent[r][kind] / big, pic.sent[r][kind]
            body += [f'<rect x="{x + 8}" y="{y + 28 + 30 * i}" width="{w:.1f}" height="12" fill="{COLOURS[kind]}"/>',
                     _text(x + 8, y + 53 + 30 * i, f"{'in its shard group' if kind == 'shard' else 'across replicas'}"
                                                   f" {n:,} B")]
    y = y0 + pic.R * (box_h + gap_y) - 10
    for i, line in enumerate(hsdp_lines(pic)[1:]):
        body.append(_text(10, y + 18 * i, line))
    y += 18 * len(hsdp_lines(pic)) - 8
    height = y + 18 * len(pic.problems) + 10
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="DejaVu Sans Mono, monospace" font-size="12">',
            f'<rect width="{width}" height="{height}" fill="white"/>']
    return svg_end(head + body, y, pic.problems)
