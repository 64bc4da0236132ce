"""The drawings of python -m minipar.explain: a fixed-width text grid for the terminal and the
same grid as a hand-written SVG (like draw.timeline_svg: no matplotlib), and a PNG of that SVG
when resvg_py is installed. Nothing here computes: explain_read.py decodes the trace into a
Picture (collectives), an MLPPicture (Megatron's MLP) or a pipeline timeline dict (1F1B).

Collectives: one row per rank, one column per step. A cell lists what the rank sends,
"->1 p0 {0}" (to rank 1, piece 0, carrying the inputs of ranks {0}), and what it receives,
"<-3 p3 += {3}" (from rank 3, piece 3, added into its own copy; "=" copied). In the SVG each
message is a band in its piece's colour with one square per rank, filled for the contributors.
"""
from __future__ import annotations

import os

from minipar.draw import _esc, ascii_gantt, timeline_svg
from minipar.explain_read import piece_of, ranks_text

PALETTE = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6",
           "#9d755d", "#bab0ac"]
WHOLE, HEADER, RANGE = "#8c8c8c", "#d9d9d9", "#c7a76c"        # whole array, dtype/shape header, other
CHAR_W, LINE_H, PAD, SQ = 7.2, 18, 6, 8                         # monospace 12 px: a character's width
F_COLOR, B_COLOR, COMM_COLOR = "#4c78a8", "#54a24b", "#f58518"
BOLD = ' font-weight="bold"'


def colour(index: int, p: int) -> str:
    """Piece k's colour; -1 the whole array, -2 a header, -3 any other element range."""
    if index >= 0:
        return PALETTE[index] if p <= len(PALETTE) else f"hsl({round(360 * index / p)},55%,55%)"
    return {-1: WHOLE, -2: HEADER}.get(index, RANGE)


def message_text(kind: str, m, off, p: int, contributors: bool = True) -> str:
    _, label = piece_of(m, off)
    if m.mask is None:                          # a header, or data that did not decode ("?")
        return f"->{m.dst} {label} {m.nbytes} B" if kind == "send" else f"<-{m.src} {label}"
    who = f" {ranks_text(m.mask)}" if contributors else ""
    return f"->{m.dst} {label}{who}" if kind == "send" else f"<-{m.src} {label} {m.op}{who}"


def _ordered(cell):
    return sorted(cell, key=lambda km: (km[0] != "send", km[1].dst if km[0] == "send" else km[1].src))


# --- collectives --------------------------------------------------------------------------------

def grid_text(pic) -> str:
    """The terminal grid: a header row of steps, then each rank's lines."""
    lines = {(r, s): [message_text(k, m, pic.off, pic.p) for k, m in _ordered(pic.cells.get((r, s), []))]
             for r in range(pic.p) for s in pic.steps}
    width = {s: max([len(f"step {s}"), len(pic.columns[s])] + [len(t) for r in range(pic.p)
                                                               for t in lines[(r, s)]]) + 3 for s in pic.steps}
    label = len(f"rank {pic.p - 1}") + 3
    out = [pic.title, "",
           (" " * label + "".join(f"step {s}".ljust(width[s]) for s in pic.steps)).rstrip(),
           (" " * label + "".join(pic.columns[s].ljust(width[s]) for s in pic.steps)).rstrip()]
    for r in range(pic.p):
        rows = max(1, max(len(lines[(r, s)]) for s in pic.steps))
        for i in range(rows):
            head = f"rank {r}" if i == 0 else ""
            out.append(head.ljust(label) + "".join((lines[(r, s)][i] if i < len(lines[(r, s)]) else "")
                                                  .ljust(width[s]) for s in pic.steps).rstrip())
    out += ["", "->d sends to rank d, <-s receives from rank s; p<k> piece k of np.array_split, all the whole "
                "array; {..} the ranks whose inputs it sums; += added into its own copy, = copied"]
    out += [f"PROBLEM: {line}" for line in pic.problems]
    return "\n".join(out)


def grid_svg(pic) -> str:
    """The grid as an SVG: a box per (rank, step), a coloured band per message."""
    p = pic.p
    texts = {(r, s): [(k, m, message_text(k, m, pic.off, p, contributors=False))
                      for k, m in _ordered(pic.cells.get((r, s), []))] for r in range(p) for s in pic.steps}
    col_w = {s: max([len(f"step {s}"), len(pic.columns[s])] + [len(t) for r in range(p) for _, _, t in texts[(r, s)]])
             * CHAR_W + p * (SQ + 1) + 3 * PAD + 20 for s in pic.steps}
    row_h = [max(1, max(len(texts[(r, s)]) for s in pic.steps)) * LINE_H + 2 * PAD for r in range(p)]
    left, top = 70, 74
    width = max(left + sum(col_w.values()) + 20, 20 + len(pic.title) * CHAR_W * 14 / 12,
                20 + max(map(len, _legend_lines(p))) * CHAR_W)
    legend_y = top + sum(row_h) + 24
    height = legend_y + 70 + 18 * len(pic.problems)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'font-family="DejaVu Sans Mono, monospace" font-size="12">',
           f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
           f'<text x="10" y="22" font-size="14" font-weight="bold">{_esc(pic.title)}</text>']
    x = left
    xs = {}
    for s in pic.steps:
        xs[s] = x
        out.append(f'<text x="{x + PAD:.1f}" y="{top - 24}" font-weight="bold">step {s}</text>')
        out.append(f'<text x="{x + PAD:.1f}" y="{top - 8}" fill="#555555">{_esc(pic.columns[s])}</text>')
        x += col_w[s]
    y = top
    for r in range(p):
        out.append(f'<text x="10" y="{y + PAD + 13}" font-weight="bold">rank {r}</text>')
        for s in pic.steps:
            out.append(f'<rect x="{xs[s] + 2:.1f}" y="{y + 2}" width="{col_w[s] - 4:.1f}" height="{row_h[r] - 4}" '
                       f'fill="#f7f7f7" stroke="#cccccc"/>')
            for i, (kind, m, text) in enumerate(texts[(r, s)]):
                out += _band(xs[s] + PAD, y + PAD + i * LINE_H, col_w[s] - 2 * PAD, kind, m, text, pic)
        y += row_h[r]
    out += _legend(pic, legend_y)
    out += [f'<text x="10" y="{legend_y + 70 + 18 * i}" fill="#c00000">PROBLEM: {_esc(line)}</text>'
            for i, line in enumerate(pic.problems)]
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _band(x, y, w, kind, m, text, pic):
    """One message: a band in its piece's colour, its text, and a square per rank (filled:
    that rank's input is summed into what it carries)."""
    fill = colour(piece_of(m, pic.off)[0], pic.p)
    out = [f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{LINE_H - 2}" fill="{fill}" fill-opacity="0.3" '
           f'stroke="{fill}"/>',
           f'<rect x="{x:.1f}" y="{y}" width="4" height="{LINE_H - 2}" fill="{fill}"/>',
           f'<text x="{x + 8:.1f}" y="{y + 12}"{BOLD if m.op == "+=" else ""}>{_esc(text)}</text>']
    if m.mask is not None:
        sx = x + w - pic.p * (SQ + 1) - 2
        for r in range(pic.p):
            on = m.mask >> r & 1
            out.append(f'<rect x="{sx + r * (SQ + 1):.1f}" y="{y + (LINE_H - 2 - SQ) / 2:.1f}" width="{SQ}" '
                       f'height="{SQ}" fill="{"#333333" if on else "white"}" stroke="#333333" stroke-width="0.6">'
                       f'<title>rank {r}{" summed in" if on else ""}</title></rect>')
    return out


def _legend(pic, y):
    p, off = pic.p, pic.off
    used = sorted({piece_of(m, off)[0] for cell in pic.cells.values() for _, m in cell})
    names = {-1: f"all: the whole array ({pic.n} elements)", -2: "header: dtype and shape (128 B)",
             -3: "other element ranges"}
    items = [(colour(k, p), names[k] if k < 0 else f"p{k}: elements {off[k]}-{off[k + 1] - 1}") for k in used]
    out, x = [], 10
    for fill, label in items:
        if x + 14 + len(label) * CHAR_W > 100 * CHAR_W and x > 10:
            x, y = 10, y + 18
        out += [f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{fill}"/>',
                f'<text x="{x + 16}" y="{y}">{_esc(label)}</text>']
        x += 16 + len(label) * CHAR_W + 18
    out += [f'<text x="10" y="{y + 22 + 18 * i}">{_esc(line)}</text>' for i, line in enumerate(_legend_lines(p))]
    return out


def _legend_lines(p):
    return ["->d sends to rank d, <-s receives from rank s; += added into its own copy (bold), = copied",
            f"squares: ranks 0..{p - 1}, filled when that rank's input is summed into the message "
            f"(decoded from its first and last values)"]


# --- Megatron's MLP ---------------------------------------------------------------------------

def _mlp_cells(pic):
    """(rank, column) -> lines: the span's time, its output shape (forward), its all-reduces."""
    cells = {}
    for (r, i), cell in pic.cells.items():
        name, pas = pic.columns[i]
        lines = [f"{pas[0].upper()} {cell['us']:.0f} us"]
        if pas == "forward" and pic.shapes.get(name):
            lines.append("(" + ",".join(map(str, pic.shapes[name])) + ")")
        for a in cell["comm"]:
            peers = ",".join(str(q) for q in a["peers"])
            lines.append(f"{a['op'].replace('_', '-')} {max(m[3] for m in a['messages'])} B <->{peers}")
        cells[(r, i)] = lines
    return cells


def mlp_text(pic) -> str:
    cells = _mlp_cells(pic)
    heads = [f"{name} {'fwd' if pas == 'forward' else 'bwd'}" for name, pas in pic.columns]
    width = [max([len(h)] + [len(t) for r in range(pic.p) for t in cells.get((r, i), [])]) + 2
             for i, h in enumerate(heads)]
    label = len(f"rank {pic.p - 1}") + 3
    out = [pic.title, "", (" " * label + "".join(h.ljust(w) for h, w in zip(heads, width))).rstrip()]
    for r in range(pic.p):
        rows = max(len(cells.get((r, i), [])) for i in range(len(heads)))
        for k in range(rows):
            out.append(("" if k else f"rank {r}").ljust(label) + "".join(
                (cells.get((r, i), [])[k] if k < len(cells.get((r, i), [])) else "").ljust(w)
                for i, w in enumerate(width)).rstrip())
    out += ["", "F/B forward/backward of the piece (its span's time), (B,T,..) its output's shape on this rank "
                "(4C/tp channels between c_fc and c_proj); f: identity forward, all-reduce backward; "
                "g: all-reduce forward, identity backward"]
    out += [f"PROBLEM: {line}" for line in pic.problems]
    return "\n".join(out)


def mlp_svg(pic) -> str:
    cells = _mlp_cells(pic)
    n = len(pic.columns)
    col_w = [max([len(name), len(pas)] + [len(t) for r in range(pic.p) for t in cells.get((r, i), [])]) * CHAR_W
             + 3 * PAD for i, (name, pas) in enumerate(pic.columns)]
    rows = max([len(c) for c in cells.values()] + [1])
    row_h, left, top = rows * LINE_H + 2 * PAD, 70, 70
    width = max(left + sum(col_w) + 20, 20 + len(pic.title) * CHAR_W * 14 / 12, 20 + 100 * CHAR_W)
    height = top + pic.p * row_h + 70 + 18 * len(pic.problems)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'font-family="DejaVu Sans Mono, monospace" font-size="12">',
           f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
           f'<text x="10" y="22" font-size="14" font-weight="bold">{_esc(pic.title)}</text>']
    xs = [left + sum(col_w[:i]) for i in range(n)]
    for i, (name, pas) in enumerate(pic.columns):
        out.append(f'<text x="{xs[i] + PAD:.1f}" y="{top - 24}" font-weight="bold">{_esc(name)}</text>')
        out.append(f'<text x="{xs[i] + PAD:.1f}" y="{top - 8}" fill="#555555">{pas}</text>')
    for r in range(pic.p):
        y = top + r * row_h
        out.append(f'<text x="10" y="{y + PAD + 13}" font-weight="bold">rank {r}</text>')
        for i, (name, pas) in enumerate(pic.columns):
            fill = F_COLOR if pas == "forward" else B_COLOR
            out.append(f'<rect x="{xs[i] + 2:.1f}" y="{y + 2}" width="{col_w[i] - 4:.1f}" height="{row_h - 4}" '
                       f'fill="{fill}" fill-opacity="0.18" stroke="{fill}"/>')
            for k, line in enumerate(cells.get((r, i), [])):
                comm = "<->" in line
                ty = y + PAD + k * LINE_H
                if comm:
                    out.append(f'<rect x="{xs[i] + PAD - 2:.1f}" y="{ty}" width="{col_w[i] - 2 * PAD + 4:.1f}" '
                               f'height="{LINE_H - 2}" fill="{COMM_COLOR}" fill-opacity="0.45"/>')
                out.append(f'<text x="{xs[i] + PAD:.1f}" y="{ty + 12}"{BOLD if comm else ""}>'
                           f'{_esc(line)}</text>')
    y = top + pic.p * row_h + 24
    for k, (fill, label) in enumerate([(F_COLOR, "forward span"), (B_COLOR, "backward span"),
                                       (COMM_COLOR, "an all-reduce inside it (bytes of the array, peers)")]):
        out += [f'<rect x="{10 + k * 190}" y="{y - 10}" width="12" height="12" fill="{fill}"/>',
                f'<text x="{26 + k * 190}" y="{y}">{_esc(label)}</text>']
    out.append(f'<text x="10" y="{y + 22}">f = copy_to_tp: identity forward, all-reduce backward;  '
               f'g = reduce_from_tp: all-reduce forward, identity backward</text>')
    out += [f'<text x="10" y="{y + 44 + 18 * i}" fill="#c00000">PROBLEM: {_esc(line)}</text>'
            for i, line in enumerate(pic.problems)]
    out.append("</svg>")
    return "\n".join(out) + "\n"


# --- 1F1B ---------------------------------------------------------------------------------------

def pipeline_text(tl) -> str:
    out = [tl["title"], "", ascii_gantt(tl["timeline"], tl["n_stages"], width=100),
           "idle per stage: " + ", ".join(f"{b:.3f}" for b in tl["bubble_per_stage"]), "",
           "the same schedule simulated (schedules.check: F 1 unit, B 2, messages free):",
           ascii_gantt(tl["simulated"], tl["n_stages"], width=100), "",
           f"each stage's instructions (schedules.schedule('{tl['schedule'] or '1f1b'}', stage, "
           f"{tl['n_stages']}, {tl['micro_batches']})):"]
    for s, phases in enumerate(tl["stages"]):
        for name, ins in phases:
            words = [str(i) for i in ins] or ["(none)"]
            line = f"  stage {s} {name + ':':<10}"
            for w in words:
                if len(line) + len(w) > 110:
                    out.append(line)
                    line = " " * 20
                line += " " + w
            out.append(line)
    out.append("F forward, B backward, digits the micro-batch, '.' idle: the bubble")
    return "\n".join(out)


def pipeline_svg(tl) -> str:
    return timeline_svg(tl["timeline"], tl["n_stages"], title=tl["title"])


# --- PNG ------------------------------------------------------------------------------------------

def write_png(svg: str, path: str) -> str | None:
    """The SVG rendered to `path` by resvg_py; None (nothing written) when it is not installed."""
    try:
        import resvg_py                                                 # noqa: PLC0415
    except ImportError:
        return None
    data = resvg_py.svg_to_bytes(svg_string=svg)
    with open(path, "wb") as f:
        f.write(bytes(data))
    return os.path.abspath(path)
