"""The collectives of python -m minipar.explain (ring-all-reduce, reduce-scatter, all-gather,
recursive-doubling, broadcast, reduce): the run, what its trace says, and the drawing.

The run. Each rank calls the algorithm module itself, not the dispatcher of minipar.comm, so
the algorithm drawn is the one named whatever the size. work is every WHAT's worker: it hands
the other pictures to theirs (megatron.work_mlp, ring_attention.work_ring, moe.work_moe, gqa_tp.work_gqa).

What the trace of an explained run says: which piece each message carried, read from the
values on the wire, and the per-step picture drawn below.

What is drawn comes from the data on the wire, never from the algorithm's formula. The
inputs name their origin: rank r holds x_r[j] = (j+1)*M + 2**r with M = 2**p, so a sum over
a set S of ranks is |S|*(j+1)*M + sum_{r in S} 2**r, and a value v decodes as
    contributors mask = v % M,   |S| = popcount(mask),   element j = (v // M) / |S| - 1
(integers, exact in float64). A message's first and last values give its element range,
hence its piece (np.array_split's: piece_offsets), and its contributors.

How a receive is read. Each receive is matched with its send: between two ranks messages
match in the order they were posted (MPI's non-overtaking rule), and both ends must number
it the same step, or the drawing would split one exchange over two columns (a problem).
The messages are then replayed step by step on every rank's contributor set per element:
a message whose set is disjoint from what the receiver holds was added in (+=); one whose
set contains it replaced it (=); anything else would count a rank twice, a problem. The
replay also checks that every message carries what its sender held, and that each rank ends
with the collective's result. Problems are printed and the exit status is 1. The worker
checks the actual result against NumPy on the gathered inputs besides.

The drawing: one row per rank, one column per step. A cell lists what the rank sends,
"->1 p0 {0}" (to rank 1, piece 0, carrying the inputs of ranks {0}), and what it receives,
"<-3 p3 += {3}" (from rank 3, piece 3, added into its own copy; "=" copied). In the SVG each
message is a band in its piece's colour with one square per rank, filled for the contributors.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

import numpy as np

from minipar.show.draw import _esc
from minipar.explain.common import (BOLD, CHAR_W, LINE_H, PAD, ROOT, SQ, WHATS, ExplainError, Spec,
                                    colour, svg_end)
from minipar.explain.gqa_tp import work_gqa
from minipar.explain.megatron import work_mlp
from minipar.explain.moe import MOE_FACTOR, work_moe
from minipar.explain.ring_attention import work_ring


ENCODING = "x_r[j] = (j+1)*M + 2**r, M = 2**p"


# --- the workers (under mpirun) -------------------------------------------------------------------
def work(what: str, n: int, path: str, factor: float = MOE_FACTOR):
    """One rank's part: run WHAT with the trace on, write the trace (rank 0), check the result."""
    from mpi4py import MPI                                              # noqa: PLC0415
    from minipar import comm                                            # noqa: PLC0415
    from minipar.show import tracing                                  # noqa: PLC0415
    if what == "moe-dispatch":
        return work_moe(comm.Group(MPI.COMM_WORLD, axis="ep"), path, factor)
    if what == "megatron-mlp":
        return work_mlp(comm.Group(MPI.COMM_WORLD, axis="tp"), path)
    if what == "ring-attention":
        return work_ring(comm.Group(MPI.COMM_WORLD, axis="cp"), path)
    if what == "gqa-tp":
        return work_gqa(comm.Group(MPI.COMM_WORLD, axis="tp"), path)
    from minipar.comm.algorithms import doubling, ring, tree                       # noqa: PLC0415
    world = comm.Group(MPI.COMM_WORLD, axis="world")
    p, r = world.size, world.rank
    x = inputs(what, p, n, r)
    run = {"ring-all-reduce": ring.all_reduce, "reduce-scatter": ring.reduce_scatter,
           "all-gather": ring.all_gather, "recursive-doubling": doubling.all_reduce,
           "broadcast": lambda g, v: tree.broadcast(g, v, ROOT),
           "reduce": lambda g, v: tree.reduce(g, v, ROOT)}[what]
    tracing.start(world, f"rank {r}", peek=True)
    out = run(world, x)
    tracing.finish(world, path, {"what": what, "n": n, "root": ROOT, "encoding": ENCODING})
    # the result against NumPy on the gathered inputs (after finish: not in the trace)
    off = piece_offsets(n, p)
    sizes = [off[k + 1] - off[k] for k in range(p)] if what == "all-gather" else [n] * p
    table = comm.all_gather(world, x if x is not None else np.zeros(n), sizes=sizes)
    want = {"ring-all-reduce": lambda: table.reshape(p, n).sum(0),
            "recursive-doubling": lambda: table.reshape(p, n).sum(0),
            "reduce-scatter": lambda: table.reshape(p, n).sum(0)[off[r]:off[r + 1]],
            "all-gather": lambda: table,
            "broadcast": lambda: table.reshape(p, n)[ROOT],
            "reduce": lambda: table.reshape(p, n).sum(0) if r == ROOT else None}[what]()
    if (want is None) != (out is None) or (want is not None and not np.array_equal(out, want)):
        bad = "None" if out is None or want is None else \
            f"element {np.flatnonzero(out != want)[0]}: {out[out != want][0]!r} != {want[out != want][0]!r}"
        raise ExplainError(f"rank {r}: {what} differs from NumPy on the gathered inputs: {bad}")


# --- the data on the wire -------------------------------------------------------------------------
def piece_offsets(n: int, p: int) -> tuple:
    """Where each piece of np.array_split(range(n), p) starts, and n: the pieces the ring
    cuts (comm.helpers.split_offsets, which imports MPI; the launcher never starts MPI)."""
    return tuple(int(k) for k in np.cumsum([0] + [len(a) for a in np.array_split(np.arange(n), p)]))


def inputs(what: str, p: int, n: int, r: int):
    """Rank r's input: x_r[j] = (j+1)*M + 2**r over the elements it starts with (None: none)."""
    x = (np.arange(n) + 1.0) * 2.0 ** p + 2.0 ** r
    if what == "all-gather":
        off = piece_offsets(n, p)
        return x[off[r]:off[r + 1]].copy()                              # piece r, global numbering
    if what == "broadcast" and r != ROOT:
        return None
    return x


def start_state(what: str, p: int, n: int) -> np.ndarray:
    """(p, n) contributor masks: what each rank holds of each element before the first step."""
    state, off = np.zeros((p, n), np.int64), piece_offsets(n, p)
    for r in range(p):
        if what == "all-gather":
            state[r, off[r]:off[r + 1]] = 1 << r
        elif what != "broadcast" or r == ROOT:
            state[r] = 1 << r
    return state


def end_state(what: str, p: int, n: int) -> np.ndarray:
    """(p, n) contributor masks the collective must end with; -1 where anything goes."""
    full, off = (1 << p) - 1, piece_offsets(n, p)
    want = np.full((p, n), -1, np.int64)
    for r in range(p):
        if what in ("ring-all-reduce", "recursive-doubling"):
            want[r] = full
        elif what == "reduce-scatter":
            want[r, off[r]:off[r + 1]] = full
        elif what == "all-gather":
            for k in range(p):
                want[r, off[k]:off[k + 1]] = 1 << k
        elif what == "broadcast":
            want[r] = 1 << ROOT
    if what == "reduce":
        want[ROOT] = full
    return want


def decode(v: float, p: int, n: int) -> tuple[int, int]:
    """A value on the wire -> (contributors mask, element j); ValueError if it is no such sum."""
    M = 1 << p
    if not float(v).is_integer() or v < M:
        raise ValueError(f"{v!r} is not (j+1)*M + mask with M = {M}")
    v = int(v)
    mask, q = v % M, v // M
    k = bin(mask).count("1")
    if k == 0 or q % k:
        raise ValueError(f"{v} = {q}*M + {mask}: {k} contributor(s) cannot give {q}*M")
    j = q // k - 1
    if not 0 <= j < n:
        raise ValueError(f"{v} decodes to element {j}, outside 0..{n - 1}")
    return mask, j


@dataclass
class Message:
    step: int
    src: int                    # world ranks
    dst: int
    nbytes: int
    lo: int | None = None       # first and last element carried (None: not float64 data)
    hi: int | None = None
    mask: int | None = None     # contributors: bit r set when rank r's input is summed in
    peeked: bool = False        # the trace kept its first and last values (float64 data)
    op: str = ""                # a receive: "+=" added in, "=" copied, "hdr" no data, "?" unknown


@dataclass
class Picture:
    what: str
    p: int
    n: int
    steps: list                 # the step numbers, in order
    cells: dict                 # (rank, step) -> [("send" | "recv", Message)]
    columns: dict               # step -> its label: the receives' op, and the ranks if not all
    title: str
    problems: list
    off: tuple                  # np.array_split's piece offsets


def ranks_text(mask: int) -> str:
    """{0,1} / {0-3}: the ranks of a mask, runs of three or more as a range."""
    mask = int(mask)
    ranks = [r for r in range(mask.bit_length()) if mask >> r & 1]
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts += [f"{ranks[i]}-{ranks[j]}"] if j - i >= 2 else [str(r) for r in ranks[i:j + 1]]
        i = j + 1
    return "{" + ",".join(parts) + "}"


def piece_of(m: Message, off) -> tuple[int, str]:
    """(colour index, label): -1 "all" for the whole array, k "p<k>" for piece k, -2 a header
    (no float64 data), else -3: another element range, or "?" when the data did not decode."""
    if m.lo is None:
        return (-3, "?") if m.peeked or m.op == "?" else (-2, "header")
    if m.lo == 0 and m.hi == off[-1] - 1:
        return -1, "all"
    for k in range(len(off) - 1):
        if (m.lo, m.hi + 1) == (off[k], off[k + 1]):
            return k, f"p{k}"
    return -3, f"e{m.lo}-{m.hi}"


def collective_picture(trace: dict) -> Picture:
    """The messages of a --worker trace, decoded, matched and replayed (module docstring)."""
    from minipar.show import traceview                                       # noqa: PLC0415
    meta = trace["otherData"]["minipar"]
    what, p, n = meta["what"], meta["world"], meta["n"]
    spec, off, problems = WHATS[what], piece_offsets(n, p), []
    sends, recvs = [], []
    for e in traceview.spans(trace, cat="comm"):
        a, me = e["args"], e["pid"]
        if a["algorithm"] != spec.algorithm:
            problems.append(f"rank {me}: {a['op']} ran {a['algorithm']!r}, not {spec.algorithm!r}")
        for step, kind, peer, nbytes, *values in a["messages"]:
            if kind == "recv":
                recvs.append(Message(step, peer, me, nbytes))
                continue
            m = Message(step, me, peer, nbytes, peeked=bool(values))
            if values:
                try:
                    (m.mask, m.lo), (last_mask, m.hi) = (decode(v, p, n) for v in values)
                except ValueError as err:
                    problems.append(f"step {step}: rank {me} -> {peer}: {err}")
                    m.lo = m.hi = m.mask = None
                else:
                    if last_mask != m.mask or m.hi - m.lo + 1 != nbytes // 8:
                        problems.append(f"step {step}: rank {me} -> {peer}: {nbytes // 8} elements but its "
                                        f"ends decode to elements {m.lo}..{m.hi}, contributors "
                                        f"{ranks_text(m.mask)} and {ranks_text(last_mask)}")
                        m.lo = m.hi = m.mask = None
            sends.append(m)
    # each receive takes the data of its send: messages between two ranks match in the order
    # they were posted (MPI's non-overtaking rule), and both sides must call it the same step
    pending = defaultdict(deque)
    for m in sorted(sends, key=lambda m: m.step):
        pending[(m.src, m.dst)].append(m)
    for m in sorted(recvs, key=lambda m: m.step):
        q = pending[(m.src, m.dst)]
        if not q:
            problems.append(f"step {m.step}: rank {m.dst} receives from rank {m.src}, which sent it nothing")
            m.op = "?"
            continue
        sent = q.popleft()
        if (sent.step, sent.nbytes) != (m.step, m.nbytes):
            problems.append(f"rank {m.src} sends {sent.nbytes} B to rank {m.dst} at its step {sent.step}; "
                            f"rank {m.dst} receives {m.nbytes} B at its step {m.step}")
        m.lo, m.hi, m.mask, m.peeked = sent.lo, sent.hi, sent.mask, sent.peeked
    problems += [f"step {m.step}: rank {m.src} sends to rank {m.dst}, which never receives it"
                 for q in pending.values() for m in q]
    steps = sorted({m.step for m in sends + recvs})
    replay(what, p, n, steps, sends, recvs, problems)
    cells = defaultdict(list)
    for kind, ms in (("send", sends), ("recv", recvs)):
        for m in ms:
            cells[(m.src if kind == "send" else m.dst, m.step)].append((kind, m))
    columns = {}
    for s in steps:
        active = {r for r in range(p) if (r, s) in cells}
        columns[s] = phase(spec, step_op(s, recvs)) + \
            ("" if len(active) == p else " ranks " + ranks_text(sum(1 << r for r in active)))
    return Picture(what, p, n, steps, dict(cells), columns, title(spec, p, n, off, steps, sends, recvs),
                   problems, off)


def step_op(s: int, recvs: list) -> str:
    """What the receives of step s do: "+=", "=", "hdr" (or several, "+=/=")."""
    return "/".join(sorted({m.op for m in recvs if m.step == s})) or "send"


def phase(spec: Spec, op: str) -> str:
    """"reduce-scatter +=": the phase a step's op marks for this algorithm, and the op."""
    name = spec.phases.get(op)
    return op if name is None else name if op == "hdr" else f"{name} {op}"


def replay(what, p, n, steps, sends, recvs, problems):
    """Every rank's contributors per element, step by step: sets each receive's op and
    appends to `problems` what does not add up (module docstring)."""
    state = start_state(what, p, n)
    for s in steps:
        for m in sends:                         # a step's sends leave before its receives land
            if m.step == s and m.mask is not None:
                held = np.unique(state[m.src, m.lo:m.hi + 1])
                if list(held) != [m.mask]:
                    problems.append(f"step {s}: rank {m.src} sends elements {m.lo}..{m.hi} with contributors "
                                    f"{ranks_text(m.mask)} but holds {', '.join(ranks_text(h) for h in held)}")
        for m in recvs:
            if m.step != s or m.op == "?":      # "?": no send matched it
                continue
            if m.mask is None:                  # a header, or values that did not decode
                m.op = "?" if m.peeked else "hdr"
                continue
            own = state[m.dst, m.lo:m.hi + 1]
            mine = int(np.bitwise_or.reduce(own))
            if mine & m.mask == 0:
                m.op = "+=" if mine else "="
                own |= m.mask
            elif mine & m.mask == mine:
                m.op = "="
                own[...] = m.mask
            else:
                m.op = "?"
                problems.append(f"step {s}: rank {m.dst} holds {ranks_text(mine)} of elements {m.lo}..{m.hi} "
                                f"and receives {ranks_text(m.mask)}: ranks {ranks_text(mine & m.mask)} twice")
    want = end_state(what, p, n)
    for r in range(p):
        bad = np.nonzero((want[r] >= 0) & (state[r] != want[r]))[0]
        if bad.size:
            j = bad[0]
            problems.append(f"after the last step rank {r} holds element {j} with contributors "
                            f"{ranks_text(int(state[r, j]))}, not {ranks_text(int(want[r, j]))} "
                            f"({bad.size} element(s) wrong)")


def title(spec, p, n, off, steps, sends, recvs) -> str:
    """"ring all-reduce, p=4, 32 float64 = 256 B (8 per piece): 6 steps: 3 reduce-scatter (+=),
    then 3 all-gather (=)": the phases are runs of steps whose receives do the same."""
    runs = []
    for s in steps:
        op = step_op(s, recvs)
        if runs and runs[-1][0] == op:
            runs[-1][1] += 1
        else:
            runs.append([op, 1])
    phases = ", then ".join(f"{k} {spec.phases.get(op, 'step(s)')}" + ("" if op == "hdr" else f" ({op})")
                            for op, k in runs)
    sizes = {off[k + 1] - off[k] for k in range(p)}
    pieces = any(piece_of(m, off)[0] >= 0 for m in sends)
    per = (f" ({sizes.pop()} per piece)" if len(sizes) == 1 else f" (pieces of {min(sizes)}-{max(sizes)})") \
        if pieces else ""
    return f"{spec.title}, p={p}, {n} float64 = {8 * n} B{per}: {len(steps)} steps: {phases}"


# --- the drawing ----------------------------------------------------------------------------------
def message_text(kind: str, m, off, p: int, contributors: bool = True) -> str:
    _, label = piece_of(m, off)
    if m.mask is None:                          # a header, or data that did not decode ("?")
        return f"->{m.dst} {label} {m.nbytes} B" if kind == "send" else f"<-{m.src} {label}"
    who = f" {ranks_text(m.mask)}" if contributors else ""
    return f"->{m.dst} {label}{who}" if kind == "send" else f"<-{m.src} {label} {m.op}{who}"


def _ordered(cell):
    return sorted(cell, key=lambda km: (km[0] != "send", km[1].dst if km[0] == "send" else km[1].src))


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
    return svg_end(out, legend_y + 70, pic.problems)


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
