"""Drawings of a pipeline timeline: who computed what, when.

A timeline is a list of (stage, kind, micro-batch, start, end) with kind "F" (forward), "B"
(backward, or its B part when W is split off) or "W" (the weight gradients, zero_bubble.py),
followed by the model chunk when it is not 0 ("F1": interleaved.py). It comes from one of two places:
    simulated  parallel/schedules.check(p, m, name).timeline: every stage's instruction list
               run together without MPI, F and B in whole time units (the schedule's shape);
    measured   parallel/pipeline.PipelineEngine.gather_stats(): the last step's forwards and
               backwards as each stage timed them (seconds since its own step start), which
               the summary keeps as `pipeline.last_step_timeline` (docs/design.md §8).

Two drawings of it:
    ascii_gantt    one text row per stage, "stage 1 |..F0F1..B0F2..", '.' where the stage
                   idles: the schedule docstrings' charts and the summary's "last step's
                   timeline" lines. Idle cells are the bubble, seen.
    timeline_svg   the same rows as a hand-written SVG, a rectangle per forward (blue) and
                   backward (green) on a time axis in ms: `python -m minipar.train --pp P
                   --timeline FILE.svg`.
Neither computes anything: the bubble and the times are the caller's figures.
"""
from __future__ import annotations


# --- the terminal Gantt chart (simulated unit times or measured seconds) ------------------------

def _mb_char(mb):
    return "0123456789abcdefghijklmnopqrstuvwxyz"[mb] if mb < 36 else "*"


def ascii_gantt(timeline, n_stages: int, width: int = 120) -> str:
    """One row per stage: "stage 1 |..F0F1..B0F2..". An op drawn over n cells reads
    "F3" / "B3--" / "W3" (n >= 2) or "3" (n == 1), in lower case for an odd model chunk
    (interleaved: "f3" is chunk 1's forward); '.' is idle. Integer times (the checker's)
    get 2 cells per unit, or 1 if that is wider than `width`; other times (seconds) are
    scaled so the whole run spans `width` cells. Times are measured from the earliest start."""
    if not timeline:
        return "\n".join(f"stage {s} |" for s in range(n_stages))
    t0 = min(r[3] for r in timeline)
    span = max(r[4] for r in timeline) - t0
    integral = all(float(r[3]).is_integer() and float(r[4]).is_integer() for r in timeline)
    if integral and 2 * span <= width:
        scale = 2
    elif integral and span <= width:
        scale = 1
    else:
        scale = width / span if span > 0 else 1.0
    n_cells = max(1, round(span * scale))
    rows = [["."] * n_cells for _ in range(n_stages)]
    for stage, kind, mb, start, end in sorted(timeline, key=lambda r: (r[0], r[3])):
        a = min(round((start - t0) * scale), n_cells - 1)
        b = min(max(round((end - t0) * scale), a + 1), n_cells)
        letter = kind[0] if int(kind[1:] or 0) % 2 == 0 else kind[0].lower()   # odd chunks: f, b, w
        label = (letter + _mb_char(mb)) if b - a >= 2 else _mb_char(mb)
        rows[stage][a:b] = (label + "-" * (b - a))[:b - a]
    digits = len(str(n_stages - 1))
    return "\n".join(f"stage {s:>{digits}} |{''.join(row)}" for s, row in enumerate(rows))


# --- the timeline as an SVG ---------------------------------------------------------------------

COLORS = {"F": ("#4c78a8", "#9ecae9"), "B": ("#54a24b", "#a6d96a"), "W": ("#e45756", "#ff9d98")}   # chunk 0, odd


def timeline_svg(timeline, n_stages: int, title: str = "", width: int = 960) -> str:
    """A hand-written SVG of [(stage, kind, mb, start, end)]: one row per stage, a rect per
    forward (blue), backward (green) and W (red; zero-bubble), lighter for odd model chunks
    (interleaved), labelled with its micro-batch, a time axis in ms."""
    row_h, left, top = 28, 70, 30
    t_end = max((r[4] for r in timeline), default=1.0) or 1.0
    scale = (width - left - 20) / t_end
    height = top + n_stages * row_h + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="18" font-size="13">{_esc(title)}</text>']
    for s in range(n_stages):
        y = top + s * row_h
        out.append(f'<text x="8" y="{y + 17}">stage {s}</text>')
        out.append(f'<rect x="{left}" y="{y + 2}" width="{t_end * scale:.1f}" height="{row_h - 4}" '
                   f'fill="#eeeeee"/>')
    for s, kind, mb, a, b in timeline:
        y, x, w = top + s * row_h, left + a * scale, max((b - a) * scale, 0.5)
        color = COLORS[kind[0]][int(kind[1:] or 0) % 2]
        out.append(f'<rect x="{x:.1f}" y="{y + 2}" width="{w:.1f}" height="{row_h - 4}" fill="{color}" '
                   f'stroke="white" stroke-width="0.5"><title>{_op(kind, mb)} {a * 1e3:.2f}-{b * 1e3:.2f} ms'
                   f'</title></rect>')
        if w >= 14:
            out.append(f'<text x="{x + w / 2:.1f}" y="{y + 18}" text-anchor="middle" fill="white">'
                       f'{_op(kind, mb)}</text>')
    y = top + n_stages * row_h + 16
    for k in range(6):
        t = t_end * k / 5
        out.append(f'<text x="{left + t * scale:.1f}" y="{y}" text-anchor="middle">{t * 1e3:.1f} ms</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _op(kind: str, mb: int) -> str:
    """An op's label: "F3", or "F3@1" for chunk 1 (interleaved), as schedules print it."""
    return f"{kind[0]}{mb}" + (f"@{kind[1:]}" if kind[1:] else "")


def _esc(text: str) -> str:
    """The title as SVG text: &, < and > escaped."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
