"""Plots of a training run, from the JSONL logs of `python -m minipar.train --log FILE.jsonl`
(docs/design.md §8) and, for the pipeline timeline, a trace (`--trace`):

    python -m minipar.plot run.jsonl [other.jsonl ...] [--label NAME ...] [--trace T.json]
                           [--out DIR] [--format png,svg]

Several logs overlay on the same axes (fp32 beside fp16, dp1 beside dp2). The figures:
    loss        the loss vs step and vs tokens trained on; the validation loss as markers
    throughput  tokens/s and MFU vs step
    comm        the bytes rank 0 sent in each step, stacked by the axis of the group they went
                over (dp, tp, pp, zero, world: the ledger's axes, docs/design.md §5); one panel
                per log
    memory      the model-state bytes each rank holds, params + grads + optimizer stacked,
                beside the formula's total (report.memory_report); one panel per log
    timeline    --trace only: each pipeline stage's forwards and backwards (plot_timeline.py)

Reading and drawing are apart: read_log, series, tokens, val_points, bytes_by_axis and
memory_table turn a log into numbers (the tests check them against the log), and the draw_*
functions only draw those numbers. matplotlib is imported inside the drawing code, so this
module imports without it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass

import numpy as np

from minipar.plot import timeline as plot_timeline

DPI = 100
FORMATS = ("png", "svg", "pdf")
FIGURES = ("loss", "throughput", "comm", "memory")  # then "timeline" with --trace
AXES = ("dp", "cp", "tp", "pp", "zero", "world")    # the process grid's group axes (§5)
AXIS_COLORS = {"dp": "#4c78a8", "cp": "#72b7b2", "tp": "#f58518", "pp": "#54a24b", "zero": "#e45756",
               "world": "#b279a2"}
STATES = ("params", "grads", "optimizer")          # model states, stacked in the memory figure
STATE_COLORS = {"params": "#4c78a8", "grads": "#f58518", "optimizer": "#54a24b"}
NO_MATPLOTLIB = "minipar.plot: matplotlib is not installed; pip install -e '.[plot]' (or make install)"


class PlotError(Exception):
    """Bad input: printed as one `minipar.plot: error:` line, exit 2."""


# --- a log as numbers ---------------------------------------------------------------------------

@dataclass
class Run:
    path: str
    rows: list                 # the step rows, in file order
    summary: dict | None       # the closing summary object; None if the run did not finish
    label: str = ""            # the legend's name for it


def read_log(path: str) -> Run:
    """The step rows (objects with "step" and "loss") and the summary ("summary": true)."""
    if not os.path.isfile(path):
        raise PlotError(f"{path}: no such file")
    rows, summary, n = [], None, 1
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError
                if obj.get("summary") is True:
                    summary = obj
                elif "step" in obj and "loss" in obj:
                    rows.append(obj)
    except (ValueError, UnicodeDecodeError):
        raise PlotError(f"{path}: line {n} is not a JSON object: not a minipar log "
                        f"(python -m minipar.train --log FILE.jsonl writes one)") from None
    if not rows:
        raise PlotError(f"{path}: no step rows (objects with \"step\" and \"loss\"): not a minipar log "
                        f"(python -m minipar.train --log FILE.jsonl writes one)")
    return Run(path, rows, summary)


def series(run: Run, key: str) -> np.ndarray | None:
    """One number per step row (null -> NaN); None if no row has the key."""
    if not any(key in r for r in run.rows):
        return None
    return np.array([np.nan if r.get(key) is None else float(r[key]) for r in run.rows])


def tokens(run: Run) -> np.ndarray:
    """Tokens trained on after each step, (step + 1)·B·T: the rows' "tokens", or, in a log
    written before that key, with B·T = tokens_per_s · step_time (§8's definition of tokens_per_s)."""
    t = series(run, "tokens")
    if t is not None and not np.isnan(t).any():
        return t
    BT = [round(r["tokens_per_s"] * r["step_time"]) for r in run.rows]
    return np.array([(r["step"] + 1) * bt for r, bt in zip(run.rows, BT)], dtype=float)


def val_points(run: Run) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """-> (steps, tokens, val losses, per_step): the rows' "val_loss" (--eval-every) and the
    summary's final one at the last step, or that final one alone (per_step False); empty
    arrays if neither."""
    steps, toks = series(run, "step"), tokens(run)
    v = series(run, "val_loss")
    final = (run.summary or {}).get("val_loss")
    if v is not None and not np.isnan(v).all():
        if final is not None and np.isnan(v[-1]):
            v = v.copy()
            v[-1] = final
        keep = ~np.isnan(v)
        return steps[keep], toks[keep], v[keep], True
    if final is None:
        return np.array([]), np.array([]), np.array([]), False
    return steps[-1:], toks[-1:], np.array([float(final)]), False


def bytes_by_axis(run: Run) -> dict[str, np.ndarray] | None:
    """{axis: bytes rank 0 sent on that axis in each step}, every axis of AXES (absent: 0) and
    any other a row names; None if the log has no "bytes_by_axis" (written before that key)."""
    if not any("bytes_by_axis" in r for r in run.rows):
        return None
    sent = [r.get("bytes_by_axis", {}) or {} for r in run.rows]
    others = sorted({a for row in sent for a in row} - set(AXES))
    return {a: np.array([float(row.get(a) or 0) for row in sent]) for a in list(AXES) + others}


def memory_table(summary: dict) -> list[dict]:
    """One row per world rank: {"rank", "params", "grads", "optimizer", "formula_total"} in
    bytes, and "formula_text", from the summary's "memory_per_rank" (each rank's memory and
    its "formula" terms), or, in a log written before it, rank 0's "memory" alone. The
    formula's total is the sum of its three terms; its text is rank 0's ("4P + 4P + 8P")."""
    rank0 = dict(summary["memory"], rank=0)
    text = rank0["formula"].get("text", "")
    table = []
    for e in summary.get("memory_per_rank") or [rank0]:
        f = e.get("formula") or {}
        row = {k: e[k] for k in ("rank",) + STATES}
        row["formula_total"] = e.get("formula_total", f.get("total", sum(f.get(k, 0) for k in STATES)))
        row["formula_text"] = e.get("formula_text", f.get("text", text))
        table.append(row)
    return table


def describe(summary: dict | None) -> str | None:
    """A short name from the layout: "dp2 pp2 zero1", "1 process", plus the precision if
    not fp32 ("dp2 fp16"); None without a summary."""
    if not summary or "layout" not in summary:
        return None
    lay = summary["layout"]
    parts = [f"{a}{lay[a]}" for a in ("dp", "cp", "tp", "pp") if lay.get(a, 1) > 1]
    parts += [f"zero{lay['zero']}"] if lay.get("zero") else []
    mode = (summary.get("precision") or {}).get("mode", "fp32")
    return " ".join(parts or ["1 process"]) + ("" if mode == "fp32" else f" {mode}")


def set_labels(runs: list[Run], given: list[str] | None):
    """--label NAME per log, in order; else describe(summary) or the file's stem. Two logs
    that would share a name get their file stems added."""
    if given:
        if len(given) != len(runs):
            raise PlotError(f"{len(given)} --label value(s) for {len(runs)} log(s): "
                            f"give one per log, in order")
        for r, name in zip(runs, given):
            r.label = name
        return
    stem = [os.path.splitext(os.path.basename(r.path))[0] for r in runs]
    names = [describe(r.summary) or s for r, s in zip(runs, stem)]
    for r, name, s in zip(runs, names, stem):
        r.label = name if names.count(name) == 1 or name == s else f"{name} ({s})"


# --- drawing ------------------------------------------------------------------------------------

def figure_size(name: str, n_logs: int = 1) -> tuple[float, float]:
    """Inches (x DPI = pixels): two panels side by side, or one panel per log, three a row."""
    if name in ("comm", "memory") and n_logs > 1:
        cols = min(n_logs, 3)
        return (max(12.0, 5.0 * cols), 4.5 * math.ceil(n_logs / 3))
    return (12.0, 4.5)


def new_figure(name: str, n_logs: int = 1, n_panels: int = 2):
    from matplotlib.figure import Figure
    fig = Figure(figsize=figure_size(name, n_logs), dpi=DPI, layout="constrained")
    cols = min(n_panels, 3)
    axs = fig.subplots(math.ceil(n_panels / cols), cols, squeeze=False).ravel()
    for ax in axs[n_panels:]:
        ax.set_visible(False)
    return fig, list(axs[:n_panels])


def colors(n: int) -> list:
    from matplotlib import colormaps
    return [colormaps["tab10"](i % 10) for i in range(n)]


def draw_loss(runs: list[Run]):
    """Two panels: the loss vs step, and vs tokens trained on; val loss as markers."""
    fig, (a_step, a_tok) = new_figure("loss")
    n = len(runs)
    for i, (run, c) in enumerate(zip(runs, colors(n))):
        loss, steps, toks = series(run, "loss"), series(run, "step"), tokens(run)
        vs, vt, vl, per_step = val_points(run)
        lw = 1.4 + 1.2 * min(n - 1 - i, 3)          # earlier runs wider: equal curves nest as bands
        for ax, x, vx in ((a_step, steps, vs), (a_tok, toks, vt)):
            ax.plot(x, loss, color=c, lw=lw, label=f"{run.label} train")
            if len(vl):
                ax.plot(vx, vl, color=c, ls="--" if per_step else "none", marker="o", ms=6, mfc="white",
                        label=f"{run.label} val" + ("" if per_step else " (end)"))
    a_step.set(xlabel="step", ylabel="loss (nats)", title="loss vs step")
    a_tok.set(xlabel="tokens trained on", ylabel="loss (nats)", title="loss vs tokens")
    for ax in (a_step, a_tok):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=9)
    return fig


def draw_throughput(runs: list[Run], note):
    """Two panels: tokens/s vs step, MFU vs step."""
    from matplotlib.ticker import PercentFormatter
    fig, (a_tps, a_mfu) = new_figure("throughput")
    for run, c in zip(runs, colors(len(runs))):
        steps = series(run, "step")
        a_tps.plot(steps, series(run, "tokens_per_s"), color=c, marker=".", label=run.label)
        mfu = series(run, "mfu")
        if mfu is None:
            note(f"{run.path}: no \"mfu\" in its rows; left out of the MFU panel")
        else:
            a_mfu.plot(steps, mfu, color=c, marker=".", label=run.label)
    a_tps.set(xlabel="step", ylabel="tokens / s", title="throughput (B·T / step time)")
    a_mfu.set(xlabel="step", ylabel="MFU", title="MFU (model FLOP/s / measured matmul peak)")
    a_mfu.yaxis.set_major_formatter(PercentFormatter(1.0))
    for ax in (a_tps, a_mfu):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=9)
    return fig


def byte_unit(n: float) -> tuple[float, str]:
    """The binary unit that shows n as 1 to 1023 of it: (its size in bytes, its name)."""
    for k, unit in enumerate(("B", "KiB", "MiB", "GiB")):
        if n < 1024 ** (k + 1) or unit == "GiB":
            return 1024 ** k, unit


def message(ax, text: str):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.35", wrap=True)
    ax.set(xticks=[], yticks=[])


def draw_comm(runs: list[Run], note):
    """One panel per log: bytes rank 0 sent per step, stacked by axis, and the row's
    comm_bytes (every axis) as a tick: the stack reaches it when every group is tagged."""
    fig, axs = new_figure("comm", len(runs), len(runs))
    for run, ax in zip(runs, axs):
        ax.set_title(f"{run.label}: bytes rank 0 sent per step", fontsize=11)
        by_axis = bytes_by_axis(run)
        if by_axis is None:
            note(f"{run.path}: no \"bytes_by_axis\" in its rows (a log from before that key); "
                 f"comm panel empty")
            message(ax, "no bytes_by_axis in this log\n(written before that key)")
            continue
        total = series(run, "comm_bytes")
        top = max(np.nanmax(sum(by_axis.values())), np.nanmax(total) if total is not None else 0)
        if not top > 0:
            lay = (run.summary or {}).get("layout", {})
            one = lay.get("dp", 1) * lay.get("cp", 1) * lay.get("tp", 1) * lay.get("pp", 1) == 1
            message(ax, "nothing sent" + (": one process" if one else ""))
            continue
        scale, unit = byte_unit(top)
        steps = series(run, "step")
        bottom = np.zeros(len(steps))
        for a, v in by_axis.items():
            if np.nansum(v) == 0:
                continue
            if len(steps) <= 60:
                ax.bar(steps, v / scale, bottom=bottom, width=0.8, color=AXIS_COLORS.get(a), label=a)
            else:
                ax.fill_between(steps, bottom, bottom + v / scale, step="mid", color=AXIS_COLORS.get(a),
                                label=a)
            bottom = bottom + np.nan_to_num(v) / scale
        if total is not None:
            tick = max(3, min(14, 400 / len(steps)))
            ax.plot(steps, total / scale, ls="none", marker="_", ms=tick, mew=2, color="black",
                    label="comm_bytes (all axes)")
        ax.set(xlabel="step", ylabel=f"bytes sent ({unit})", ylim=(0, 1.3 * top / scale))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(loc="upper right", fontsize=8, ncols=3)
    return fig


def draw_memory(runs: list[Run], note):
    """One panel per log: each rank's params + grads + optimizer bytes stacked, and beside
    each bar an outlined bar of the formula's total."""
    fig, axs = new_figure("memory", len(runs), len(runs))
    for run, ax in zip(runs, axs):
        ax.set_title(f"{run.label}: model states per rank", fontsize=11)
        if not (run.summary or {}).get("memory"):
            note(f"{run.path}: no summary line with \"memory\" (the run did not finish); memory panel empty")
            message(ax, "no summary in this log\n(the run did not finish)")
            continue
        if not run.summary.get("memory_per_rank"):
            note(f"{run.path}: no \"memory_per_rank\" in its summary (a log from before that key); "
                 f"rank 0 only")
        table = memory_table(run.summary)
        ranks = np.array([e["rank"] for e in table], dtype=float)
        held = [sum(e[k] for k in STATES) for e in table]
        top = max(held + [e["formula_total"] for e in table])
        scale, unit = byte_unit(top)
        bottom = np.zeros(len(table))
        for part in STATES:
            v = np.array([e[part] for e in table]) / scale
            ax.bar(ranks - 0.2, v, width=0.38, bottom=bottom, color=STATE_COLORS[part], label=part)
            bottom += v
        formula = table[0]["formula_text"].split(" (")[0]
        ax.bar(ranks + 0.2, [e["formula_total"] / scale for e in table], width=0.38, fill=False,
               edgecolor="black", hatch="//", label=f"formula: {formula}")
        if len(table) <= 8:                              # the two totals, written on top
            for e, x, h in zip(table, ranks, held):
                for dx, v in ((-0.2, h), (0.2, e["formula_total"])):
                    ax.text(x + dx, v / scale, f"{v / scale:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set(xlabel="world rank", ylabel=f"bytes held ({unit})", xticks=ranks,
               xlim=(ranks.min() - 0.8, ranks.max() + 0.8), ylim=(0, 1.35 * top / scale))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(loc="upper right", fontsize=8, ncols=2)
    return fig


def save(fig, out_dir: str, name: str, formats: list[str]) -> list[str]:
    paths = []
    for fmt in formats:
        path = os.path.join(out_dir, f"{name}.{fmt}")
        fig.savefig(path, dpi=DPI, format=fmt)
        fig.set_layout_engine("none")                # keep the first format's layout: computed once
        paths.append(path)
    return paths


def draw_all(runs: list[Run], timeline: dict | None, out_dir: str, formats: list[str],
             note) -> list[str]:
    """Every figure into out_dir, in each format: -> the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    drawers = {"loss": lambda: draw_loss(runs), "throughput": lambda: draw_throughput(runs, note),
               "comm": lambda: draw_comm(runs, note), "memory": lambda: draw_memory(runs, note)}
    figures = [(name, drawers[name]) for name in FIGURES]
    if timeline is not None:
        figures.append(("timeline", lambda: plot_timeline.draw_timeline(timeline, DPI)))
    paths = []
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "minipar"}):
        for name, draw in figures:
            paths += save(draw(), out_dir, name, formats)
    return paths


# --- the command line ---------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minipar.plot", allow_abbrev=False,
        description="Draw a training run from its --log FILE.jsonl (python -m minipar.train "
                    "--log ...): loss, throughput, communication by axis, memory per rank, and "
                    "with --trace the pipeline timeline. Several logs overlay on the same axes.",
        epilog="example: python -m minipar.plot fp32.jsonl fp16.jsonl --label fp32 fp16 --out plots")
    p.add_argument("logs", nargs="+", metavar="LOG.jsonl",
                   help="logs written by python -m minipar.train --log")
    p.add_argument("--label", action="extend", nargs="+", metavar="NAME",
                   help="the legend name of each log, in order, one per log (after the logs) "
                        "[from the log's layout, e.g. 'dp2 pp2 zero1', or the file name]")
    p.add_argument("--trace", metavar="T.json",
                   help="a trace (python -m minipar.train --trace) to draw the pipeline timeline from")
    p.add_argument("--out", metavar="DIR", help="where the figures go [the first log's directory]")
    p.add_argument("--format", default="png,svg", metavar="png,svg",
                   help=f"comma-separated formats, of {', '.join(FORMATS)} [png,svg]")
    return p


def parse_formats(text: str) -> list[str]:
    formats = [f.strip().lower() for f in text.split(",") if f.strip()]
    bad = [f for f in formats if f not in FORMATS]
    if bad or not formats:
        raise PlotError(f"--format {text}: unknown format {', '.join(bad) or '(none)'}; "
                        f"choose from {', '.join(FORMATS)}")
    return list(dict.fromkeys(formats))


def check_outputs(args, out: str, formats: list[str], with_timeline: bool):
    """Each figure file draw_all will write, against the logs and the trace it reads, and on its
    own: a new path or a regular file, never a folder, a device or a FIFO (outputs.py)."""
    from minipar.config import outputs  # noqa: PLC0415
    if os.path.lexists(out) and not os.path.isdir(out):
        raise PlotError(f"--out {out} exists and is not a directory")
    names = FIGURES + (("timeline",) if with_timeline else ())
    files = [("--out", os.path.join(out, f"{name}.{fmt}")) for name in names for fmt in formats]
    inputs = [("the log", p) for p in args.logs] + ([("--trace", args.trace)] if args.trace else [])
    try:
        outputs.check_paths(files, inputs)
    except outputs.OutputError as e:
        raise PlotError(str(e)) from None


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def note(text):
        print(f"minipar.plot: note: {text}", file=sys.stderr)

    try:
        formats = parse_formats(args.format)
        runs = [read_log(path) for path in args.logs]
        set_labels(runs, args.label)
        try:
            timeline = plot_timeline.load_timeline(args.trace, note) if args.trace else None
        except ValueError as e:
            raise PlotError(str(e)) from None
        out = args.out or os.path.dirname(os.path.abspath(args.logs[0]))
        check_outputs(args, out, formats, timeline is not None)
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            raise PlotError(f"--out {out}: {e.strerror}") from None
    except PlotError as e:
        print(f"minipar.plot: error: {e}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(NO_MATPLOTLIB, file=sys.stderr)
        return 2
    for path in draw_all(runs, timeline, out, formats, note):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
