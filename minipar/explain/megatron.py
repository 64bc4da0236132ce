"""Megatron's MLP in python -m minipar.explain (megatron-mlp, tp 2; P must divide the hidden
width 4C): the run, what its trace says, and the drawing.

The run: f -> c_fc -> gelu -> c_proj -> g (+ bias) on each rank's shard of the hidden width,
one layer span each, then the backward of a scalar loss; checked against the unsharded MLP.
The trace gives each rank's layer spans, forward then backward, and the all-reduces inside
each: Megatron's g in forward, its f in backward. The drawing is a column per span, its time,
its output's shape and its all-reduces.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minipar.show.draw import _esc
from minipar.explain.common import BOLD, CHAR_W, LINE_H, PAD, WHATS, ExplainError, svg_end


MLP_SHAPE = (2, 3, 4)           # megatron-mlp: B, T, C (the hidden width is 4C)
F_COLOR, B_COLOR, COMM_COLOR = "#4c78a8", "#54a24b", "#f58518"


# --- the worker (under mpirun) --------------------------------------------------------------------
def work_mlp(group, path: str):
    """f -> c_fc -> gelu -> c_proj -> g (+ bias) on this rank's shard, one layer span each,
    then the backward of a scalar loss; checked against the unsharded MLP."""
    from minipar.autograd import ops                                      # noqa: PLC0415
    from minipar import trace
    from minipar.show import tracing                                  # noqa: PLC0415
    from minipar.parallel.tensor import tensor_parallel as tp                  # noqa: PLC0415
    from minipar.autograd.tensor import Tensor                                   # noqa: PLC0415
    p, r = group.size, group.rank
    B, T, C = MLP_SHAPE
    rng = np.random.default_rng(0)                                      # the same on every rank
    x0, w_fc, b_fc = rng.standard_normal((B, T, C)), rng.standard_normal((C, 4 * C)), rng.standard_normal(4 * C)
    w_proj, b_proj, probe = rng.standard_normal((4 * C, C)), rng.standard_normal(C), rng.standard_normal((B, T, C))
    cols = slice(r * 4 * C // p, (r + 1) * 4 * C // p)                  # this rank's 4C/tp channels

    def mlp(x, wf, bf, wp, bp, group, shapes):
        layers = [("f", lambda h: tp.copy_to_tp(h, group) if group else h),   # Megatron's f
                  ("c_fc", lambda h: ops.linear(h, wf, bf)),                    # (B, T, 4C/tp)
                  ("gelu", ops.gelu),
                  ("c_proj", lambda h: ops.linear(h, wp)),                      # (B, T, C), partial sums
                  ("g", lambda h: tp.reduce_from_tp(h, group) if group else h),  # Megatron's g
                  ("bias", lambda h: h + bp),                                   # once, after the sum
                  ("loss", lambda h: ops.sum(ops.mul(h, Tensor(probe)))), ]
        h = x
        for name, fn in layers:
            with trace.layer(name):
                h = fn(h)
            shapes[name] = list(h.shape)
        return h

    params = [Tensor(a.copy(), requires_grad=True) for a in (x0, w_fc[:, cols], b_fc[cols], w_proj[cols, :], b_proj)]
    shapes = {}
    tracing.start(group, f"rank {r} dp0 tp{r} pp0", peek=True)
    loss = mlp(*params, group, shapes)
    loss.backward()
    tracing.finish(group, path, {"what": "megatron-mlp", "B": B, "T": T, "C": C, "shapes": shapes})
    ref = [Tensor(a.copy(), requires_grad=True) for a in (x0, w_fc, b_fc, w_proj, b_proj)]
    ref_loss = mlp(*ref, None, {})
    ref_loss.backward()
    want = [ref_loss.data, ref[0].grad, ref[1].grad[:, cols], ref[2].grad[cols], ref[3].grad[cols, :], ref[4].grad]
    have = [loss.data] + [q.grad for q in params]
    for name, got, w in zip(("loss", "dx", "dw_fc", "db_fc", "dw_proj", "db_proj"), have, want):
        if not np.allclose(got, w, rtol=1e-12, atol=1e-12):
            raise ExplainError(f"rank {r}: megatron-mlp {name} differs from the unsharded MLP's by "
                               f"{np.abs(got - w).max():.3g}")


# --- Megatron's MLP: spans per layer, and where its two all-reduces happen -------------------------

@dataclass
class MLPPicture:
    p: int
    columns: list               # the layer spans in time order: ("c_fc", "forward"), ...
    cells: dict                 # (rank, column index) -> {"us": duration, "comm": [comm span args]}
    shapes: dict                # layer -> its forward output's shape on rank 0
    title: str
    problems: list


def mlp_picture(trace: dict) -> MLPPicture:
    """Each rank's layer spans, forward then backward, and the all-reduces inside each."""
    from minipar.show import traceview                                       # noqa: PLC0415
    meta = trace["otherData"]["minipar"]
    p, problems, cells, columns = meta["world"], [], {}, None
    for r in range(p):
        layers = sorted(traceview.spans(trace, "layer", r), key=lambda e: e["ts"])
        mine = [(e["args"]["layer"], e["args"]["pass"]) for e in layers]
        if columns is None:
            columns = mine
        elif mine != columns:
            problems.append(f"rank {r} ran the layers {mine}, rank 0 {columns}")
            continue
        for i, e in enumerate(layers):
            cells[(r, i)] = {"us": e["dur"], "comm": []}
        for c in traceview.spans(trace, "comm", r):
            inside = [i for i, e in enumerate(layers) if e["ts"] - 0.01 <= c["ts"] and c["end"] <= e["end"] + 0.01]
            if not inside:
                problems.append(f"rank {r}: a {c['args']['op']} at {c['ts']:.1f} us outside every layer")
                continue
            cells[(r, inside[-1])]["comm"].append(c["args"])
    calls = [(columns[i], a) for (r, i), cell in sorted(cells.items()) if r == 0 for a in cell["comm"]]
    where = ", ".join(f"{a['op'].replace('_', '-')} of {max(m[3] for m in a['messages'])} B in {name} {pas}"
                      for (name, pas), a in calls)
    B, T, C = meta["B"], meta["T"], meta["C"]
    head = f"{WHATS['megatron-mlp'].title}, tp={p}, B={B} T={T} C={C} float64: {len(calls)} all-reduces: {where}"
    return MLPPicture(p, columns or [], cells, meta["shapes"], head, problems)


# --- the drawing ----------------------------------------------------------------------------------
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
    return svg_end(out, y + 44, pic.problems)
