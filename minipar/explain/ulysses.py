"""Ulysses attention in python -m minipar.explain (ulysses, cp 4; 2 or 4): the run, what its
trace says, and the drawing.

ulysses runs ulysses.UlyssesAttention (--cp-impl ulysses) on P ranks, zig-zag, with grouped-query
attention: H = 8 query heads and Hkv = 2 key/value heads (ULY_SHAPE), so at cp 4 each rank
attends with 2 query heads and one KV head that is copied to 2 ranks (kv_heads_of). It runs
forward and backward of a scalar loss inside a layer span "ulysses attention", so the trace
tells its forward's all-to-alls from its backward's, and it is checked against the
single-process attention (CausalSelfAttentionReference) at 1e-12. Rank 0 adds to the trace's
metadata the reference's values the pieces of computed tensors must carry, and every rank's
KV gradients as the layer returned them, gathered outside the trace. Reading it takes ulysses'
formulas, whose module imports minipar.comm (and so starts MPI): the launcher imports it only
to draw, after its mpirun has ended.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from minipar.show.draw import _esc
from minipar.explain.common import BOLD, CHAR_W, LINE_H, WHATS, ExplainError, _text, colour, svg_end


# --- what is on the wire ------------------------------------------------------------------------
#
# Four all-to-alls per layer and micro-batch; piece j of rank r goes to rank j (the pairwise
# exchange: C-1 pieces sent, the own one kept). The peek keeps each piece's first and last value.
#   1 forward  q,k,v     rank r's tokens, the heads of rank j: first q[b=0, r's first token,
#                        query head j Hq], last v[B-1, r's last token, j's last KV head, hs-1]
#   2 forward  y         back home: y of rank j's query heads at rank r's tokens
#   3 backward dy        the loss's probe, as 1 but query heads only: first and last head of j
#   4 backward dq,dk,dv  home: dq of rank j's first query head, last the dV of j's KV head
# The inputs name what 1 and 3 carry: element 0 of query head h and element hs-1 of value head
# j at global position i are (h T + i + 1) / ULY_MARK, and so are both ends of the probe's
# head h (exact in float64). 2 and 4 carry computed values: their first and last values are
# checked against the single-process attention's at the places Ulysses puts there (the
# metadata's tables), and 4's last one is the part of a KV head's gradient that rank j's query
# heads give: where a KV head is on several ranks, the receiver sums these parts.

ULY_SHAPE = (2, 8, 2, 2, 2)     # B, H query heads, Hkv KV heads, hs, c tokens per chunk (T = 2 C c)
ULY_MARK = 128
ULY_LAYOUT = "zigzag"
ULY_LAYER = "ulysses attention"
ULY_RANKS = (2, 4)              # cp 8 would take Bruck's all-to-all for pieces this small
ULY_CALLS = (("forward", "q,k,v", "to the heads"), ("forward", "y", "home"),
             ("backward", "dy", "to the heads"), ("backward", "dq,dk,dv", "home"))
ULY_TOL = 1e-9                  # a computed value against the reference's, relative


def uly_ranks_ok(p: int) -> bool:
    return p in ULY_RANKS


# --- the worker (under mpirun) --------------------------------------------------------------------
def uly_inputs(B: int, H: int, Hkv: int, T: int, hs: int):
    """qkv (B, T, (H + 2 Hkv) hs) of the whole sequence and the loss's probe (B, T, H hs): N(0, 1),
    seed 0 (the same on every rank), the markers above in place."""
    rng = np.random.default_rng(0)
    qkv, probe = rng.standard_normal((B, T, (H + 2 * Hkv) * hs)), rng.standard_normal((B, T, H * hs))
    pos = np.arange(T)
    for h in range(H):
        qkv[:, :, h * hs] = probe[:, :, h * hs] = probe[:, :, h * hs + hs - 1] = (h * T + pos + 1) / ULY_MARK
    for j in range(Hkv):
        qkv[:, :, (H + Hkv + j) * hs + hs - 1] = (j * T + pos + 1) / ULY_MARK
    return qkv, probe


def uly_reference(qkv, probe, H: int, Hkv: int):
    """The single-process attention: y and dqkv, and the tables a piece's computed ends are
    checked against, [position][query head]: y's element 0 (b = 0) and hs-1 (b = B-1), dq's
    element 0 (b = 0), and the dV at element hs-1 (b = B-1) of the KV head h // g that query
    head h alone gives."""
    from minipar.autograd.attention import CausalSelfAttentionReference as ref    # noqa: PLC0415
    B, T, _ = qkv.shape
    hs = probe.shape[-1] // H
    y, cache = ref.forward(qkv, H, Hkv)
    dqkv = ref.backward(probe, cache)
    dv_last = np.empty((T, H))
    for h in range(H):
        alone = np.zeros_like(probe)
        alone[..., h * hs:(h + 1) * hs] = probe[..., h * hs:(h + 1) * hs]
        dv_last[:, h] = ref.backward(alone, cache)[B - 1, :, (H + Hkv + h // (H // Hkv)) * hs + hs - 1]
    tables = {"y_first": y[0, :, ::hs], "y_last": y[B - 1, :, hs - 1::hs], "dq_first": dqkv[0, :, :H * hs:hs],
              "dv_last": dv_last}
    return y, dqkv, {k: v.tolist() for k, v in tables.items()}


def work_ulysses(group, path: str):
    """UlyssesAttention forward and backward of a scalar loss on this rank's zig-zag tokens, one
    layer span; checked against the single-process attention."""
    from minipar import comm, trace                                             # noqa: PLC0415
    from minipar.autograd import ops                                            # noqa: PLC0415
    from minipar.autograd.tensor import Tensor                                  # noqa: PLC0415
    from minipar.parallel.context.ring_attention import positions               # noqa: PLC0415
    from minipar.parallel.context.ulysses import UlyssesAttention               # noqa: PLC0415
    from minipar.show import tracing                                            # noqa: PLC0415
    C, r = group.size, group.rank
    B, H, Hkv, hs, c = ULY_SHAPE
    T = 2 * C * c
    qkv, probe = uly_inputs(B, H, Hkv, T, hs)
    mine = positions(r, C, T, ULY_LAYOUT)
    x = Tensor(qkv[:, mine].copy(), requires_grad=True)
    tracing.start(group, f"rank {r} cp{r}", peek=True)
    with trace.layer(ULY_LAYER):
        y = UlyssesAttention.apply(x, H, group, ULY_LAYOUT, Hkv, None)
    ops.sum(ops.mul(y, Tensor(probe[:, mine].copy()))).backward()
    home = x.grad[B - 1, -1, (H + Hkv) * hs:].reshape(Hkv, hs)[:, -1]      # dV of each KV head, my last token
    with comm.untracked():                                              # not part of the picture
        every = comm.all_gather(group, np.ascontiguousarray(home))
    y_ref, dqkv_ref, tables = uly_reference(qkv, probe, H, Hkv)
    tracing.finish(group, path, {"what": "ulysses", "B": B, "H": H, "Hkv": Hkv, "hs": hs, "T": T,
                                 "layout": ULY_LAYOUT, "dv_home": every.reshape(C, Hkv).tolist(),
                                 "reference": tables, "encoding": f"q[b,i,h,0] = v[b,i,j,hs-1] = dy[b,i,h,0] = "
                                 f"dy[b,i,h,hs-1] = (head T + i + 1)/{ULY_MARK} at global position i"})
    for name, got, want in (("y", y.data, y_ref[:, mine]), ("dqkv", x.grad, dqkv_ref[:, mine])):
        if not np.allclose(got, want, rtol=1e-12, atol=1e-12):
            raise ExplainError(f"rank {r}: Ulysses attention's {name} differs from the single-process "
                               f"attention's by {np.abs(got - want).max():.3g}")


# --- the trace, read ------------------------------------------------------------------------------
def uly_marker(value: float, T: int, heads: int) -> tuple[int, int]:
    """(position, head) a marker names; ValueError if the value is none."""
    n = value * ULY_MARK - 1
    if not float(n).is_integer() or not 0 <= n < heads * T:
        raise ValueError(f"{value!r} is no marker (head T + i + 1)/{ULY_MARK}, head < {heads}, i < {T}")
    return int(n) % T, int(n) // T


@dataclass
class Piece:
    call: int                   # 0..3: ULY_CALLS
    src: int
    dst: int
    nbytes: int
    values: list                # its first and last value (the trace's peek)
    tokens: int | None = None   # the rank whose tokens it carries
    heads: tuple = ()           # (first query head, last head: a KV head in 0 and 3, a query head in 1 and 2)
    read: bool = True           # from the markers (False: its computed values checked against the reference)


@dataclass
class UlyssesPicture:
    C: int
    T: int
    shape: tuple                # (B, H, Hkv, hs)
    split: tuple                # (Hq, kv): head_split
    pieces: list                # Piece, sends only, by call, sender, receiver
    q_heads: list               # rank -> its query heads, as read from the dy pieces it receives
    kv_heads: list              # rank -> its KV heads, as read from the q,k,v pieces it receives
    sums: dict                  # (rank, KV head) -> (the layer's dV, [(sender, part, on the wire)])
    sent: list                  # rank -> (pieces, bytes) it sent, from the trace
    ledger: list                # rank -> bytes its ledger counted on the cp axis
    want: int                   # ulysses_traffic: bytes per rank
    title: str
    problems: list = field(default_factory=list)

    def formula(self, j: int) -> tuple[list, list]:
        """(query heads, KV heads) of rank j by head_split and kv_heads_of."""
        from minipar.parallel.context.ulysses import kv_heads_of               # noqa: PLC0415
        Hq = self.split[0]
        return list(range(j * Hq, (j + 1) * Hq)), [int(k) for k in kv_heads_of(j, self.shape[2], self.C)]

    def piece(self, call: int, src: int, dst: int):
        return next((p for p in self.pieces if (p.call, p.src, p.dst) == (call, src, dst)), None)


def uly_name(call: int) -> str:
    pas, what, where = ULY_CALLS[call]
    return f"all-to-all {call + 1} ({pas} {what} {where})"


def _uly_calls(trace: dict, C: int, problems: list) -> dict:
    """(rank, call) -> the args of its all_to_all: each rank's calls in time order, put in the
    pass whose "ulysses attention" layer span holds them, two a pass."""
    from minipar.show import traceview                                       # noqa: PLC0415
    out = {}
    for r in range(C):
        spans = {e["args"]["pass"]: e for e in traceview.spans(trace, "layer", r)
                 if e["args"]["layer"] == ULY_LAYER}
        per = {"forward": [], "backward": []}
        for c in sorted(traceview.spans(trace, "comm", r), key=lambda e: e["ts"]):
            inside = [p for p, s in spans.items() if s["ts"] - 0.01 <= c["ts"] and c["end"] <= s["end"] + 0.01]
            if len(inside) != 1 or c["args"]["op"] != "all_to_all":
                problems.append(f"rank {r}: a {c['args']['op']} at {c['ts']:.1f} us outside the all-to-alls of "
                                f"Ulysses' forward and backward")
                continue
            per[inside[0]].append(c["args"])
        for pas, calls in per.items():
            if len(calls) != 2:
                problems.append(f"rank {r}: {pas} makes {len(calls)} all-to-all(s), not 2")
            first = 0 if pas == "forward" else 2
            out.update({(r, first + k): a for k, a in enumerate(calls[:2])})
    return out


def _uly_pieces(calls: dict, pic: UlyssesPicture, problems: list):
    """Every send as a Piece; each all-to-all sends one piece to every other rank and receives
    one from each, of the size its sender sent."""
    C = pic.C
    for (r, k), a in sorted(calls.items()):
        if a["algorithm"] != "pairwise exchange":
            problems.append(f"{uly_name(k)}: rank {r} runs {a['algorithm']!r}; this picture reads the "
                            f"pairwise exchange")
        sends = [m for m in a["messages"] if m[1] == "send"]
        others = [q for q in range(C) if q != r]
        if sorted(m[2] for m in sends) != others:
            problems.append(f"{uly_name(k)}: rank {r} sends to ranks {sorted(m[2] for m in sends)}, "
                            f"not once to each of {others}")
        pic.pieces += [Piece(k, r, m[2], m[3], list(m[4:6])) for m in sends]
    sent = defaultdict(list)                                 # (call, sender, receiver) -> bytes, in order
    for p in pic.pieces:
        sent[(p.call, p.src, p.dst)].append(p.nbytes)
    for (r, k), a in sorted(calls.items()):
        for m in (m for m in a["messages"] if m[1] == "recv"):
            have = sent[(k, m[2], r)].pop(0) if sent[(k, m[2], r)] else None
            if have is None:
                problems.append(f"{uly_name(k)}: rank {r} receives {m[3]} B from rank {m[2]}, which sent it nothing")
            elif have != m[3]:
                problems.append(f"{uly_name(k)}: rank {r} receives {m[3]} B from rank {m[2]}, which sent it {have} B")
    problems += [f"{uly_name(k)}: rank {s} sends {n} B to rank {d}, which never receives it"
                 for (k, s, d), left in sorted(sent.items()) for n in left]
    pic.pieces.sort(key=lambda p: (p.call, p.src, p.dst))


def _owner(first: int, last: int, C: int, T: int):
    """The rank whose tokens start at position `first` and end at `last`; None if no rank's do."""
    from minipar.parallel.context.ring_attention import positions                 # noqa: PLC0415
    return next((o for o in range(C) if (positions(o, C, T, ULY_LAYOUT)[[0, -1]] == [first, last]).all()), None)


def _ends(o: int, C: int, T: int) -> tuple[int, int]:
    from minipar.parallel.context.ring_attention import positions                 # noqa: PLC0415
    mine = positions(o, C, T, ULY_LAYOUT)
    return int(mine[0]), int(mine[-1])


def _heads_text(kind: str, a: int, b: int) -> str:
    return f"{kind} {a}" if a == b else f"{kind}s {a}-{b}"


def _read_marked(pic: UlyssesPicture, p: Piece, problems: list):
    """A q,k,v or dy piece: its tokens and heads read from the markers, checked against Ulysses:
    the sender's own tokens, the receiver's heads."""
    C, T, H, Hkv = pic.C, pic.T, pic.shape[1], pic.shape[2]
    qh, kvh = pic.formula(p.dst)
    try:
        (i0, h0), (i1, h1) = uly_marker(p.values[0], T, H), uly_marker(p.values[1], T, H if p.call == 2 else Hkv)
    except (ValueError, IndexError) as err:
        problems.append(f"{uly_name(p.call)}: rank {p.src} -> {p.dst}: {err or 'no values'}")
        return
    p.tokens, p.heads = _owner(i0, i1, C, T), (h0, h1)
    name = f"{uly_name(p.call)}: rank {p.src} -> {p.dst}"
    if p.tokens != p.src:
        whose = "no rank's" if p.tokens is None else f"rank {p.tokens}'s"
        problems.append(f"{name} carries {whose} tokens (positions {i0}..{i1}); Ulysses sends the sender's own "
                        f"(positions {'..'.join(map(str, _ends(p.src, C, T)))})")
    if h0 != qh[0]:
        problems.append(f"{name} carries query head {h0} first; head_split gives rank {p.dst} "
                        f"{_heads_text('query head', qh[0], qh[-1])}")
    if p.call == 0 and h1 != kvh[-1]:
        problems.append(f"{name} carries KV head {h1} last; kv_heads_of gives rank {p.dst} KV head(s) {kvh}")
    if p.call == 2 and h1 != qh[-1]:
        problems.append(f"{name} carries query head {h1} last; head_split gives rank {p.dst} "
                        f"{_heads_text('query head', qh[0], qh[-1])}")


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= ULY_TOL * max(1.0, abs(b))


def _read_computed(pic: UlyssesPicture, p: Piece, tables: dict, problems: list):
    """A y or dq,dk,dv piece, on its way home: its first and last values against the reference's
    at the receiver's first and last token and the sender's heads (for 4's last value: the part of
    the sender's KV head's gradient its own query heads give)."""
    C, T, H, Hkv = pic.C, pic.T, pic.shape[1], pic.shape[2]
    qh, kvh = pic.formula(p.src)
    first, last = _ends(p.dst, C, T)
    g = H // Hkv
    if p.call == 1:
        want = [("y", tables["y_first"][first][qh[0]], f"position {first}, query head {qh[0]}"),
                ("y", tables["y_last"][last][qh[-1]], f"position {last}, query head {qh[-1]}")]
    else:
        part = sum(tables["dv_last"][last][h] for h in qh if h // g == kvh[-1])
        want = [("dq", tables["dq_first"][first][qh[0]], f"position {first}, query head {qh[0]}"),
                ("the dV", part, f"position {last}, KV head {kvh[-1]} from query heads {qh[0]}-{qh[-1]}")]
    p.read = False
    for value, (what, ref, where) in zip(p.values + [None] * 2, want):
        if value is None or not _close(value, ref):
            problems.append(f"{uly_name(p.call)}: rank {p.src} -> {p.dst} carries {value!r} where Ulysses puts "
                            f"{what} at {where}: {ref!r}")
            return
    p.tokens, p.heads = p.dst, (qh[0], qh[-1] if p.call == 1 else kvh[-1])


def _uly_heads(pic: UlyssesPicture, problems: list):
    """Each rank's heads as the pieces it received say (the dy pieces its query heads, the
    q,k,v pieces its KV heads); a KV head on the ranks kv_heads_of gives it, and with every query
    head that reads it."""
    C, H, Hkv = pic.C, pic.shape[1], pic.shape[2]
    Hq, kv = pic.split
    for j in range(C):
        qh, kvh = pic.formula(j)
        dy = {p.heads for p in pic.pieces if p.call == 2 and p.dst == j and p.heads}
        kvs = {p.heads[1] for p in pic.pieces if p.call == 0 and p.dst == j and p.heads}
        pic.q_heads[j] = list(range(min(dy)[0], min(dy)[1] + 1)) if len(dy) == 1 else qh
        pic.kv_heads[j] = list(range(min(kvs) - kv + 1, min(kvs) + 1)) if len(kvs) == 1 else kvh
        if len(dy) > 1 or len(kvs) > 1:
            named = (", ".join(f"{a}-{b}" for a, b in sorted(dy)), ", ".join(map(str, sorted(kvs))))
            problems.append(f"rank {j} receives pieces naming different heads: query heads {named[0]}; "
                            f"KV heads {named[1]}")
    g = H // Hkv
    for k in range(Hkv):
        holders = [j for j in range(C) if k in pic.kv_heads[j]]
        want = [j for j in range(C) if k in pic.formula(j)[1]]
        if holders != want:
            problems.append(f"KV head {k} is copied to ranks {holders}; kv_heads_of puts it on ranks {want}")
    for j in range(C):
        for h in pic.q_heads[j]:
            if h // g not in pic.kv_heads[j]:
                problems.append(f"rank {j} attends with query head {h}, which reads KV head {h // g}, without it "
                                f"(it has KV head(s) {pic.kv_heads[j]})")


def _uly_sums(pic: UlyssesPicture, meta: dict, problems: list):
    """The dV of each KV head at each rank's last token, as the layer returned it: the sum of
    the parts the ranks holding that head sent home (the receiver's own part, never on the wire,
    from the reference)."""
    C, T, H, Hkv = pic.C, pic.T, pic.shape[1], pic.shape[2]
    g, tables = H // Hkv, meta["reference"]
    for i in range(C):
        last = _ends(i, C, T)[1]
        for k in range(Hkv):
            parts = []
            for s in (s for s in range(C) if pic.kv_heads[s] and pic.kv_heads[s][-1] == k):
                if s == i:
                    parts.append((s, sum(tables["dv_last"][last][h] for h in pic.q_heads[s] if h // g == k), False))
                elif (p := pic.piece(3, s, i)) is not None and len(p.values) == 2:
                    parts.append((s, p.values[1], True))
            got = meta["dv_home"][i][k]
            pic.sums[(i, k)] = (got, parts)
            total = sum(v for _, v, _ in parts)
            if not _close(got, total):
                terms = " + ".join(f"{v:.6g} ({'from rank ' + str(s) if wire else 'its own'})" for s, v, wire in parts)
                problems.append(f"rank {i}: the layer's dV of KV head {k} at position {last} is {got:.6g}; the parts "
                                f"sent home sum to {terms or 'nothing'} = {total:.6g}")


def _uly_bytes(pic: UlyssesPicture, meta: dict, problems: list):
    """Each piece's size by its call; per rank: 4 (C-1) pieces, ulysses_traffic's bytes, and the
    same bytes in its ledger."""
    from minipar.parallel.context.ulysses import ulysses_traffic               # noqa: PLC0415
    C, T, (B, _, _, hs) = pic.C, pic.T, pic.shape
    Hq, kv = pic.split
    t = T // C
    size = {0: B * t * (Hq + 2 * kv) * hs * 8, 1: B * t * Hq * hs * 8}
    for p in pic.pieces:
        want = size[p.call in (1, 2)]
        if p.nbytes != want:
            what = "(Hq + 2 kv)" if p.call in (0, 3) else "Hq"
            problems.append(f"{uly_name(p.call)}: rank {p.src} sends {p.nbytes} B to rank {p.dst}, not {want} B "
                            f"(B t {what} hs 8)")
    pic.want = ulysses_traffic(B * t, Hq, kv, hs, C, 8)
    for r in range(C):
        mine = [p.nbytes for p in pic.pieces if p.src == r]
        pic.sent[r] = (len(mine), sum(mine))
        pic.ledger[r] = meta["ledger_by_axis"][r].get("cp", {}).get("bytes_sent", 0)
        if pic.sent[r] != (4 * (C - 1), pic.want) or pic.ledger[r] != pic.want:
            problems.append(f"rank {r} sends {pic.sent[r][0]} pieces, {pic.sent[r][1]} B (its ledger: "
                            f"{pic.ledger[r]} B); Ulysses sends 4 (C-1) = {4 * (C - 1)}, ulysses_traffic "
                            f"says {pic.want} B")


def uly_picture(trace: dict) -> UlyssesPicture:
    """The Ulysses worker's trace, read (the comment above): the pieces of the four all-to-alls,
    what each carries, each rank's heads and the KV gradients' sums; the checks that they are
    what Ulysses must send."""
    from minipar.parallel.context.ulysses import head_split                     # noqa: PLC0415
    meta = trace["otherData"]["minipar"]
    C, T, B, H, Hkv, hs = meta["world"], meta["T"], meta["B"], meta["H"], meta["Hkv"], meta["hs"]
    try:
        split = head_split(H, Hkv, C)
    except ValueError as err:
        raise ExplainError(str(err)) from None
    pic = UlyssesPicture(C, T, (B, H, Hkv, hs), split, [], [[]] * C, [[]] * C, {}, [None] * C, [0] * C, 0, "")
    problems = pic.problems
    _uly_pieces(_uly_calls(trace, C, problems), pic, problems)
    for p in pic.pieces:
        if p.call in (0, 2):
            _read_marked(pic, p, problems)
        else:
            _read_computed(pic, p, meta["reference"], problems)
    _uly_heads(pic, problems)
    _uly_sums(pic, meta, problems)
    _uly_bytes(pic, meta, problems)
    Hq, kv = split
    pic.title = (f"{WHATS['ulysses'].title} ({meta['layout']}), cp={C}, T={T}, H={H} query heads, Hkv={Hkv} KV "
                 f"heads, hs={hs}, B={B} float64: {Hq} query + {kv} KV head(s) a rank; 4 all-to-alls of {C - 1} "
                 f"piece{'s' if C > 2 else ''} = {pic.want} B per rank")
    return pic


# --- the drawing ----------------------------------------------------------------------------------
# One grid per rank and state: a column per token position, a row per head (query heads, then
# the KV heads, k and v together), a cell filled in the colour of the rank whose piece brought
# it (pale: the rank's own piece, kept), several colours side by side where the parts of a KV
# head's gradient are summed. Beside each state, the all-to-all that made it, piece by piece.

CELL, GAP = 10, 44


def uly_label(pic, p) -> str:
    """"q2-3,kv0 [r1]": what a piece carries, whose tokens; "*": checked against the reference."""
    if p.tokens is None:
        return f"? {p.nbytes} B"
    a, b = p.heads
    Hq, kv = pic.split
    heads = {0: f"q{a}-{a + Hq - 1},kv{b}", 1: f"y{a}-{b}", 2: f"dy{a}-{b}", 3: f"dq{a}-{a + Hq - 1},dkv{b}"}[p.call]
    return f"{heads} [r{p.tokens}]{'' if p.read else '*'}"


def uly_states(pic) -> list:
    """[(title, {rank: {(row, position): [source ranks]}})] for the state before the first
    all-to-all and after each one; row h < H a query head, H + k KV head k."""
    from minipar.parallel.context.ring_attention import positions              # noqa: PLC0415
    C, T, H = pic.C, pic.T, pic.shape[1]
    mine = [list(positions(r, C, T, ULY_LAYOUT)) for r in range(C)]
    Hq, kv = pic.split

    def rows(call, first, last):
        return list(range(first, first + Hq)) + ([H + k for k in range(last - kv + 1, last + 1)]
                                                 if call in (0, 3) else [])

    states = [("before: rank r holds q, k, v of its own tokens, every head",
               {r: {(row, i): [r] for row in range(H + pic.shape[2]) for i in mine[r]} for r in range(C)})]
    for call in range(4):
        grid = {r: {} for r in range(C)}
        for r in range(C):                                  # the own piece, kept: by the formula
            qh, kvh = pic.formula(r)
            for row in rows(call, qh[0], kvh[-1] if call in (0, 3) else qh[-1]):
                for i in mine[r]:
                    grid[r].setdefault((row, i), []).append(r)
        for p in (p for p in pic.pieces if p.call == call and p.tokens is not None):
            for row in rows(call, *p.heads):
                for i in mine[p.tokens]:
                    grid[p.dst].setdefault((row, i), []).append(p.src)
        pas, what, where = ULY_CALLS[call]
        states.append((f"after all-to-all {call + 1}, {pas}: {what} {where}", grid))
    return states


def uly_matrix(pic, call) -> list[str]:
    """One all-to-all as text: a row per sender, a column per receiver."""
    w = 21
    out = [(" " * 9 + "".join(f"to rank {d}".ljust(w) for d in range(pic.C))).rstrip()]
    for s in range(pic.C):
        cells = []
        for d in range(pic.C):
            p = pic.piece(call, s, d)
            cells.append("kept" if s == d else "-" if p is None else uly_label(pic, p))
        out.append((f"rank {s}".ljust(9) + "".join(c.ljust(w) for c in cells)).rstrip())
    return out


def uly_piece_bytes(pic, call) -> str:
    B, H, Hkv, hs = pic.shape
    Hq, kv = pic.split
    t = pic.T // pic.C
    if call in (0, 3):
        return f"B t (Hq + 2 kv) hs 8 = {B}*{t}*({Hq}+2*{kv})*{hs}*8 = {B * t * (Hq + 2 * kv) * hs * 8} B"
    return f"B t Hq hs 8 = {B}*{t}*{Hq}*{hs}*8 = {B * t * Hq * hs * 8} B"


def uly_lines(pic) -> dict:
    """The text both drawings show below the grids: heads, sums, bytes, caption."""
    C = pic.C
    heads = []
    for j in range(C):
        holders = [s for s in range(C) if set(pic.kv_heads[j]) & set(pic.kv_heads[s])]
        heads.append(f"rank {j}: query heads {pic.q_heads[j]}, KV head(s) {pic.kv_heads[j]}"
                     + (f", a copy also on rank(s) {[s for s in holders if s != j]}" if len(holders) > 1 else ""))
    sums = []
    for (i, k), (got, parts) in sorted(pic.sums.items()):
        terms = " + ".join(f"{v:.6f} ({'rank ' + str(s) if wire else 'own'})" for s, v, wire in parts)
        sums.append(f"rank {i}, KV head {k}: {terms or '(none)'} -> layer's dV {got:.6f}")
    sent = [f"rank {r}: {n} pieces, {b} B sent; its ledger {pic.ledger[r]} B; ulysses_traffic {pic.want} B"
            for r, (n, b) in enumerate(pic.sent)]
    caption = [
        "Read from the trace: each piece's sender, receiver, bytes and all-to-all; the pass, from the layer span "
        "that holds it.",
        f"q,k,v and dy pieces: their tokens and heads decoded from their first and last values (markers (head T + "
        f"i + 1)/{ULY_MARK} at position i).",
        "* y and dq,dk,dv pieces: computed values, checked against the single-process attention's at the tokens "
        "and heads Ulysses puts there;",
        "a dkv piece's last value is the part of the sender's KV head's gradient its own query heads give: the "
        "receiver sums the parts (rank r: own part kept).",
        "[rN]: the tokens of rank N; kept: a rank's own piece, never on the wire (drawn pale in the grids).",
        "Grids: a column per position, a row per head, a cell in the colour of the rank whose piece brought it; "
        "two colours: a KV head's gradient parts, summed.",
    ]
    return {"heads": heads, "sums": sums, "sent": sent, "caption": caption}


def uly_text(pic) -> str:
    from minipar.parallel.context.ring_attention import positions              # noqa: PLC0415
    C, T = pic.C, pic.T
    owner = {int(i): r for r in range(C) for i in positions(r, C, T, ULY_LAYOUT)}
    out = [pic.title, "", f"(a) the sequence, T = {T} tokens in {2 * C} chunks of {T // (2 * C)}: the rank that "
                          f"keeps each position (zig-zag: chunks r and {2 * C - 1}-r)",
           "  position " + " ".join(f"{i:>2}" for i in range(T)),
           "  rank     " + " ".join(f"r{owner[i]}" for i in range(T)), ""]
    lines = uly_lines(pic)
    out += ["(b) the heads each rank attends with, read from the pieces (head_split, kv_heads_of)",
            *("  " + s for s in lines["heads"]), ""]
    for call in range(4):
        out += [f"(c{call + 1}) {uly_name(call)}: a piece {uly_piece_bytes(pic, call)}", *uly_matrix(pic, call), ""]
    out += ["(d) a KV head's gradient at each rank's last token: the parts sent home, summed",
            *("  " + s for s in lines["sums"]), "", "(e) bytes per rank", *("  " + s for s in lines["sent"]), "",
            *lines["caption"]]
    out += [f"PROBLEM: {line}" for line in pic.problems]
    return "\n".join(out)


def _grid_svg(pic, x0, y0, cells, own, labels: bool) -> list:
    """One rank's grid: T columns, H + Hkv rows; cells {(row, position): [sources]}, drawn pale
    where their one source is `own` (the rank's own piece, kept)."""
    C, T, H, Hkv = pic.C, pic.T, pic.shape[1], pic.shape[2]
    rows = H + Hkv
    out = [f'<rect x="{x0}" y="{y0}" width="{T * CELL}" height="{rows * CELL}" fill="white" stroke="#bbbbbb"/>',
           f'<line x1="{x0}" y1="{y0 + H * CELL}" x2="{x0 + T * CELL}" y2="{y0 + H * CELL}" stroke="#777777"/>']
    if labels:
        out += [_text(x0 - 4, y0 + row * CELL + 8, f"q{row}" if row < H else f"kv{row - H}",
                      ' text-anchor="end" font-size="8"') for row in range(rows)]
    runs = []                                       # [row, first position, last, sources]: one source, merged
    for (row, i), srcs in sorted(cells.items()):
        if runs and runs[-1][0] == row and runs[-1][2] == i - 1 and runs[-1][3] == srcs and len(srcs) == 1:
            runs[-1][2] = i
        else:
            runs.append([row, i, i, srcs])
    for row, a, b, srcs in runs:
        w = CELL * (b - a + 1) / len(srcs)
        for n, s in enumerate(srcs):
            pale = "0.35" if srcs == [own] else "0.85"
            out.append(f'<rect x="{x0 + a * CELL + n * w:.1f}" y="{y0 + row * CELL}" width="{w:.1f}" '
                       f'height="{CELL - 1}" fill="{colour(s, C)}" fill-opacity="{pale}"/>')
    return out


def _matrix_svg(pic, call, x, y) -> list:
    """Beside a state: the all-to-all that made it, a row per sender, a column per receiver,
    each piece in its sender's colour."""
    out = [_text(x, y, uly_name(call), BOLD), _text(x, y + LINE_H, f"a piece: {uly_piece_bytes(pic, call)}")]
    w = 21 * CHAR_W
    out += [_text(x + (9 + 21 * d) * CHAR_W, y + 2 * LINE_H, f"to rank {d}") for d in range(pic.C)]
    for s in range(pic.C):
        row = y + (3 + s) * LINE_H
        out.append(_text(x, row, f"rank {s}", f' fill="{colour(s, pic.C)}"' + BOLD))
        for d in range(pic.C):
            p = pic.piece(call, s, d)
            label = "kept" if s == d else "-" if p is None else uly_label(pic, p)
            out.append(_text(x + 9 * CHAR_W + d * w, row, label,
                             ' fill="#777777"' if s == d else f' fill="{colour(s, pic.C)}"'))
    return out


def _holding(pic, r) -> str:
    """Under a rank's grid after all-to-all 1: its heads, and where its KV head's copies are."""
    kv = pic.kv_heads[r]
    others = [s for s in range(pic.C) if s != r and set(kv) & set(pic.kv_heads[s])]
    return (f"q{pic.q_heads[r][0]}-{pic.q_heads[r][-1]}, kv{','.join(map(str, kv))}"
            + (f" (copy: r{',r'.join(map(str, others))})" if others else ""))


def uly_svg(pic) -> str:
    """(a) the split; (b) a row of grids per state, the all-to-all's pieces beside it; the heads,
    sums and bytes; the caption; the problems in red."""
    from minipar.parallel.context.ring_attention import positions              # noqa: PLC0415
    C, T, H, Hkv = pic.C, pic.T, pic.shape[1], pic.shape[2]
    owner = {int(i): r for r in range(C) for i in positions(r, C, T, ULY_LAYOUT)}
    x0, gw, gh = 40, T * CELL, (H + Hkv) * CELL
    out = [_text(10, 50, f"(a) the sequence: T = {T} tokens, zig-zag: rank r keeps chunks r and {2 * C - 1}-r "
                         f"of {T // (2 * C)} tokens", BOLD)]
    for i in range(T):
        out += [f'<rect x="{x0 + i * 22}" y="58" width="20" height="18" fill="{colour(owner[i], C)}" '
                f'fill-opacity="0.6"/>', _text(x0 + i * 22 + 10, 71, f"r{owner[i]}", ' text-anchor="middle" '
                                                                                      'font-size="10"'),
                _text(x0 + i * 22 + 10, 90, str(i), ' text-anchor="middle" font-size="9" fill="#555555"')]
    y = 122
    mx = x0 + C * (gw + GAP) + 10
    for n, (title, grids) in enumerate(uly_states(pic)):
        out.append(_text(10, y, f"({'b' + str(n)}) {title}", BOLD))
        for r in range(C):
            gx = x0 + r * (gw + GAP)
            out.append(_text(gx, y + 18, f"rank {r}", f' fill="{colour(r, C)}"' + BOLD))
            out += _grid_svg(pic, gx, y + 24, grids[r], r if n else None, r == 0)
            if n == 1:
                out.append(_text(gx, y + 24 + gh + 14, _holding(pic, r), ' font-size="11"'))
        if n:
            out += _matrix_svg(pic, n - 1, mx, y + 18)
        y += gh + (74 if n == 1 else 60)
    lines = uly_lines(pic)
    blocks = [("heads each rank attends with, read from the pieces (head_split, kv_heads_of)", lines["heads"]),
              ("a KV head's gradient at each rank's last token: the parts sent home, summed", lines["sums"]),
              ("bytes per rank", lines["sent"])]
    for head, body in blocks:
        out.append(_text(10, y, head, BOLD))
        out += [_text(20, y + LINE_H * (k + 1), line) for k, line in enumerate(body)]
        y += LINE_H * (len(body) + 1) + 10
    out += [_text(10, y + LINE_H * k, line) for k, line in enumerate(lines["caption"])]
    y += LINE_H * len(lines["caption"]) + 6
    texts = [pic.title] + lines["caption"] + lines["sums"] + [f"PROBLEM: {p}" for p in pic.problems]
    beside = [uly_name(0), "a piece: " + uly_piece_bytes(pic, 0), " " * (9 + C * 21)]
    width = max(mx + 10 + max(map(len, beside)) * CHAR_W, 20 + max(map(len, texts)) * CHAR_W * 14 / 12)
    height = y + 18 * len(pic.problems) + 10
    head = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'font-family="DejaVu Sans Mono, monospace" font-size="12">',
            f'<rect width="{width:.0f}" height="{height:.0f}" fill="white"/>',
            f'<text x="10" y="22" font-size="14" font-weight="bold">{_esc(pic.title)}</text>']
    return svg_end(head + out, y + 6, pic.problems)
