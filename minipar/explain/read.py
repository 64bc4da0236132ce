"""What the trace of an explained run says (python -m minipar.explain): which piece each
message carried, read from the values on the wire, and the per-step picture that
explain_draw.py draws.

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
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

ROOT = 0                        # broadcast's and reduce's root


@dataclass(frozen=True)
class Spec:
    title: str                  # what the drawing's title calls it
    default_p: int
    algorithm: str = ""         # the trace's name for it (Group.begin's algorithm)
    phases: dict = field(default_factory=dict)      # a receive's op -> the phase it marks


WHATS = {
    "ring-all-reduce": Spec("ring all-reduce", 4, "ring", {"+=": "reduce-scatter", "=": "all-gather"}),
    "reduce-scatter": Spec("ring reduce-scatter", 4, "ring", {"+=": "reduce-scatter"}),
    "all-gather": Spec("ring all-gather", 4, "ring", {"=": "all-gather"}),
    "recursive-doubling": Spec("recursive-doubling all-reduce", 5, "recursive doubling",
                               {"+=": "reduce", "=": "copy back"}),
    "broadcast": Spec(f"binomial-tree broadcast from rank {ROOT}", 4, "binomial tree",
                      {"hdr": "header", "=": "data"}),
    "reduce": Spec(f"binomial-tree reduce to rank {ROOT}", 4, "binomial tree", {"+=": "reduce"}),
    "megatron-mlp": Spec("Megatron MLP", 2),
    "1f1b": Spec("1F1B pipeline", 4),
    "ring-attention": Spec("ring attention", 4),
    "moe-dispatch": Spec("MoE dispatch and combine", 4),
}
COLLECTIVES = [w for w, s in WHATS.items() if s.algorithm]


class ExplainError(Exception):
    """Something the user should read in one line (exit 1)."""


class UsageError(ExplainError):
    """Bad arguments (exit 2)."""


# --- the data on the wire ------------------------------------------------------------------------

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



# --- 1F1B: what the trainer's trace shows --------------------------------------------------

def schedule_phases(instructions: list) -> list[tuple[str, list]]:
    """A 1F1B stage's instructions as [("warm-up", [...]), ("steady", [...]), ("cool-down", [...])]:
    each Recv goes with the Forward/Backward after it, each Send with the one before; warm-up
    ends at the forward paired with the first backward, cool-down starts after the backward
    paired with the last forward."""
    from minipar.parallel.pipeline.schedules import Backward, Forward, SENDS     # noqa: PLC0415
    ops, waiting = [], []
    for ins in instructions:
        if isinstance(ins, (Forward, Backward)):
            ops.append([ins] if not waiting else waiting + [ins])
            waiting = []
        elif isinstance(ins, SENDS):
            ops[-1].append(ins)
        else:
            waiting.append(ins)
    kinds = ["B" if any(isinstance(i, Backward) for i in op) else "F" for op in ops]
    first_b = kinds.index("B") if "B" in kinds else len(ops)
    steady = first_b - 1 if first_b > 0 and kinds[first_b - 1] == "F" else first_b
    last_f = len(kinds) - 1 - kinds[::-1].index("F") if "F" in kinds else -1
    cool = last_f + 2 if last_f + 1 < len(kinds) and kinds[last_f + 1] == "B" else last_f + 1
    cuts = [("warm-up", ops[:steady]), ("steady", ops[steady:cool]), ("cool-down", ops[cool:])]
    return [(name, [i for op in part for i in op]) for name, part in cuts]


def pipeline_picture(trace: dict) -> dict:
    """traceview.pipeline_timeline of the last step, with the theory and each stage's schedule."""
    from minipar.show import traceview                                       # noqa: PLC0415
    from minipar.parallel.pipeline import schedules                              # noqa: PLC0415
    meta = trace["otherData"]["minipar"]
    tl = traceview.pipeline_timeline(trace)
    p, m, name = tl["n_stages"], meta["micro_batches"], tl["schedule"] or meta["schedule"]
    tl["micro_batches"] = m
    tl["theory"] = schedules.bubble_theory(name, p, m)
    tl["stages"] = [schedule_phases(schedules.schedule(name, s, p, m)) for s in range(p)]
    tl["simulated"] = schedules.check(p, m, name).timeline             # F = 1, B = 2 time units
    tl["title"] = (f"{name} pipeline, p={p} stages, m={m} micro-batches, step {tl['step']} as measured: "
                   f"bubble {tl['bubble']:.3f} (theory (p-1)/(m+p-1) = {tl['theory']:.3f})")
    return tl


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
    from minipar.comm.protocol import HEADER_BYTES                        # noqa: PLC0415
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


# --- mixture of experts: the four all-to-alls of one MoE layer ------------------------------------
#
# The worker (explain.work_moe) runs one MoE layer, moe.moe_mlp, with its E experts split over the
# P ranks (expert_parallel: rank j holds experts j E/P .. (j+1) E/P - 1), forward and backward. The
# inputs name their tokens: token n of rank r is token i = r N + n, and the first and last elements
# of its row are (i + 1)/MOE_MARK (exact in float64), the rest N(0, 1). A dispatch message is rows
# of x, so its first value names its first row's token and its last value its last row's (0: an
# empty capacity slot, a padding row of zeros). The other all-to-alls carry expert outputs and
# gradients: which rows they hold is derived (the dispatch's rows, back the other way, and the same
# two again in backward); their peers and sizes are read and checked. The routing (each token's K
# experts, weights and kept flags, from moe.Router) is gathered into the trace's metadata outside
# the trace.

MOE_MARK = 64
MOE_CALLS = {True: ("dispatch", "combine", "combine backward", "dispatch backward"),      # with a capacity
             False: ("dispatch", "counts", "combine", "combine backward", "dispatch backward")}
MOE_TO_EXPERTS = ("dispatch", "combine backward")       # token rows (x, then dy) go to the experts' ranks


def moe_inputs(p: int, B: int, T: int, C: int):
    """x and the loss's probe, (p, B, T, C) each: every rank's tokens, N(0, 1) seed 0 (the same on
    every rank), the first and last element of token i's row (i + 1)/MOE_MARK, i = r B T + b T + t."""
    x, probe = np.random.default_rng(0).standard_normal((2, p, B, T, C))
    mark = (np.arange(p * B * T) + 1.0).reshape(p, B, T) / MOE_MARK
    x[..., 0] = x[..., -1] = mark
    return x, probe


def moe_weights(E: int, C: int) -> dict:
    """{canonical name: array} of one MoE block (block 0): the router (C, E) and E expert MLPs,
    seed 1, the same on every rank."""
    rng = np.random.default_rng(1)
    out = {"h.0.mlp.router.weight": rng.standard_normal((C, E))}
    for e in range(E):
        h = f"h.0.mlp.experts.{e}."
        out.update({h + "c_fc.weight": rng.standard_normal((C, 4 * C)) / np.sqrt(C),
                    h + "c_fc.bias": 0.1 * rng.standard_normal(4 * C),
                    h + "c_proj.weight": rng.standard_normal((4 * C, C)) / np.sqrt(4 * C),
                    h + "c_proj.bias": 0.1 * rng.standard_normal(C)})
    return out


def moe_token(value: float, tokens: int) -> int | None:
    """The token a marker names; None for 0.0 (an empty slot); ValueError for anything else."""
    if value == 0.0:
        return None
    i = value * MOE_MARK - 1
    if not float(i).is_integer() or not 0 <= i < tokens:
        raise ValueError(f"{value!r} is no token marker (i+1)/{MOE_MARK}, i in 0..{tokens - 1}")
    return int(i)


@dataclass
class MoEPicture:
    P: int                      # ranks of the ep group
    E: int
    K: int
    N: int                      # tokens per rank
    C: int
    factor: float               # the capacity factor F (--capacity-factor); 0: no capacity
    cap: int | None             # slots per expert (moe.capacity), None without a capacity
    routing: list               # per rank: {"choice", "weights", "kept", "slot"} (N, K) arrays, and
                                # "order": moe.assignments' (tokens, rows per expert)
    rows: dict                  # (src, dst) -> per expert of dst: [token id, or None for an empty slot]
    sent: dict                  # (call, src, dst) -> bytes of its data message in the trace
    ends: dict                  # (src, dst) -> (first, last) token read off the dispatch message
    calls: tuple                # the all-to-alls in each rank's order (MOE_CALLS)
    bytes: dict                 # rank -> {call: bytes sent, "total", "ep_bytes", "counted"}
    title: str = ""
    problems: list = field(default_factory=list)

    @property
    def per_rank(self) -> int:
        return self.E // self.P

    def flat(self, src: int, dst: int) -> list:
        """The rows src dispatches to dst, in order: token ids, None for an empty slot."""
        return [t for rows in self.rows[(src, dst)] for t in rows]


def _moe_routing(meta: dict, problems: list) -> list:
    """Each rank's routing from the metadata, and where each kept assignment sits in its expert's
    slots: slot (N, K), -1 for a dropped one. The kept flags must follow the claim order."""
    from minipar.model import moe                                             # noqa: PLC0415
    E, K, cap = meta["E"], meta["K"], meta["cap"]
    out = []
    for r, got in enumerate(meta["routing"]):
        choice, kept = np.array(got["choice"], np.int64), np.array(got["kept"], bool)
        want = moe.claim_slots(choice, E, cap)
        if not np.array_equal(kept, want):
            n, k = np.argwhere(kept != want)[0]
            problems.append(f"rank {r}: token {n}'s choice {k + 1} (expert {choice[n, k]}) is "
                            f"{'kept' if kept[n, k] else 'dropped'}; the claim order (moe.claim_slots) "
                            f"{'keeps' if want[n, k] else 'drops'} it")
        tokens, slots, rows = moe.assignments(moe.Decisions(choice=choice, kept=kept), E)
        slot = np.full(choice.shape, -1, np.int64)
        starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
        for m, s in enumerate(slots):                                   # expert-major: m - start = slot
            slot[s // K, s % K] = m - starts[choice[s // K, s % K]]
        out.append({"choice": choice, "weights": np.array(got["weights"]), "kept": kept, "slot": slot,
                    "order": (tokens, rows)})
    return out


def _moe_rows(pic: MoEPicture) -> None:
    """rows[(src, dst)]: the rows src dispatches to dst, expert by expert (expert_parallel's
    layout): each kept assignment's token in slot order, padded to cap with empty slots."""
    for src, route in enumerate(pic.routing):
        tokens, rows = route["order"]
        per_expert = np.split(tokens + src * pic.N, np.cumsum(rows)[:-1])
        for dst in range(pic.P):
            mine = per_expert[dst * pic.per_rank:(dst + 1) * pic.per_rank]
            pic.rows[(src, dst)] = [[int(t) for t in ts] + ([None] * (pic.cap - len(ts)) if pic.cap else [])
                                    for ts in mine]


def _moe_calls(trace: dict, pic: MoEPicture, problems: list) -> dict:
    """rank -> its all_to_all calls' args in time order, named by pic.calls."""
    from minipar.show import traceview                                       # noqa: PLC0415
    out = {}
    for r in range(pic.P):
        mine = sorted(traceview.spans(trace, "comm", r), key=lambda e: e["ts"])
        args = [e["args"] for e in mine if e["args"]["op"] == "all_to_all"]
        if len(args) != len(pic.calls) or len(mine) != len(args):
            problems.append(f"rank {r}: {len(mine)} comm calls, {len(args)} all_to_all, not the "
                            f"{len(pic.calls)} all-to-alls {', '.join(pic.calls)}")
        for a in args:
            if a["algorithm"] != "pairwise exchange":
                problems.append(f"rank {r}: an all_to_all ran {a['algorithm']!r}: the picture reads the "
                                f"pairwise exchange's one message per peer")
        out[r] = dict(zip(pic.calls, args))
    return out


def _moe_expected_rows(pic: MoEPicture, call: str, src: int, dst: int) -> int:
    """Rows of C elements `call` carries from src to dst: the dispatch's rows src -> dst toward the
    experts, back the other way for combine and dispatch backward."""
    pair = (src, dst) if call in MOE_TO_EXPERTS else (dst, src)
    return len(pic.flat(*pair))


def _moe_messages(calls: dict, pic: MoEPicture, problems: list) -> None:
    """Every data message's size against the routing; the dispatch's ends decoded; each receive
    against its send."""
    P, row_bytes = pic.P, 8 * pic.C
    for r, named in calls.items():
        for call, a in named.items():
            data = [m for m in a["messages"] if m[1] == "send" and (pic.cap or call == "counts" or m[0] >= P)]
            for step, _, dst, nbytes, *values in data:
                pic.sent[(call, r, dst)] = nbytes
                if call == "dispatch" and values:
                    try:
                        pic.ends[(r, dst)] = tuple(moe_token(v, P * pic.N) for v in values)
                    except ValueError as err:
                        problems.append(f"dispatch: rank {r} -> {dst}: {err}")
            for dst in range(P):
                if dst == r:
                    continue
                want = 8 * pic.per_rank if call == "counts" else _moe_expected_rows(pic, call, r, dst) * row_bytes
                got = pic.sent.get((call, r, dst), 0)
                if got != want:
                    problems.append(f"{call}: rank {r} sends {got} B to rank {dst}, not {want} B "
                                    + ("(E/P row counts)" if call == "counts" else
                                       f"({want // row_bytes} rows of C = {pic.C} float64)"))
    for r, named in calls.items():                  # every send is known: each receive takes one
        for call, a in named.items():
            for step, kind, src, nbytes, *_ in a["messages"]:
                if kind == "recv" and (pic.cap or call == "counts" or step >= P) and \
                        pic.sent.get((call, src, r)) != nbytes:
                    problems.append(f"{call}: rank {r} receives {nbytes} B from rank {src}, which sent it "
                                    f"{pic.sent.get((call, src, r), 0)} B")
    for (src, dst), ends in pic.ends.items():
        rows = pic.flat(src, dst)
        want = (rows[0], rows[-1]) if rows else None
        if ends != want:
            name = ", ".join("an empty slot" if t is None else f"t{t}" for t in ends)
            problems.append(f"dispatch: rank {src} -> {dst} carries {name} first and last; its routing puts "
                            + (", ".join("an empty slot" if t is None else f"t{t}" for t in want)
                               if want else "no row") + " there")


def _moe_bytes(calls: dict, pic: MoEPicture, counted: list, problems: list) -> None:
    """Each rank's bytes, all-to-all by all-to-all, against expert_parallel.ep_bytes for its routing
    and against what the layer itself counted (ExpertPlacement.theory_bytes)."""
    from types import SimpleNamespace                                   # noqa: PLC0415
    from minipar.parallel.expert.expert_parallel import Sent, ep_bytes         # noqa: PLC0415
    group = Sent(SimpleNamespace(size=pic.P, n_nodes=1))                # what ep_bytes asks of a group
    for r in range(pic.P):
        mine = {call: a["bytes_sent"] for call, a in calls[r].items()}
        if pic.cap:
            want = ep_bytes(group, 8 * pic.C, 2, padded=np.empty((pic.E * pic.cap, pic.C)))
        else:
            out = sum(len(pic.flat(r, j)) for j in range(pic.P) if j != r)
            back = sum(len(pic.flat(s, r)) for s in range(pic.P) if s != r)
            want = ep_bytes(group, 8 * pic.C, 2, None, out, back, np.zeros(pic.E, np.int64))
        pic.bytes[r] = {**mine, "total": sum(mine.values()), "ep_bytes": want, "counted": counted[r]}
        if len({pic.bytes[r]["total"], want, counted[r]}) > 1:
            problems.append(f"rank {r} sends {pic.bytes[r]['total']} B in its all-to-alls; "
                            f"ep_bytes says {want} B, the layer counted {counted[r]} B")


def moe_picture(trace: dict) -> MoEPicture:
    """The MoE worker's trace, read (the comment above): each rank's routing, the rows of every
    message, and the checks that the wire, the routing and ep_bytes agree."""
    meta = trace["otherData"]["minipar"]
    problems = []
    pic = MoEPicture(meta["world"], meta["E"], meta["K"], meta["N"], meta["C"], meta["factor"], meta["cap"],
                     _moe_routing(meta, problems), {}, {}, {}, MOE_CALLS[meta["cap"] is not None], {},
                     problems=problems)
    _moe_rows(pic)
    calls = _moe_calls(trace, pic, problems)
    _moe_messages(calls, pic, problems)
    _moe_bytes(calls, pic, meta["counted"], problems)
    P, E, K, N = pic.P, pic.E, pic.K, pic.N
    cap = (f"capacity ceil({pic.factor:g}·{N}·{K}/{E}) = {pic.cap} slots per expert" if pic.cap
           else "no capacity (nothing dropped)")
    totals = sorted({b["total"] for b in pic.bytes.values()})
    pic.title = (f"{WHATS['moe-dispatch'].title}, ep={P}: E={E} experts ({pic.per_rank} per rank), top-{K}, "
                 f"{N} tokens per rank, C={pic.C} float64, {cap}: {len(pic.calls)} all-to-alls, "
                 f"{'/'.join(map(str, totals))} B sent per rank")
    return pic
