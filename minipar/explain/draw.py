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

import numpy as np

from minipar.show.draw import _esc, ascii_gantt, timeline_svg
from minipar.explain.read import MOE_MARK, RING_MARK, piece_of, ranks_text

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


# --- ring attention ------------------------------------------------------------------------------
# Three panels from one RingPicture (explain_read.ring_picture): (a) which chunks each rank keeps,
# zig-zag beside contiguous; (b) the causal score matrix in c x c sub-blocks, each labelled with
# the rank that computes it and the ring step; (c) the ring per step, one arrow per message.

SKIPPED, MASKED = "#eeeeee", "#d0d0d0"
NODE_R = 13


def block_name(m) -> str:
    """"K,V[3]": what a ring message carries, and whose block ("*": derived, not read)."""
    return f"{m.carries}[{'?' if m.owner is None else m.owner}]{'' if m.read else '*'}"


def ring_caption(pic) -> list[str]:
    """What the picture reads from the trace and what it derives."""
    return [
        "Read from the trace: each message's sender, receiver, bytes (payload + the 128 B header) and order; "
        "the pass, from the layer span that holds it.",
        f"K,V[o]: rank o's keys and values, decoded from the message's first and last values "
        f"(k[0,0,i,0] = v[B-1,H-1,i,hs-1] = (i+1)/{RING_MARK} marks position i); K,V,dK,dV[o]: from its first value "
        f"(its last is a dV).",
        "* derived, not read: a dK,dV message carries gradients only; the block it takes home is the one its "
        "sender held at the last step (step order), and its receiver must own it (checked).",
        "(b) is derived: the block in hand at each step (read as above) against the rank's own two chunks, the "
        "sub-blocks whose keys all follow their queries skipped (ring_attention.sub_blocks);",
        "its counts are checked against ring_attention.blocks() and each rank's BLOCKS counter. Backward "
        "computes the same sub-blocks at the same steps.",
    ]


def _split_lines(pic) -> list[str]:
    from minipar.explain.read import chunks_of                         # noqa: PLC0415
    C, T = pic.C, pic.T
    out = []
    for layout in ("zigzag", "contiguous"):
        owner = {ch: r for r in range(C) for ch in chunks_of(r, C, T, layout)}
        pairs, blocks = pic.balance[layout]
        out.append(f"  {layout:<11}" + " ".join(f"r{owner[ch]}" for ch in range(2 * C))
                   + f"   pairs {' '.join(map(str, pairs))}, sub-blocks {' '.join(map(str, blocks))}")
    return out


def ring_text(pic) -> str:
    """The terminal version: the split, the score matrix, each step's messages."""
    C = pic.C
    out = [pic.title, "", f"(a) the sequence in {2 * C} chunks: the rank that keeps each", *_split_lines(pic), "",
           "(b) sub-block (query chunk, key chunk): rNsJ computed by rank N at ring step J; . skipped"]
    out.append("      " + " ".join(f"k{b:<4}" for b in range(2 * C)))
    for a in range(2 * C):
        cells = [f"r{pic.cells[(a, b)][0]}s{pic.cells[(a, b)][1]}" if (a, b) in pic.cells else "."
                 for b in range(2 * C)]
        out.append(f"  q{a:<3}" + " ".join(f"{c:<5}" for c in cells))
    for name, counts in pic.blocks.items():
        out.append(f"  sub-blocks per rank, {name}: {' '.join(map(str, counts))}")
    out += ["", "(c) the ring: at step j rank r sends the block of rank r-j to rank r+1"]
    for m in pic.messages:
        out.append(f"  {m.pas:<8} step {m.step}: {m.src} -> {m.dst} {block_name(m):<16} {m.nbytes} B")
    out += ["", *ring_caption(pic)]
    out += [f"PROBLEM: {line}" for line in pic.problems]
    return "\n".join(out)


def _text(x, y, text, extra=""):
    return f'<text x="{x:.1f}" y="{y:.1f}"{extra}>{_esc(text)}</text>'


def _split_svg(pic, x0, y0):
    """(a): two bars of 2C chunks, coloured by the rank that keeps each. -> (svg, bottom y)."""
    from minipar.explain.read import chunks_of                         # noqa: PLC0415
    C, T = pic.C, pic.T
    cw, h = (44 if C <= 4 else 34), 24
    out = [_text(10, y0, f"(a) the split: T = {T} tokens in 2C = {2 * C} chunks of c = {T // (2 * C)}; "
                         f"rank i keeps chunks i and 2C-1-i (zig-zag), or 2i and 2i+1 (contiguous)", BOLD)]
    y = y0 + 26
    out += [_text(x0 + ch * cw + cw / 2, y, str(ch), ' text-anchor="middle" fill="#555555"') for ch in range(2 * C)]
    for i, layout in enumerate(("zigzag", "contiguous")):
        top = y + 8 + i * (h + 10)
        owner = {ch: r for r in range(C) for ch in chunks_of(r, C, T, layout)}
        out.append(_text(10, top + 16, "zig-zag" if layout == "zigzag" else layout,
                         BOLD if layout == pic.layout else ""))
        for ch in range(2 * C):
            fill = colour(owner[ch], C)
            out += [f'<rect x="{x0 + ch * cw:.1f}" y="{top}" width="{cw - 2}" height="{h}" fill="{fill}" '
                    f'fill-opacity="0.55" stroke="{fill}"/>',
                    _text(x0 + ch * cw + cw / 2 - 1, top + 16, f"r{owner[ch]}", ' text-anchor="middle"')]
        pairs, blocks = pic.balance[layout]
        out.append(_text(x0 + 2 * C * cw + 14, top + 16, f"(query, key) pairs per rank {' '.join(map(str, pairs))}; "
                                                         f"sub-blocks {' '.join(map(str, blocks))}"))
    return out, y + 8 + 2 * (h + 10)


def _matrix_svg(pic, x0, y0):
    """(b): the 2C x 2C causal score matrix in sub-blocks, rank and step in each. -> (svg, width, bottom)."""
    from minipar.explain.read import chunks_of                         # noqa: PLC0415
    C = pic.C
    s = 40 if C <= 4 else 32
    owner = {ch: r for r in range(C) for ch in chunks_of(r, C, pic.T, pic.layout)}
    out = [_text(10, y0, "(b) the causal scores in c x c sub-blocks: the rank that computes each (colour, rN) "
                         "and the ring step (sJ)", BOLD)]
    top, left = y0 + 34, x0 + 36
    out.append(_text(left, top - 20, "key chunk", ' fill="#555555"'))
    for b in range(2 * C):
        out.append(_text(left + b * s + s / 2, top - 5, f"k{b}", ' text-anchor="middle" font-size="11"'))
    for a in range(2 * C):
        y = top + a * s
        out.append(_text(left - 6, y + s / 2 + 4, f"q{a} r{owner[a]}",
                         f' text-anchor="end" font-size="11" fill="{colour(owner[a], C)}"' + BOLD))
        for b in range(2 * C):
            out += _cell_svg(pic, left + b * s, y, s, a, b)
    width = left + 2 * C * s - x0
    return out, width, top + 2 * C * s


def _cell_svg(pic, x, y, s, a, b):
    if (a, b) not in pic.cells:
        return [f'<rect x="{x:.1f}" y="{y:.1f}" width="{s - 1}" height="{s - 1}" fill="{SKIPPED}">'
                f'<title>q{a} x k{b}: skipped (every key after every query)</title></rect>']
    r, j = pic.cells[(a, b)]
    fill = colour(r, pic.C)
    out = [f'<rect x="{x:.1f}" y="{y:.1f}" width="{s - 1}" height="{s - 1}" fill="{fill}" fill-opacity="0.45">'
           f'<title>q{a} x k{b}: rank {r}, step {j}</title></rect>']
    if (a, b) in pic.masked:                    # a chunk against itself: the upper triangle masked
        out.append(f'<polygon points="{x + 1:.1f},{y:.1f} {x + s - 1:.1f},{y:.1f} {x + s - 1:.1f},{y + s - 2:.1f}" '
                   f'fill="{MASKED}"/>')
    out += [_text(x + 3, y + s / 2, f"r{r}", ' font-size="11" font-weight="bold"'),
            _text(x + 3, y + s / 2 + 12, f"s{j}", ' font-size="11"')]
    return out


def _tally_svg(pic, x, y):
    """Beside (b): each rank's sub-blocks per step, and the three counts that must agree.
    -> (svg, bottom y)."""
    C = pic.C
    out = [_text(x, y - 20, "at step j rank r holds the K, V of rank r-j mod C"),
           _text(x, y, "sub-blocks each rank computes, by step", BOLD)]
    for r in range(C):
        per = [sum(1 for cell in pic.cells.values() if cell == (r, j)) for j in range(C)]
        out.append(_text(x, y + 20 * (r + 1), f"rank {r}: " + " + ".join(f"{k} (s{j})" for j, k in enumerate(per))
                         + f" = {sum(per)}", f' fill="{colour(r, C)}"' + BOLD))
    y += 20 * (C + 1) + 8
    for i, (name, counts) in enumerate(pic.blocks.items()):
        what = {"picture": "in this picture", "formula": "ring_attention.blocks()",
                "measured forward": "counted in forward (BLOCKS)",
                "measured backward": "counted in backward (BLOCKS)"}[name]
        out.append(_text(x, y + 18 * i, f"{what}: {' '.join(map(str, counts))}"))
    y += 18 * len(pic.blocks) + 10
    out += [f'<rect x="{x}" y="{y - 10}" width="12" height="12" fill="{SKIPPED}" stroke="#bbbbbb"/>',
            _text(x + 18, y, "skipped: every key comes after every query"),
            f'<polygon points="{x},{y + 8} {x + 12},{y + 8} {x + 12},{y + 20}" fill="{MASKED}"/>',
            _text(x + 18, y + 20, "masked half of a chunk against itself")]
    return out, y + 24


def _arrow(cx, cy, R, t0, t1, fill, label, anchor_out=16):
    """An arc of the ring from angle t0 to t1 (radians, clockwise on screen), an arrowhead at
    its end, and a two-line label outside its middle."""
    import math                                                         # noqa: PLC0415
    x0, y0 = cx + R * math.cos(t0), cy + R * math.sin(t0)
    x1, y1 = cx + R * math.cos(t1), cy + R * math.sin(t1)
    large = 1 if (t1 - t0) % (2 * math.pi) > math.pi else 0
    tx, ty = -math.sin(t1), math.cos(t1)                              # the tangent, clockwise
    nx, ny = math.cos(t1), math.sin(t1)
    head = [(x1 + 1.5 * tx, y1 + 1.5 * ty), (x1 - 9 * tx + 4.5 * nx, y1 - 9 * ty + 4.5 * ny),
            (x1 - 9 * tx - 4.5 * nx, y1 - 9 * ty - 4.5 * ny)]
    out = [f'<path d="M {x0:.1f} {y0:.1f} A {R} {R} 0 {large} 1 {x1:.1f} {y1:.1f}" fill="none" stroke="{fill}" '
           f'stroke-width="2.5"/>',
           '<polygon points="' + " ".join(f"{px:.1f},{py:.1f}" for px, py in head) + f'" fill="{fill}"/>']
    mid = (t0 + t1) / 2 if t1 > t0 else (t0 + t1 + 2 * math.pi) / 2
    lx, ly = cx + (R + anchor_out) * math.cos(mid), cy + (R + anchor_out) * math.sin(mid)
    anchor = "start" if math.cos(mid) > 0.3 else "end" if math.cos(mid) < -0.3 else "middle"
    dy = -6 if math.sin(mid) < -0.3 else 10 if math.sin(mid) > 0.3 else 2
    for k, line in enumerate(label):
        out.append(_text(lx, ly + dy + 12 * k - 6, line, f' text-anchor="{anchor}" font-size="11"'
                         + (BOLD if k == 0 else "")))
    return out


def _ring_step_svg(pic, pas, j, cx, cy, R):
    """One step of one pass: the C ranks on a circle, one arrow per message sent."""
    import math                                                         # noqa: PLC0415
    C = pic.C
    angle = [-math.pi / 2 + 2 * math.pi * r / C for r in range(C)]
    gap = (NODE_R + 5) / R
    out = [f'<circle cx="{cx}" cy="{cy}" r="{R}" fill="none" stroke="#e4e4e4"/>',
           _text(cx, cy + 5, f"step {j}", ' text-anchor="middle" fill="#555555" font-size="13"')]
    for m in (m for m in pic.messages if m.pas == pas and m.step == j):
        t0, t1 = angle[m.src] + gap, angle[m.dst] - gap
        if m.dst != (m.src + 1) % C:                                    # off the ring: a straight line
            t1 = t0 + 0.5
        fill = colour(m.owner, C) if m.owner is not None else RANGE
        out += _arrow(cx, cy, R, t0, t1 if t1 > t0 else t1 + 2 * math.pi, fill, [block_name(m), f"{m.nbytes} B"])
    for r in range(C):
        x, y = cx + R * math.cos(angle[r]), cy + R * math.sin(angle[r])
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{NODE_R}" fill="white" stroke="{colour(r, C)}" '
                f'stroke-width="3"/>',
                _text(x, y + 4, f"{r}", ' text-anchor="middle" font-weight="bold"')]
    return out


def _ring_svg(pic, y0, per_row, cell_w, R):
    """(c): every step of forward, then of backward, a ring each, per_row to a row. -> (svg, bottom)."""
    out = [_text(10, y0, "(c) the ring as the trace recorded it: at step j rank r sends the block of rank r-j "
                         "to rank r+1 (arrow colour: whose block; ranks 0..C-1 clockwise from the top)", BOLD)]
    y = y0 + 20
    for pas in ("forward", "backward"):
        steps = sorted({m.step for m in pic.messages if m.pas == pas})
        rows = [steps[i:i + per_row] for i in range(0, len(steps), per_row)] or [[]]
        what = ("K,V of rank r-j (C-1 steps; the last step computes with what step C-2 brought)"
                if pas == "forward" else "K,V,dK,dV of rank r-j, then at step C-1 dK,dV home")
        out.append(_text(10, y + 16, f"{pas}: {what}"))
        y += 24
        for row in rows:
            for i, j in enumerate(row):
                out += _ring_step_svg(pic, pas, j, 10 + cell_w * i + cell_w / 2, y + R + 34, R)
            y += 2 * R + 76
    return out, y


def ring_svg(pic) -> str:
    """The three panels, the caption, and any problem in red."""
    C = pic.C
    R = 58 if C <= 4 else 84
    cell_w = 2 * R + 190
    per_row = min(C, 4)
    out, y = _split_svg(pic, 110, 52)
    matrix, mw, bottom = _matrix_svg(pic, 40, y + 24)
    tally, tally_bottom = _tally_svg(pic, 40 + mw + 50, y + 70)
    out += matrix + tally
    tally_w = 40 + mw + 50 + 62 * CHAR_W
    rings, y = _ring_svg(pic, max(bottom, tally_bottom) + 34, per_row, cell_w, R)
    out += rings
    caption = ring_caption(pic)
    width = max(20 + per_row * cell_w, tally_w, 20 + len(pic.title) * CHAR_W * 14 / 12,
                20 + max(map(len, caption)) * CHAR_W)
    out += [_text(10, y + 18 * i, line) for i, line in enumerate(caption)]
    y += 18 * len(caption) + 8
    out += [_text(10, y + 18 * i, f"PROBLEM: {line}", ' fill="#c00000"') for i, line in enumerate(pic.problems)]
    height = y + 18 * len(pic.problems) + 10
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'font-family="DejaVu Sans Mono, monospace" font-size="12">',
            f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
            f'<text x="10" y="22" font-size="14" font-weight="bold">{_esc(pic.title)}</text>']
    return "\n".join(head + out + ["</svg>"]) + "\n"


# --- mixture of experts ------------------------------------------------------------------------
# Six panels from one MoEPicture (explain_read.moe_picture), top to bottom: (a) the router on each
# rank: every token's K experts, weights and slots, the dropped assignments crossed out; (b) the
# dispatch all-to-all, a cell per (sender, receiver): the rows it carries, expert by expert; (c) the
# rows each expert runs on; (d) the combine all-to-all back; (e) each token's weighted sum; (f) the
# bytes of the all-to-alls on every rank against ep_bytes. Colour: the rank (an expert's: its owner's).

DROPPED = "#9a9a9a"


def tok(t) -> str:
    """"t5", or "·" for an empty capacity slot."""
    return "·" if t is None else f"t{t}"


def moe_choice(pic, r: int, n: int, k: int) -> str:
    """"e2 0.61 #0": rank r's token n's k-th choice, its weight and its slot in the expert (the
    claim order), or "dropped"."""
    route = pic.routing[r]
    e, w, slot = int(route["choice"][n, k]), route["weights"][n, k], int(route["slot"][n, k])
    return f"e{e} {w:.2f} " + (f"#{slot}" if slot >= 0 else "dropped")


def moe_load(pic, r: int) -> tuple[str, str]:
    """("load e0 2, e1 5, e2 3, e3 2", "capacity 4: 1 dropped"): rank r's assignments per expert
    before dropping, and how many found their expert full."""
    route = pic.routing[r]
    load = np.bincount(route["choice"].ravel(), minlength=pic.E)
    dropped = int((~route["kept"]).sum())
    return (f"load {', '.join(f'e{e} {n}' for e, n in enumerate(load))}",
            f"capacity {pic.cap}: {dropped} dropped" if pic.cap else "no capacity: none dropped")


def moe_rows_text(pic, src: int, dst: int) -> list[str]:
    """One line per expert of rank dst: "e2 [t1 t4 · ·]", the rows src dispatches to it, in slot order."""
    return [f"e{dst * pic.per_rank + i} [{' '.join(tok(t) for t in ts)}]" for i, ts in enumerate(pic.rows[(src, dst)])]


def moe_message_text(pic, call: str, src: int, dst: int) -> str:
    """"128 B, read t2..·": a data message's bytes in the trace and, for the dispatch, the tokens its
    first and last values name; "*": its rows derived, not read."""
    if src == dst:
        return "stays on the rank (no message)"
    n = pic.sent.get((call, src, dst))
    if n is None:
        return "no rows, no message"
    n = f"{n} B" if pic.cap else f"{n} B (+ 8 B count)"
    if call != "dispatch":
        return f"{n} *"
    ends = pic.ends.get((src, dst))
    return n + (f", read {tok(ends[0])}..{tok(ends[1])}" if ends else ", ends not read")


def moe_expert_parts(pic, e: int) -> list[tuple[int, str]]:
    """[(source rank, "r0 [t2 t3 ·]")]: the rows expert e runs on, from each rank in rank order."""
    owner, i = divmod(e, pic.per_rank)
    return [(src, f"r{src} [{' '.join(tok(t) for t in pic.rows[(src, owner)][i])}]") for src in range(pic.P)]


def moe_expert_tail(pic, e: int) -> str:
    owner, i = divmod(e, pic.per_rank)
    rows = [t for src in range(pic.P) for t in pic.rows[(src, owner)][i]]
    real = sum(t is not None for t in rows)
    empty = f", {len(rows) - real} empty slots: zero rows, computed, then unused" if len(rows) > real else ""
    return f"= {len(rows)} rows ({real} tokens{empty}) -> MLP e{e} -> {len(rows)} rows"


def moe_sum(pic, r: int, n: int) -> str:
    """"y5 = 0.61 E2(x5) + 0.39 E0(x5)": the layer's output for rank r's token n, the sum over its kept
    choices; a dropped choice adds nothing (and the others are not renormalised)."""
    route, i = pic.routing[r], r * pic.N + n
    kept = [f"{route['weights'][n, k]:.2f} E{route['choice'][n, k]}(x{i})" for k in range(pic.K) if route["kept"][n, k]]
    lost = [f"e{route['choice'][n, k]}" for k in range(pic.K) if not route["kept"][n, k]]
    return f"y{i} = " + (" + ".join(kept) or "0") + (f"   ({', '.join(lost)} dropped)" if lost else "")


def moe_bytes_rows(pic) -> list[list[str]]:
    """(f) as a table: a header, then a row per rank."""
    head = ["rank", *pic.calls, "total", "ep_bytes", "layer counted"]
    return [head] + [[f"rank {r}"] + [str(b[c]) for c in pic.calls] + [str(b["total"]), str(b["ep_bytes"]),
                                                                       str(b["counted"])]
                     for r, b in sorted(pic.bytes.items())]


def moe_formula(pic) -> list[str]:
    """ep_bytes written out for this run (expert_parallel.py's docstring); the numbers are
    expert_parallel.ep_bytes's, in the table."""
    P, E, C, El = pic.P, pic.E, pic.C, pic.per_rank
    if pic.cap:
        return [f"ep_bytes with a capacity: 4 all-to-alls x (P-1)/P x E cap rows x C x 8 B = "
                f"4 x {P - 1}/{P} x {E * pic.cap} x {C} x 8 B, the same on every rank"]
    out = ["ep_bytes without one: 2 x (rows sent to other ranks + rows received from them) x C x 8 B "
           "+ 4 x 8 (P-1) B of row counts + 8 (P-1) E/P B (each expert's rows by source):"]
    for r in range(P):
        sent = sum(len(pic.flat(r, j)) for j in range(P) if j != r)
        got = sum(len(pic.flat(j, r)) for j in range(P) if j != r)
        out.append(f"  rank {r}: 2 x ({sent} + {got}) x {C} x 8 + 4 x 8 x {P - 1} + 8 x {P - 1} x {El} "
                   f"= {pic.bytes[r]['ep_bytes']} B")
    return out


def moe_caption(pic) -> list[str]:
    return [
        "Read from the trace: every all-to-all's messages (peer, bytes) in each rank's order: dispatch, "
        + ("counts, " if not pic.cap else "") + "combine, then in backward combine's (dy to the experts) "
        "and dispatch's (dx home).",
        f"read t2..t9: the tokens a dispatch message's first and last values name (x[i,0] = x[i,C-1] = "
        f"(i+1)/{MOE_MARK} marks token i; 0 an empty slot).",
        "From the run (the trace's metadata): each token's experts, weights and kept flags (moe.Router); "
        "the kept ones checked against the claim order (moe.claim_slots).",
        "Derived: the rows of each message, expert-major in slot order (moe.assignments), "
        + ("padded to the capacity; " if pic.cap else "") + "checked against the bytes and the ends read. "
        "* the same rows back the other way.",
    ]


def moe_text(pic) -> str:
    """The terminal version of the six panels."""
    P, N, K = pic.P, pic.N, pic.K
    out = [pic.title, "", "(a) the router on each rank: each token's experts, weight and slot (#: the claim order)"]
    for r in range(P):
        experts = ", ".join(f"e{e}" for e in range(r * pic.per_rank, (r + 1) * pic.per_rank))
        out.append(f"  rank {r} (experts {experts}): {'; '.join(moe_load(pic, r))}")
        out += [f"    t{r * N + n:<4}" + "   ".join(f"{moe_choice(pic, r, n, k):<15}" for k in range(K)).rstrip()
                for n in range(N)]
    for call, name in (("dispatch", "(b) dispatch: the rows rank r sends to the rank of their expert"),
                       ("combine", "(d) combine: the expert outputs back to the ranks the rows came from")):
        out += ["", name]
        for frm in range(P):
            for to in range(P):
                rows = moe_rows_text(pic, frm, to) if call == "dispatch" else \
                    [f"E{t[1:]}" for t in moe_rows_text(pic, to, frm)]
                out.append(f"  {frm} -> {to}: {' '.join(rows):<40} {moe_message_text(pic, call, frm, to)}")
        if call == "dispatch":
            out += ["", "(c) each expert runs on the rows it received, in source order"]
            out += [f"  e{e}: " + " ".join(t for _, t in moe_expert_parts(pic, e)) + " " + moe_expert_tail(pic, e)
                    for e in range(pic.E)]
    out += ["", "(e) each token's output: the weighted sum of its kept experts' outputs"]
    out += [f"  {moe_sum(pic, r, n)}" for r in range(P) for n in range(N)]
    out += ["", "(f) bytes each rank sent, from the trace"]
    table = moe_bytes_rows(pic)
    width = [max(len(row[i]) for row in table) + 2 for i in range(len(table[0]))]
    out += ["  " + "".join(c.ljust(w) for c, w in zip(row, width)).rstrip() for row in table]
    out += [f"  {line}" for line in moe_formula(pic)] + ["", *moe_caption(pic)]
    out += [f"PROBLEM: {line}" for line in pic.problems]
    return "\n".join(out)


def _moe_box(x, y, w, text, fill, dropped=False):
    """A box of text in a rank's colour; a dropped assignment: dashed, grey, crossed out."""
    if dropped:
        return [f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{LINE_H - 2}" fill="white" stroke="{DROPPED}" '
                f'stroke-dasharray="3,2"/>',
                _text(x + 4, y + 12, text, f' fill="{DROPPED}"'),
                f'<line x1="{x + 2:.1f}" y1="{y + 8}" x2="{x + w - 2:.1f}" y2="{y + 8}" stroke="{DROPPED}"/>']
    return [f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{LINE_H - 2}" fill="{fill}" fill-opacity="0.3" '
            f'stroke="{fill}"/>', _text(x + 4, y + 12, text)]


MOE_BOX = 16 * CHAR_W                                           # (a): one choice


def _moe_column(pic) -> float:
    """The width of a rank's column in (a) and (e): the token, its K choices."""
    return 6 * CHAR_W + pic.K * (MOE_BOX + 6) + 24


def _moe_router_svg(pic, y0):
    """(a): a column per rank, a line per token with its K choices. -> (svg, width, bottom y)."""
    P, N, K = pic.P, pic.N, pic.K
    box, col = MOE_BOX, _moe_column(pic)
    title = ["(a) the router on each rank: each token's K experts (colour: the rank that holds it), their "
             "renormalised weights,", "and the slot each takes in its expert (#): every first choice in token "
             "order, then every second choice, ..."]
    out = [_text(10, y0 + 16 * i, line, BOLD) for i, line in enumerate(title)]
    y = y0 + 40
    for r in range(P):
        x = 10 + r * col
        experts = ", ".join(f"e{e}" for e in range(r * pic.per_rank, (r + 1) * pic.per_rank))
        out.append(_text(x, y, f"rank {r} (holds {experts})", f' fill="{colour(r, P)}"' + BOLD))
        for n in range(N):
            ty = y + 8 + n * LINE_H
            out.append(_text(x, ty + 12, f"t{r * N + n}"))
            for k in range(K):
                e, slot = int(pic.routing[r]["choice"][n, k]), int(pic.routing[r]["slot"][n, k])
                out += _moe_box(x + 6 * CHAR_W + k * (box + 6), ty, box, moe_choice(pic, r, n, k),
                                colour(e // pic.per_rank, P), dropped=slot < 0)
        out += [_text(x, y + 8 + N * LINE_H + 14 + 14 * i, line, ' font-size="11"')
                for i, line in enumerate(moe_load(pic, r))]
    return out, max(10 + P * col, 20 + max(map(len, title)) * CHAR_W), y + 8 + N * LINE_H + 38


def _moe_matrix_svg(pic, call, y0):
    """(b) or (d): a P x P grid of messages, senders down, receivers across. -> (svg, width, bottom)."""
    P = pic.P
    to_experts = call == "dispatch"
    title = ("(b) dispatch, all-to-all: row r sends each expert's rows to the rank that holds it "
             "(colour: the receiver); the diagonal stays home" if to_experts else
             "(d) combine, all-to-all: the expert outputs go back to the rank each row came from "
             "(colour: the sender); * rows derived")
    cells = {}
    for frm in range(P):
        for to in range(P):
            rows = moe_rows_text(pic, frm, to) if to_experts else [f"E{t[1:]}" for t in moe_rows_text(pic, to, frm)]
            cells[(frm, to)] = rows + [moe_message_text(pic, call, frm, to)]
    cw = max(len(t) for c in cells.values() for t in c) * CHAR_W + 2 * PAD
    ch = (pic.per_rank + 1) * LINE_H + 2 * PAD
    left, top = 10 + 11 * CHAR_W, y0 + 40
    out = [_text(10, y0, title, BOLD)]
    for to in range(P):
        out.append(_text(left + to * cw + PAD, top - 8, f"to rank {to}", BOLD))
    for frm in range(P):
        y = top + frm * ch
        out.append(_text(10, y + PAD + 12, f"rank {frm}", BOLD))
        for to in range(P):
            x = left + to * cw
            fill = "#eeeeee" if frm == to else colour(to if to_experts else frm, P)
            out.append(f'<rect x="{x + 1:.1f}" y="{y + 1}" width="{cw - 2:.1f}" height="{ch - 2}" fill="{fill}" '
                       f'fill-opacity="{1 if frm == to else 0.22}" stroke="#cccccc"/>')
            out += [_text(x + PAD, y + PAD + 12 + i * LINE_H, t, BOLD if i == len(cells[(frm, to)]) - 1 else "")
                    for i, t in enumerate(cells[(frm, to)])]
    return out, left + P * cw, top + P * ch


def _moe_experts_svg(pic, y0):
    """(c): a line per expert, its rows from each rank in that rank's colour. -> (svg, width, bottom)."""
    out = [_text(10, y0, "(c) each expert runs its MLP on the rows it received, in source-rank order", BOLD)]
    right = 0
    for e in range(pic.E):
        y = y0 + 12 + e * (LINE_H + 4)
        x = 10
        out.append(_text(x, y + 12, f"e{e} on rank {e // pic.per_rank}:", BOLD))
        x += 16 * CHAR_W
        for src, text in moe_expert_parts(pic, e):
            w = len(text) * CHAR_W + 8
            out += _moe_box(x, y, w, text, colour(src, pic.P))
            x += w + 4
        tail = moe_expert_tail(pic, e)
        out.append(_text(x + 4, y + 12, tail))
        right = max(right, x + 4 + len(tail) * CHAR_W)
    return out, right, y0 + 12 + pic.E * (LINE_H + 4) + 8


def _moe_sum_svg(pic, y0, col):
    """(e): each rank's outputs, a line per token. -> (svg, bottom y)."""
    out = [_text(10, y0, "(e) back home, each token's output is the weighted sum of its kept experts' outputs "
                         "(a dropped choice adds nothing; the weights are not renormalised)", BOLD)]
    for r in range(pic.P):
        x = 10 + r * col
        out.append(_text(x, y0 + 22, f"rank {r}", f' fill="{colour(r, pic.P)}"' + BOLD))
        out += [_text(x, y0 + 40 + n * LINE_H, moe_sum(pic, r, n), ' font-size="11"') for n in range(pic.N)]
    return out, y0 + 40 + pic.N * LINE_H


def _moe_bytes_svg(pic, y0):
    """(f): the bytes table and the formula. -> (svg, width, bottom y)."""
    table = moe_bytes_rows(pic)
    width = [max(len(row[i]) for row in table) * CHAR_W + 16 for i in range(len(table[0]))]
    out = [_text(10, y0, "(f) bytes each rank sent in the all-to-alls (from the trace), against "
                         "expert_parallel.ep_bytes and the layer's own count", BOLD)]
    for i, row in enumerate(table):
        y, x = y0 + 22 + i * LINE_H, 10
        for j, cell in enumerate(row):
            out.append(_text(x, y, cell, BOLD if i == 0 or j == 0 else ""))
            x += width[j]
    y = y0 + 22 + len(table) * LINE_H
    formula = moe_formula(pic)
    out += [_text(10, y + i * LINE_H, line) for i, line in enumerate(formula)]
    return out, max([10 + sum(width)] + [20 + len(line) * CHAR_W for line in formula]), y + len(formula) * LINE_H


def moe_svg(pic) -> str:
    """The six panels, the caption, and any problem in red."""
    out, w_a, y = _moe_router_svg(pic, 52)
    widths = [w_a, 20 + len(pic.title) * CHAR_W * 14 / 12]
    for part in ("dispatch", "experts", "combine"):
        svg, w, y = (_moe_experts_svg(pic, y + 16) if part == "experts" else _moe_matrix_svg(pic, part, y + 16))
        out += svg
        widths.append(w)
    svg, y = _moe_sum_svg(pic, y + 24, _moe_column(pic))
    out += svg
    svg, w, y = _moe_bytes_svg(pic, y + 30)
    out += svg
    widths.append(w)
    caption = moe_caption(pic)
    out += [_text(10, y + 18 + 18 * i, line) for i, line in enumerate(caption)]
    y += 18 * len(caption) + 26
    out += [_text(10, y + 18 * i, f"PROBLEM: {line}", ' fill="#c00000"') for i, line in enumerate(pic.problems)]
    height = y + 18 * len(pic.problems) + 10
    width = max(widths + [20 + max(map(len, caption + pic.problems)) * CHAR_W])
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'font-family="DejaVu Sans Mono, monospace" font-size="12">',
            f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
            f'<text x="10" y="22" font-size="14" font-weight="bold">{_esc(pic.title)}</text>']
    return "\n".join(head + out + ["</svg>"]) + "\n"


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
