"""Ring attention in python -m minipar.explain (ring-attention, cp 4, 2..8): the run, what its
trace says, and the drawing.

ring-attention runs ring_attention.RingAttention on P ranks (zig-zag, RING_SHAPE) inside a
layer span "ring attention", so the trace tells its forward's messages from its backward's;
its inputs mark each token's position in its first key and last value element
(ring_inputs), and rank 0 adds every rank's counted sub-blocks (BLOCKS) to the
trace's metadata, gathered outside the trace. Reading it takes ring_attention's formulas,
whose module imports minipar.comm (and so starts MPI): the launcher imports it only to draw,
after its mpirun has ended.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass

import numpy as np

from minipar.show.draw import _esc
from minipar.explain.common import BOLD, CHAR_W, RANGE, ExplainError, _text, colour


# --- ring attention: which K, V block each message carries, and who computes which sub-block -----
#
# The inputs name their positions: at global position i, the first element of the key and the
# last element of the value are (i + 1) / RING_MARK (exact in float64), the rest N(0, 1). A
# K, V message is np.stack([k, v]) of one rank's tokens, so its first value names the sender's
# block's first position and its last value the block's last: together, the rank whose block it
# is (ring_attention.positions). In backward the message is K, V, dK, dV: its first value still
# names the block, its last is a dV (a gradient, no marker); the closing dK, dV message carries
# gradients only, so the block it takes home is derived, not read (the caption says so).

RING_MARK = 16
RING_PASSES = ("forward", "backward")
RING_ENCODING = f"k[0,0,i,0] = v[B-1,H-1,i,hs-1] = (i+1)/{RING_MARK} at global position i, else N(0,1) seed 0"
RING_SHAPE = (2, 2, 4, 2)       # ring-attention: B, H, hs, and c tokens per chunk (T = 2 C c)
RING_MAX_P = 8


# --- the worker (under mpirun) --------------------------------------------------------------------
def work_ring(group, path: str):
    """RingAttention forward and backward of a scalar loss on this rank's zig-zag tokens, one
    layer span; checked against the single-process attention (ops.CausalSelfAttentionReference)."""
    from minipar import comm, trace                                # noqa: PLC0415
    from minipar.show import tracing                                  # noqa: PLC0415
    from minipar.autograd import ops
    from minipar.parallel.context import ring_attention as ra                   # noqa: PLC0415
    from minipar.autograd.tensor import Tensor                                   # noqa: PLC0415
    C, r = group.size, group.rank
    B, H, hs, c = RING_SHAPE
    T, layout = 2 * C * c, "zigzag"
    q, k, v, probe = ring_inputs(B, H, T, hs)                           # (B, H, T, hs) each, on every rank
    mine = ra.positions(r, C, T, layout)
    local = [Tensor(a[..., mine, :].copy(), requires_grad=True) for a in (q, k, v)]
    ra.BLOCKS.update(forward=0, backward=0)
    tracing.start(group, f"rank {r} cp{r}", peek=True)
    with trace.layer("ring attention"):
        o = ra.ring_attention(*local, group, layout)
    loss = ops.sum(ops.mul(o, Tensor(probe[..., mine, :])))
    loss.backward()
    with comm.untracked():                                              # not part of the picture
        counted = comm.all_gather(group, np.array([ra.BLOCKS["forward"], ra.BLOCKS["backward"]], np.int64))
    tracing.finish(group, path, {"what": "ring-attention", "B": B, "H": H, "T": T, "hs": hs, "layout": layout,
                               "blocks": counted.reshape(C, 2).tolist(), "encoding": RING_ENCODING})
    # the single-process attention of the whole sequence, on packed qkv (B, T, 3 H hs)
    qkv = np.concatenate([a.transpose(0, 2, 1, 3).reshape(B, T, H * hs) for a in (q, k, v)], axis=-1)
    y, cache = ops.CausalSelfAttentionReference.forward(qkv, H)
    dy = probe.transpose(0, 2, 1, 3).reshape(B, T, H * hs)
    grads = np.split(ops.CausalSelfAttentionReference.backward(dy, cache), 3, axis=-1)
    heads = [a.reshape(B, T, H, hs).transpose(0, 2, 1, 3)[..., mine, :] for a in [y] + grads]
    for name, got, want in zip(("o", "dq", "dk", "dv"), [o.data] + [t.grad for t in local], heads):
        if not np.allclose(got, want, rtol=1e-12, atol=1e-12):
            raise ExplainError(f"rank {r}: ring attention's {name} differs from the single-process "
                               f"attention's by {np.abs(got - want).max():.3g}")


# --- the trace, read ------------------------------------------------------------------------------
def ring_inputs(B: int, H: int, T: int, hs: int):
    """q, k, v (B, H, T, hs) of the whole sequence and the loss's probe (B, H, T, hs): N(0, 1),
    seed 0 (the same on every rank), with k[0, 0, i, 0] = v[B-1, H-1, i, hs-1] = (i+1)/RING_MARK."""
    q, k, v, probe = np.random.default_rng(0).standard_normal((4, B, H, T, hs))
    mark = (np.arange(T) + 1.0) / RING_MARK
    k[0, 0, :, 0] = mark
    v[-1, -1, :, -1] = mark
    return q, k, v, probe


def ring_position(value: float, T: int) -> int:
    """The global position a marker names; ValueError if the value is no marker."""
    i = value * RING_MARK - 1
    if not float(i).is_integer() or not 0 <= i < T:
        raise ValueError(f"{value!r} is no position marker (i+1)/{RING_MARK}, i in 0..{T - 1}")
    return int(i)


def ring_owner(values: list, C: int, T: int, layout: str) -> int:
    """The rank whose K, V block a message carries, from its first value (and its last, when
    given): the rank whose first (and last) position it names. ValueError if none is."""
    from minipar.parallel.context.ring_attention import positions               # noqa: PLC0415
    first = ring_position(values[0], T)
    last = ring_position(values[1], T) if len(values) > 1 else None
    for o in range(C):
        mine = positions(o, C, T, layout)
        if mine[0] == first and last in (None, mine[-1]):
            return o
    ends = f"positions {first} and {last}" if last is not None else f"position {first}"
    raise ValueError(f"no rank's block starts and ends at {ends}")


def chunks_of(rank: int, C: int, T: int, layout: str) -> list[int]:
    """The two chunks (of 2C, c = T/2C tokens each) rank `rank` keeps, in its order."""
    from minipar.parallel.context.ring_attention import positions               # noqa: PLC0415
    mine = positions(rank, C, T, layout)
    c = T // (2 * C)
    return [int(mine[0]) // c, int(mine[c]) // c]


@dataclass
class RingMessage:
    pas: str                    # "forward" or "backward"
    step: int                   # the ring step j = 0, 1, ... of its pass on the sender
    src: int
    dst: int
    nbytes: int                 # header and payload, as the trace counted them
    values: list                # the payload's first and last value (the trace's peek)
    carries: str = ""           # "K,V", "K,V,dK,dV" or "dK,dV"
    owner: int | None = None    # the rank whose block it is
    read: bool = False          # owner decoded from the values (False: derived from the step order)


@dataclass
class RingPicture:
    C: int
    T: int
    layout: str
    shape: tuple                # (B, H, t, hs) on each rank
    messages: list              # RingMessage, sends only, by pass, step, sender
    in_hand: dict               # (pass, rank, step) -> the rank whose K, V block it computes with
    cells: dict                 # (query chunk, key chunk) -> (rank, step) computing it; absent: skipped
    masked: set                 # the cells computed with a mask (a chunk against itself)
    blocks: dict                # "picture", "formula", "measured forward", "measured backward" -> per rank
    balance: dict               # layout -> ((query, key) pairs, sub-blocks) per rank, by formula
    title: str
    problems: list

    @property
    def n(self) -> int:
        """B H t hs: the elements of one rank's q (and of its K, of its V)."""
        B, H, t, hs = self.shape
        return B * H * t * hs


def _ring_calls(trace: dict, C: int, problems: list) -> dict:
    """(pass, rank) -> {"send": [args], "recv": [args]} in time order: each rank's point-to-point
    calls, put in the pass whose "ring attention" layer span holds them."""
    from minipar.show import traceview                                       # noqa: PLC0415
    out = {(pas, r): {"send": [], "recv": []} for pas in RING_PASSES for r in range(C)}
    for r in range(C):
        spans = {e["args"]["pass"]: e for e in traceview.spans(trace, "layer", r)
                 if e["args"]["layer"] == "ring attention"}
        for c in sorted(traceview.spans(trace, "comm", r), key=lambda e: e["ts"]):
            inside = [p for p, s in spans.items() if s["ts"] - 0.01 <= c["ts"] and c["end"] <= s["end"] + 0.01]
            if len(inside) != 1 or c["args"]["op"] not in ("send", "recv"):
                problems.append(f"rank {r}: a {c['args']['op']} at {c['ts']:.1f} us outside the ring attention's "
                                f"forward and backward")
                continue
            out[(inside[0], r)][c["args"]["op"]].append(c["args"])
    return out


def _ring_messages(calls: dict, C: int, problems: list) -> list:
    """Every send as a RingMessage: its step is its place in its pass on the sender; each receive
    is matched with the send it takes (between two ranks, in the order posted)."""
    sent, pending = [], defaultdict(deque)
    for (pas, r), kinds in calls.items():
        for j, a in enumerate(kinds["send"]):
            payload = [m for m in a["messages"] if m[0] == 2]
            values = payload[0][4:] if payload else []
            (dst,) = a["peers"]
            m = RingMessage(pas, j, r, dst, a["bytes_sent"], values)
            sent.append(m)
            pending[(pas, r, dst)].append(m)
    for (pas, r), kinds in sorted(calls.items()):
        for j, a in enumerate(kinds["recv"]):
            (src,) = a["peers"]
            q = pending[(pas, src, r)]
            if not q:
                problems.append(f"{pas} step {j}: rank {r} receives from rank {src}, which sent it nothing")
                continue
            m = q.popleft()
            if (m.step, m.nbytes) != (j, a["bytes_recv"]):
                problems.append(f"{pas}: rank {src} sends {m.nbytes} B to rank {r} at its step {m.step}; "
                                f"rank {r} receives {a['bytes_recv']} B at its step {j}")
    problems += [f"{m.pas} step {m.step}: rank {m.src} sends to rank {m.dst}, which never receives it"
                 for q in pending.values() for m in q]
    return sorted(sent, key=lambda m: (RING_PASSES.index(m.pas), m.step, m.src))


def _read_owners(pic: RingPicture, problems: list):
    """Each message's block (decoded, or for dK, dV home derived) and each rank's block in hand
    per step; checked against the ring's order (step j: the block of rank r - j) and the sizes."""
    from minipar.comm.protocol import HEADER_BYTES                      # noqa: PLC0415
    C, T, n = pic.C, pic.T, pic.n
    by = {(m.pas, m.src, m.step): m for m in pic.messages}
    for pas in RING_PASSES:
        pic.in_hand.update({(pas, r, 0): r for r in range(C)})            # step 0: its own K, V
        for j in range(C - 1 if pas == "forward" else C):               # a step after the step before it
            for r in range(C):
                m = by.get((pas, r, j))
                if m is None:
                    problems.append(f"{pas} step {j}: rank {r} sends nothing")
                    continue
                home = pas == "backward" and j == C - 1
                m.carries = "dK,dV" if home else "K,V" if pas == "forward" else "K,V,dK,dV"
                want_bytes = 8 * n * (2 if m.carries != "K,V,dK,dV" else 4) + HEADER_BYTES
                if m.nbytes != want_bytes:
                    problems.append(f"{pas} step {j}: rank {r} sends {m.nbytes} B, not {want_bytes} B "
                                    f"({m.carries} of n = {n} float64 each, and the header)")
                if home:
                    m.owner = pic.in_hand.get((pas, r, j))
                    if m.owner is not None and m.dst != m.owner:
                        problems.append(f"backward step {j}: rank {r} sends dK, dV of rank {m.owner}'s block "
                                        f"to rank {m.dst}, not home")
                    continue
                try:
                    m.owner = ring_owner(m.values[:2] if pas == "forward" else m.values[:1], C, T, pic.layout)
                    m.read = True
                except (ValueError, IndexError) as err:
                    problems.append(f"{pas} step {j}: rank {r} -> {m.dst}: {err or 'no values'}")
                    continue
                if m.owner != pic.in_hand.get((pas, r, j), m.owner):
                    problems.append(f"{pas} step {j}: rank {r} passes on the block of rank {m.owner} but "
                                    f"holds rank {pic.in_hand[(pas, r, j)]}'s")
                if m.owner != (r - j) % C:
                    problems.append(f"{pas} step {j}: rank {r} sends the block of rank {m.owner}; the ring's "
                                    f"step j holds rank r - j = {(r - j) % C}'s")
                if m.dst != (r + 1) % C:
                    problems.append(f"{pas} step {j}: rank {r} sends to rank {m.dst}, not to rank {(r + 1) % C}")
                pic.in_hand[(pas, m.dst, j + 1)] = m.owner


def _ring_cells(pic: RingPicture, problems: list):
    """Which rank computes each (query chunk, key chunk) sub-block, at which step: rank r with the
    block of rank o in hand computes ring_attention.sub_blocks of its chunks against o's (the
    fully masked ones skipped). Every causal sub-block must be computed exactly once."""
    from minipar.parallel.context.ring_attention import positions, sub_blocks   # noqa: PLC0415
    C, T, layout = pic.C, pic.T, pic.layout
    c = T // (2 * C)
    counts = [0] * C
    for r in range(C):
        mine = positions(r, C, T, layout)
        for j in range(C):
            o = pic.in_hand.get(("forward", r, j))
            if o is None:
                continue
            theirs = positions(o, C, T, layout)
            for a, b, mask in sub_blocks(mine, theirs):
                cell = (int(mine[a][0]) // c, int(theirs[b][0]) // c)
                if cell in pic.cells:
                    problems.append(f"sub-block q{cell[0]} x k{cell[1]} computed twice: by rank "
                                    f"{pic.cells[cell][0]} at step {pic.cells[cell][1]} and rank {r} at step {j}")
                pic.cells[cell] = (r, j)
                if mask is not None:
                    pic.masked.add(cell)
                counts[r] += 1
    missing = [(a, b) for a in range(2 * C) for b in range(a + 1) if (a, b) not in pic.cells]
    if missing:
        problems.append(f"{len(missing)} causal sub-block(s) computed by no rank, first q{missing[0][0]} x "
                        f"k{missing[0][1]}")
    pic.blocks["picture"] = counts


def ring_picture(trace: dict) -> RingPicture:
    """The ring attention worker's trace, read (the comment above): the messages, the block each
    carries, who computes which sub-block when; and the checks that every count adds up."""
    from minipar.parallel.context.ring_attention import LAYOUTS, blocks, pairs, ring_traffic   # noqa: PLC0415
    meta = trace["otherData"]["minipar"]
    C, T, layout = meta["world"], meta["T"], meta["layout"]
    B, H, hs = meta["B"], meta["H"], meta["hs"]
    problems = []
    calls = _ring_calls(trace, C, problems)
    pic = RingPicture(C, T, layout, (B, H, T // C, hs), _ring_messages(calls, C, problems), {}, {}, set(),
                      {}, {lay: ([pairs(r, C, T, lay) for r in range(C)], [blocks(r, C, T, lay) for r in range(C)])
                           for lay in LAYOUTS}, "", problems)
    _read_owners(pic, problems)
    _ring_cells(pic, problems)
    pic.blocks["formula"] = pic.balance[layout][1]
    pic.blocks["measured forward"] = [f for f, _ in meta["blocks"]]
    pic.blocks["measured backward"] = [b for _, b in meta["blocks"]]
    for name in ("formula", "measured forward", "measured backward"):
        if pic.blocks[name] != pic.blocks["picture"]:
            problems.append(f"sub-blocks per rank: {pic.blocks['picture']} in the picture, "
                            f"{pic.blocks[name]} by {'ring_attention.blocks' if name == 'formula' else name}")
    want = ring_traffic(pic.n, C, 8)
    for r in range(C):
        mine = [m for m in pic.messages if m.src == r]
        have = (len(mine), sum(m.nbytes for m in mine))
        if have != want:
            problems.append(f"rank {r} sends {have[0]} messages, {have[1]} B; ring_traffic(n={pic.n}, C={C}) "
                            f"says {want[0]}, {want[1]} B")
    pic.title = (f"ring attention ({layout}), cp={C}, T={T} in {2 * C} chunks of {T // (2 * C)}, "
                 f"q k v ({B},{H},{T // C},{hs}) float64 per rank: {C - 1} forward + {C} backward messages "
                 f"= {want[0]}, {want[1]} B per rank")
    return pic


# --- the drawing ----------------------------------------------------------------------------------
# Three panels from one RingPicture (ring_picture): (a) which chunks each rank keeps,
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


def _split_svg(pic, x0, y0):
    """(a): two bars of 2C chunks, coloured by the rank that keeps each. -> (svg, bottom y)."""
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
