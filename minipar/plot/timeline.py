"""The pipeline timeline of one step as a figure: `python -m minipar.plot LOG --trace T.json`.

The input is traceview.pipeline_timeline's dict, read from a trace of the run (the last
step in it):
    timeline          [(stage, "F" or "B", micro-batch, start_s, end_s), ...]
    n_stages, step    p, and the step drawn
    bubble            the mean over stages of each stage's idle fraction of the longest
                      stage's span (pipeline.py's measured bubble)
    bubble_per_stage  that idle fraction for each stage
    schedule          "1f1b", "gpipe", ... or None
One row per stage (stage 0 on top), a bar per forward (blue) and backward (green) labelled
with its micro-batch, on a grey row, time in ms from the step's schedule start. The grey
gaps are the bubble; the title gives its measured size. draw.py draws the same rows as text
and as a hand-written SVG; this is its matplotlib twin, in the colours of draw.timeline_svg.
"""
from __future__ import annotations

import os

from minipar.show import draw, traceview


def load_timeline(path: str, note) -> dict | None:
    """--trace FILE: the last step's timeline (traceview.pipeline_timeline), or None with a
    note if the trace has no forwards or backwards. ValueError (one line) if it is no trace."""
    if not os.path.isfile(path):
        raise ValueError(f"--trace {path}: no such file")
    try:
        tl = traceview.pipeline_timeline(traceview.load(path))
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"--trace {path}: not a minipar trace with a pipeline ({e})") from None
    if not tl or not tl.get("timeline"):
        note(f"--trace {path}: no pipeline forwards or backwards in it; no timeline drawn")
        return None
    return tl


def figure_size(n_stages: int) -> tuple[float, float]:
    """Inches (x dpi = pixels): 12 wide, a row of 0.6 per stage below the title."""
    return (12.0, 1.6 + 0.6 * max(n_stages, 1))


def draw_timeline(tl: dict, dpi: int):
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    p, rows = tl["n_stages"], tl["timeline"]
    fig = Figure(figsize=figure_size(p), dpi=dpi, layout="constrained")
    ax = fig.subplots()
    t0 = min(0.0, min(r[3] for r in rows))          # traceview's times start at the step's schedule
    span_ms = (max(r[4] for r in rows) - t0) * 1e3
    ax.barh(range(p), span_ms, height=0.7, color="#eeeeee")         # idle: the bubble
    for stage, kind, mb, start, end in rows:         # kind: F, B or W, the chunk after it if not 0
        a, w = (start - t0) * 1e3, (end - start) * 1e3
        ax.barh(stage, w, left=a, height=0.7, color=draw.COLORS[kind[0]][int(kind[1:] or 0) % 2],
                edgecolor="white", linewidth=0.6)
        if w >= 0.025 * span_ms:                    # room for the label
            ax.text(a + w / 2, stage, f"{kind[0]}{mb}", ha="center", va="center", color="white", fontsize=8)
    per_stage = tl.get("bubble_per_stage") or []
    ax.set_yticks(range(p), [f"stage {s}" + (f"\nidle {per_stage[s]:.2f}" if s < len(per_stage) else "")
                             for s in range(p)])
    ax.set_ylim(p - 0.5, -0.5)                       # stage 0 on top
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time since the step's schedule started (ms)")
    ax.grid(axis="x", alpha=0.3)
    schedule = tl.get("schedule") or "pipeline"
    ax.set_title(f"{schedule}, {p} stages, step {tl['step']}: bubble {tl['bubble']:.3f} measured "
                 f"(mean idle fraction of the longest stage's span)", fontsize=11)
    kinds = {r[1] for r in rows}
    legend = [("F", 0, "F forward"), ("B", 0, "B backward"), ("W", 0, "W weight gradients")]
    legend += [(k, 1, f"{k} of an odd chunk") for k in "FBW" if any(x[0] == k and x[1:] for x in kinds)]
    ax.legend(handles=[Patch(color=draw.COLORS[k][odd], label=label) for k, odd, label in legend
                       if any(x[0] == k for x in kinds)],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9)
    return fig
