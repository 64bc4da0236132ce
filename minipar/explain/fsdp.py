"""ZeRO-3's gathers in python -m minipar.explain (fsdp, 4 ranks; 2 or 4): three short runs of
python -m minipar.train --zero 3 with its own --trace and --log, drawn one above the other on one
time scale, and checked against ZeRO's formulas.

The runs: a GPT-2 of 4 blocks (FSDP_MODEL), 2 steps, one micro-batch, each setting once:
    --prefetch 0                                block j's all-gather starts in its own forward
    --prefetch K (--prefetch, default 1)        ... when block j-K's is waited for
    --prefetch K --reshard-after-forward off    forward's gathers kept: backward gathers nothing
The picture is the last step of rank 0: a lane of compute (each layer's forward and backward
span, with the exposed waits for all-gathers on it in red), a lane of ZeRO's all-gathers and
one of its reduce-scatters (the async slices of the "zero" axis), each labelled by its unit.

How a collective gets its unit. The trace's comm slices do not name one. Every all-gather
ZeRO-3 starts is waited for once, by a span "wait for all-gather <the unit's first parameter>"
(stage3.Stage3.gather): a wait is paired with the earliest-started all-gather not yet paired
that began before it and ended by its end (they start in the order they are used). A
reduce-scatter starts inside the backward span of its block (the gradient hook that finds
the unit ready); the embedding-side units' after embed's backward, told apart by their size.

What is checked, on every rank (each disagreement a PROBLEM line, in red, and exit 1):
  calls   each unit all-gathered and reduce-scattered as often as formulas.collectives_per_step
          says (M all-gathers in forward, the rest in backward), every wait paired, nothing else
  bytes   each call's bytes_sent = (N-1)/N x the unit's padded bytes (plan.comm_bytes'
          all_gather_sent, reduce_scatter_sent); the step's = formulas.traffic_theory = the log's
  peak    the gathered bytes at the peak, replayed from the trace (a unit is held from its
          all-gather's start until its piece's forward ends when backward gathers it again, else
          until its reduce-scatter starts) = formulas.gathered_peak = the log's
  where   with prefetch K block j's forward all-gather starts inside the forward span of block
          j-K (embed's when j < K), its backward one inside block j+K's backward (the head's past
          the last block): with K >= 1, under the compute of the block before it
  order   the layer spans in the model's order, forward then backward; traceview.audit
Reading needs the trainer's flags and the planner's formulas, which import minipar.comm (and
so start MPI): the launcher imports them only to draw, after its runs have ended.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from minipar.show.draw import _esc
from minipar.explain.common import BOLD, ExplainError, _text, svg_end

FSDP_RANKS = (2, 4)
FSDP_LAYERS = 4
FSDP_MODEL = ["--n-layer", str(FSDP_LAYERS), "--n-head", "2", "--n-embd", "64", "--block-size", "32",
              "--batch-size", "8"]
FSDP_STEPS = 2
SLACK = 0.001                   # ms: the trace's times are rounded to the nanosecond
COLOURS = {"forward": "#4c78a8", "backward": "#54a24b", "wait": "#e45756", "all-gather": "#f58518",
           "reduce-scatter": "#b279a2"}
FORMULAS = ("formulas: zero.formulas.gathered_peak and traffic_theory; per call plan.comm_bytes.all_gather_sent, "
            "reduce_scatter_sent")
FILLS = {"forward": "=", "backward": "-", "wait": "#", "all-gather": "~", "reduce-scatter": "+"}


@dataclass(frozen=True)
class Setting:
    prefetch: int
    reshard: bool = True

    @property
    def label(self) -> str:
        return f"prefetch {self.prefetch}" + ("" if self.reshard else ", reshard after forward off")

    @property
    def tag(self) -> str:
        return f"k{self.prefetch}" + ("" if self.reshard else "-keep")


def fsdp_settings(K: int) -> list[Setting]:
    return [Setting(0), Setting(K), Setting(K, False)]


def fsdp_files(out: str, p: int, s: Setting) -> tuple[str, str]:
    """(trace, log) of one setting's run: DIR/explain-fsdp-pP-TAG.json and .jsonl."""
    stem = os.path.join(out, f"explain-fsdp-p{p}-{s.tag}")
    return stem + ".json", stem + ".jsonl"


def fsdp_argv(s: Setting, trace_path: str, log_path: str) -> list[str]:
    return [*FSDP_MODEL, "--zero", "3", "--prefetch", str(s.prefetch), "--reshard-after-forward",
            "on" if s.reshard else "off", "--steps", str(FSDP_STEPS), "--sample", "0", "--trace", trace_path,
            "--log", log_path]


@dataclass
class Run:
    """One setting's run, as its trace and log hold it."""
    setting: Setting
    trace: dict
    rows: list                  # the log's step rows
    summary: dict               # its summary line


def load_run(s: Setting, trace_path: str, log_path: str) -> Run:
    from minipar.show import traceview                                  # noqa: PLC0415
    with open(log_path) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    return Run(s, traceview.load(trace_path), [x for x in lines if "summary" not in x],
               next((x for x in lines if "summary" in x), {}))


# --- what the run's flags make: the units and the formulas' inputs ---------------------------------
@dataclass(frozen=True)
class Unit:
    key: str                    # its first parameter: what a wait span names
    label: str                  # h.2, or wte / wpe (the rest: wpe, ln_f)
    block: int | None
    nbytes: int                 # padded, in the storage dtype
    piece: str                  # the forward span its forward gather serves until: h.i, or head


def model_of(meta: dict) -> dict:
    """The run's units (zero.units.unit_names of the planner's tensors, padded for N) and the
    numbers the formulas take, from its flags (the trace's argv)."""
    from minipar.config import flags                                    # noqa: PLC0415
    from minipar.parallel.layout import Layout                          # noqa: PLC0415
    from minipar.parallel.zero import units as zero_units               # noqa: PLC0415
    from minipar.plan import layout as plan_layout                      # noqa: PLC0415
    args = flags.build_parser().parse_args(meta["argv"])
    cfg = flags.resolve_model(args, None)
    lay = Layout.from_flags(args, dp=meta["layout"]["dp"])
    N, itemsize = lay.grad_ranks, plan_layout.itemsizes(lay)[0]
    sizes = dict(plan_layout.device_tensors(cfg, lay, 0))
    units = []
    for names in zero_units.unit_names(list(sizes), cfg.family):
        i = cfg.family.block_of(names[0])
        units.append(Unit(names[0], names[0].split(".")[0] if i is None else f"h.{i}", i,
                          zero_units.padded(sum(sizes[n] for n in names), N) * itemsize,
                          "head" if i is None else f"h.{i}"))
    K, reshard = flags.resolve_gathers(args)
    return {"units": units, "N": N, "M": lay.micro_batches, "K": K, "reshard": reshard, "itemsize": itemsize,
            "L": cfg.n_layer}


# --- one rank's step, read ------------------------------------------------------------------------
@dataclass
class Op:
    kind: str                   # forward, backward (layer spans), wait, all-gather, reduce-scatter
    piece: str                  # embed, h.0 ... head; a collective's or wait's unit label ("?": none)
    start: float                # ms from the step's start
    end: float
    phase: str = ""             # a gather's or wait's: forward or backward
    nbytes: int = 0


def read_step(events: list, step: int, m: dict, where: str) -> tuple[list, list, float]:
    """One rank's layer spans, waits and ZeRO's collectives (from its traceview.spans) in training
    step `step`, each collective given its unit (the module docstring). -> (ops, problems, the step's ms)."""
    window = [e for e in events if e["cat"] == "step" and e["args"]["step"] == step]
    if not window:
        return [], [f"{where}: the trace has no step {step}"], 0.0
    t0, t1 = window[0]["ts"], window[0]["end"]
    events = [e for e in events if t0 <= e["ts"] <= t1]
    units, N = m["units"], m["N"]
    ms, problems, by_key = (lambda t: (t - t0) / 1e3), [], {u.key: u for u in units}
    ops = [Op(e["args"]["pass"], e["args"]["layer"], ms(e["ts"]), ms(e["end"])) for e in events if e["cat"] == "layer"]
    waits = [e for e in events if e["cat"] == "zero" and e["name"].startswith("wait for all-gather ")]
    comm = [e for e in events if e["cat"] == "comm" and e["args"].get("axis") == "zero"]
    free = sorted((e for e in comm if e["args"]["op"] == "all_gather"), key=lambda e: e["ts"])
    for w in sorted(waits, key=lambda e: e["ts"]):
        u, phase = by_key.get(w["args"].get("unit")), w["args"].get("phase", "")
        label = u.label if u else "?"
        ops.append(Op("wait", label, ms(w["ts"]), ms(w["end"]), phase))
        g = next((g for g in free if g["ts"] <= w["ts"] and g["end"] <= w["end"] + SLACK * 1e3), None)
        if u is None:
            problems.append(f"{where}: {w['name']!r} names no unit of the model")
        if g is None:
            problems.append(f"{where}: the {phase} wait for all-gather {label} at {ms(w['ts']):.2f} ms: no "
                            f"all-gather began before it and ended by its end")
            continue
        free.remove(g)
        ops.append(Op("all-gather", label, ms(g["ts"]), ms(g["end"]), phase, g["args"]["bytes_sent"]))
    for g in free:
        ops.append(Op("all-gather", "?", ms(g["ts"]), ms(g["end"]), "", g["args"]["bytes_sent"]))
        problems.append(f"{where}: the all-gather at {ms(g['ts']):.2f} ms ({g['args']['bytes_sent']} B) is "
                        f"waited for by no 'wait for all-gather' span")
    for e in comm:
        op, a = e["args"]["op"], e["args"]
        if op == "reduce_scatter":
            ops.append(Op("reduce-scatter", _scattered(ops, units, ms(e["ts"]), a["bytes_sent"], N),
                          ms(e["ts"]), ms(e["end"]), "backward", a["bytes_sent"]))
        elif op != "all_gather":
            problems.append(f"{where}: a {op} at {ms(e['ts']):.2f} ms on the zero axis, which ZeRO-3 "
                            f"without --shard-group does not send")
    return sorted(ops, key=lambda o: o.start), problems, ms(t1)


def _scattered(ops: list, units: list, t: float, sent: int, N: int) -> str:
    """The unit of a reduce-scatter started at t: the block whose backward span holds t, else the
    embedding-side unit nearest its size."""
    for o in ops:
        if o.kind == "backward" and o.piece.startswith("h.") and o.start <= t <= o.end:
            return o.piece
    outer = [u for u in units if u.block is None]
    return min(outer, key=lambda u: abs(u.nbytes * (N - 1) / N - sent)).label if outer else "?"


# --- the checks ----------------------------------------------------------------------------------
def held_peak(ops: list, units: list) -> int:
    """Bytes of gathered parameters at the peak, replayed from the trace (the module docstring)."""
    size, moves = {u.label: u.nbytes for u in units}, []
    gathers = [o for o in ops if o.kind == "all-gather" and o.piece in size]
    piece = {u.label: u.piece for u in units}
    for g in gathers:
        again = any(o.piece == g.piece and o.start > g.start for o in gathers)
        ends = [o.end for o in ops if o.kind == "forward" and o.piece == piece[g.piece] and o.end >= g.start] \
            if again else [o.start for o in ops if o.kind == "reduce-scatter" and o.piece == g.piece
                           and o.start >= g.start]
        moves += [(g.start, size[g.piece]), (min(ends, default=float("inf")), -size[g.piece])]
    held = peak = 0
    for _, n in sorted(moves, key=lambda m: (m[0], m[1])):     # a release before a start at the same time
        held += n
        peak = max(peak, held)
    return peak


def check_rank(ops: list, m: dict, rank: int, where: str) -> list[str]:
    """calls, bytes, where and order (the module docstring) of one rank's step."""
    from minipar.parallel.zero import formulas                          # noqa: PLC0415
    from minipar.plan import comm_bytes                                 # noqa: PLC0415
    out, N, M, K, s, L = [], m["N"], m["M"], m["K"], m["itemsize"], m["L"]
    n_rs, n_ag = formulas.collectives_per_step(3, M, m["reshard"])
    for u in m["units"]:
        ag = [o for o in ops if o.kind == "all-gather" and o.piece == u.label]
        rs = [o for o in ops if o.kind == "reduce-scatter" and o.piece == u.label]
        fwd = sum(o.phase == "forward" for o in ag)
        if (len(ag), fwd, len(rs)) != (n_ag, M, n_rs):
            out.append(f"{where}: {u.label} is all-gathered {fwd} time(s) in forward and {len(ag) - fwd} in "
                       f"backward, reduce-scattered {len(rs)} time(s); formulas.collectives_per_step: {n_ag} "
                       f"all-gather(s), {M} of them in forward, and {n_rs} reduce-scatter(s)")
        want = {"all-gather": comm_bytes.all_gather_sent(u.nbytes // s // N, s, N),
                "reduce-scatter": comm_bytes.reduce_scatter_sent(u.nbytes // s, s, N, rank)}
        out += [f"{where}: the {o.phase} {o.kind} of {u.label} at {o.start:.2f} ms sends {o.nbytes} B, not "
                f"(N-1)/N x {u.nbytes} B = {want[o.kind]} B" for o in ag + rs if o.nbytes != want[o.kind]]
        if u.block is None:
            continue
        for o in ag:                                # where prefetch K starts it
            j = u.block - K if o.phase == "forward" else u.block + K
            host = ("embed" if j < 0 else "head" if j >= L else f"h.{j}")
            spans = [x for x in ops if x.kind == o.phase and x.piece == host]
            if not any(x.start - SLACK <= o.start <= x.end + SLACK for x in spans):
                inside = next((f"inside {x.piece} {x.kind}" for x in ops if x.kind in ("forward", "backward")
                               and x.start <= o.start <= x.end), "outside every layer span")
                out.append(f"{where}: block {u.block}'s {o.phase} all-gather starts at {o.start:.2f} ms, "
                           f"{inside}, not inside {host} {o.phase}, where prefetch {K} starts it")
    order = [(o.piece, o.kind) for o in ops if o.kind in ("forward", "backward")]
    pieces = ["embed", *(f"h.{i}" for i in range(L)), "head"]
    want = ([(x, "forward") for x in pieces] + [(x, "backward") for x in pieces[::-1]]) * M
    if order != want:
        seen = ", ".join(f"{p} {k}" for p, k in order)
        out.append(f"{where}: layer spans in the order {seen}; the model runs embed, h.0 .. h.{L - 1}, head "
                   f"forward, then back")
    return out


# --- the picture -----------------------------------------------------------------------------------
@dataclass
class Panel:
    setting: Setting
    ops: list                   # rank 0's step
    step_ms: float
    figures: dict               # measured, formula and log: waits, peak, bytes


@dataclass
class FsdpPicture:
    title: str
    p: int
    step: int
    panels: list
    units: list
    problems: list = field(default_factory=list)


def fsdp_picture(runs: list, step: int = FSDP_STEPS - 1) -> FsdpPicture:
    """Every rank's step read and checked (the module docstring); rank 0's drawn."""
    from minipar.parallel.zero import formulas                          # noqa: PLC0415
    from minipar.show import traceview                                  # noqa: PLC0415
    panels, problems = [], []
    for run in runs:
        name, m = run.setting.label, model_of(run.trace["otherData"]["minipar"])
        if (m["K"], m["reshard"]) != (run.setting.prefetch, run.setting.reshard):
            raise ExplainError(f"{name}: the trace's run has prefetch {m['K']}, reshard {m['reshard']}")
        problems += [f"{name}: {x}" for x in traceview.audit(run.trace)]
        units, events = m["units"], traceview.spans(run.trace)
        formula = formulas.gathered_peak(sum(u.nbytes for u in units if u.block is None),
                                         [u.nbytes for u in units if u.block is not None], m["K"], m["reshard"])
        theory = formulas.traffic_theory(3, sum(u.nbytes for u in units) // m["itemsize"], m["N"], m["itemsize"],
                                         m["M"], 1, m["reshard"])
        for r in sorted(traceview.processes(run.trace)):
            where = f"{name}, rank {r}"
            ops, found, step_ms = read_step([e for e in events if e["pid"] == r], step, m, where)
            peak, sent = held_peak(ops, units), sum(o.nbytes for o in ops if o.kind in ("all-gather", "reduce-scatter"))
            problems += found + check_rank(ops, m, r, where) + (
                [f"{where}: gathered at the peak {peak} B (the trace replayed), formulas.gathered_peak {formula} B"]
                if peak != formula else []) + (
                [f"{where}: ZeRO sent {sent} B in step {step}; formulas.traffic_theory {theory:.0f} B"]
                if abs(sent - theory) > 0.5 else [])
            if r == 0:
                panels.append(Panel(run.setting, ops, step_ms, {"peak": peak, "formula": formula, "sent": sent,
                                                               "theory": theory}))
        row = next((x for x in run.rows if x.get("step") == step), {})
        panels[-1].figures.update(log_peak=row.get("zero_gathered_peak"), log_sent=row.get("zero_bytes"),
                                  log_wait=row.get("zero_gather_wait_s", {}))
        for what, got, want in (("gathered peak (zero_gathered_peak)", row.get("zero_gathered_peak"), formula),
                                ("bytes (zero_bytes)", row.get("zero_bytes"), theory),
                                ("gathered_peak_formula", run.summary.get("zero", {}).get("gathered_peak_formula"),
                                 formula)):
            if got is None or abs(got - want) > 0.5:
                problems.append(f"{name}: the log's {what} of step {step} is {got}; the formula's {want:.0f}")
    p = runs[0].trace["otherData"]["minipar"]["world"]
    title = (f"ZeRO-3's all-gathers and reduce-scatters: {p} ranks, GPT-2 of {m['L']} blocks, step {step} "
             f"of rank 0 as measured, one time scale")
    return FsdpPicture(title, p, step, panels, m["units"], problems)


def panel_lines(pic: FsdpPicture, k: int) -> list[str]:
    """A panel's heading and its figures: the trace's beside the formula's and the log's."""
    pan, kib = pic.panels[k], (lambda n: f"{(n or 0) / 1024:,.2f} KiB")
    f, s, lw = pan.figures, pan.setting, pan.figures.get("log_wait", {})
    w = {ph: sum(o.end - o.start for o in pan.ops if o.kind == "wait" and o.phase == ph)
         for ph in ("forward", "backward")}
    kept = ("every block" if not s.reshard else f"the {s.prefetch + 1} largest blocks in a row" if s.prefetch
            else "the largest block")
    calls = "1 all-gather" if not s.reshard else "2 all-gathers"
    return [f"({'abc'[k]}) {s.label}: step {pic.step} of rank 0, {pan.step_ms:.1f} ms",
            f"    exposed waits for all-gathers {w['forward']:.1f} ms in forward, {w['backward']:.1f} ms in backward "
            f"(the log: {lw.get('forward', 0) * 1e3:.1f}, {lw.get('backward', 0) * 1e3:.1f})",
            f"    gathered at the peak {kib(f['peak'])}; formula {kib(f['formula'])} (the embedding-side units + "
            f"{kept}); log {kib(f.get('log_peak'))}",
            f"    ZeRO sent {kib(f['sent'])}; formula {kib(f['theory'])} (per unit {calls} + 1 reduce-scatter of "
            f"(N-1)/N its bytes); log {kib(f.get('log_sent'))}"]


def _lanes(pan: Panel) -> list[tuple[str, list]]:
    """[(lane, [(op, row)])]: compute (the waits on it), all-gather, reduce-scatter; the
    collectives that overlap in time on rows of their own."""
    out = [("compute", [(o, 0) for o in pan.ops if o.kind in ("forward", "backward", "wait")])]
    for kind in ("all-gather", "reduce-scatter"):
        ends, ops = [], []
        for o in (o for o in pan.ops if o.kind == kind):
            r = next((i for i, e in enumerate(ends) if e <= o.start), len(ends))
            ends[r:r + 1] = [o.end]
            ops.append((o, r))
        out.append((kind, ops))
    return out


def _short(o: Op) -> str:
    return {"embed": "E", "head": "H"}.get(o.piece, o.piece.replace("h.", "h"))


def fsdp_text(pic: FsdpPicture, width: int = 100) -> str:
    scale = width / (max(p.step_ms for p in pic.panels) or 1.0)
    out = [pic.title, ""]
    for k, pan in enumerate(pic.panels):
        out += panel_lines(pic, k)
        for lane, ops in _lanes(pan):
            rows = [[" "] * width for _ in range(max([r for _, r in ops] + [0]) + 1 + (lane == "compute"))]
            for o, r in ops:
                a = min(round(o.start * scale), width - 1)
                b = min(max(round(o.end * scale), a + 1), width)
                label = "" if o.kind == "wait" else _short(o)
                rows[r + (o.kind == "wait")][a:b] = (label + FILLS[o.kind] * (b - a))[:b - a]
            names = [lane, "exposed wait"] if lane == "compute" else [lane] + [""] * (len(rows) - 1)
            out += [f"    {n:<15}|{''.join(row)}|" for n, row in zip(names, rows)]
        out.append("")
    out += ["E embed, H head, hN block N; = forward, - backward, # waiting for an all-gather, ~ all-gather, "
            "+ reduce-scatter, each labelled with its unit", FORMULAS,
            "unit bytes (padded; wte, wpe: the embedding-side units, wpe with ln_f): "
            + ", ".join(f"{u.label} {u.nbytes:,}" for u in pic.units)]
    return "\n".join(out + [f"PROBLEM: {line}" for line in pic.problems])


def fsdp_svg(pic: FsdpPicture, width: int = 1000) -> str:
    """The panels one above the other, on one time scale; a bar's tooltip gives its times and bytes."""
    left, lane_h, t_end = 120, 20, max(p.step_ms for p in pic.panels) or 1.0
    scale = (width - left - 20) / t_end
    tick = next(x * 10 ** e for e in range(-2, 6) for x in (1, 2, 5) if x * 10 ** e * 8 >= t_end)
    body, y = [_text(10, 20, pic.title, ' font-size="14"' + BOLD)], 30
    for k, pan in enumerate(pic.panels):
        lines = panel_lines(pic, k)
        body += [_text(10, y + 16 * (i + 1), line.strip(), BOLD if i == 0 else "") for i, line in enumerate(lines)]
        y += 16 * len(lines) + 8
        for lane, ops in _lanes(pan):
            rows, h = max([r for _, r in ops] + [0]) + 1, lane_h + 8 * (lane == "compute")
            body += [_text(10, y + 14, lane), f'<rect x="{left}" y="{y}" width="{t_end * scale:.1f}" '
                     f'height="{rows * h}" fill="#f2f2f2"/>']
            labels = []
            for o, r in ops:
                x, w = left + o.start * scale, max((o.end - o.start) * scale, 0.8)
                top, hh = (y + 16, h - 18) if o.kind == "wait" else (y + r * h + 1, h - 2)
                what = f"{o.piece} {o.kind}" + (f" ({o.phase})" if o.phase and o.kind != o.phase else "")
                body.append(f'<rect x="{x:.1f}" y="{top}" width="{w:.1f}" height="{hh}" fill="{COLOURS[o.kind]}" '
                            f'stroke="white" stroke-width="0.5"><title>{_esc(what)} {o.start:.2f}-{o.end:.2f} ms'
                            + (f", {o.nbytes:,} B sent" if o.nbytes else "") + "</title></rect>")
                if o.kind != "wait" and w >= 7.2 * len(_short(o)) + 2:
                    labels.append(f'<text x="{x + w / 2:.1f}" y="{top + 13}" text-anchor="middle" fill="white">'
                                  f'{_esc(_short(o))}</text>')
            body += labels                                  # over the waits
            y += rows * h + 2
        for i in range(int(t_end // tick) + 1):
            x = left + i * tick * scale
            body += [f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#555"/>',
                     f'<text x="{x:.1f}" y="{y + 15}" text-anchor="middle">{i * tick:g} ms</text>']
        y += 24
    x = 10
    for name, colour in COLOURS.items():
        label = "exposed wait for an all-gather" if name == "wait" else name
        body += [f'<rect x="{x}" y="{y + 2}" width="12" height="12" fill="{colour}"/>', _text(x + 16, y + 12, label)]
        x += 16 + 7.2 * len(label) + 18
    body.append(_text(10, y + 30, "E embed, H head, hN block N; wte, wpe: the embedding-side units (wpe with ln_f); "
                                  "hover a bar for its times and bytes"))
    body.append(_text(10, y + 46, FORMULAS))
    y += 70
    height = y + 18 * len(pic.problems) + 10
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="DejaVu Sans Mono, monospace" font-size="12">',
            f'<rect width="{width}" height="{height}" fill="white"/>']
    return svg_end(head + body, y, pic.problems)
