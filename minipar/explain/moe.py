"""One MoE layer in python -m minipar.explain (moe-dispatch, ep 4, 2 or 4): the run, what its
trace says, and the drawing.

moe-dispatch runs moe.moe_mlp with E = 4 experts, top-2, on N = B T tokens per rank, the
experts placed over the P ranks by expert_parallel.ExpertPlacement (E/P each), with
--capacity-factor F (1.25 by default: a few assignments dropped; 0: no capacity, the
variable all-to-alls), forward and backward of a scalar loss inside a layer span "moe". It
is the trainer's layer, so its all-to-alls go through comm.all_to_all's dispatcher: the
pairwise exchange on 2 or 4 ranks (Bruck only from 7; the reader names any other). Its
inputs mark each token in the first and last element of its row (moe_inputs);
rank 0 adds every rank's routing (moe.Router's choices, weights and kept flags) and the
bytes the layer counted (ExpertPlacement.theory_bytes) to the trace's metadata, gathered
outside the trace. The result is checked against the same layer with every expert on one
process.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from minipar.show.draw import _esc
from minipar.explain.common import BOLD, CHAR_W, LINE_H, PAD, WHATS, ExplainError, _text, colour


# --- mixture of experts: the four all-to-alls of one MoE layer ------------------------------------
#
# The worker (work_moe) runs one MoE layer, moe.moe_mlp, with its E experts split over the
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
MOE_SHAPE = (2, 3, 4)           # moe-dispatch: B, T, C on each rank (N = B T tokens)
MOE_EXPERTS, MOE_TOP_K, MOE_FACTOR = 4, 2, 1.25


# --- the worker (under mpirun) --------------------------------------------------------------------
def work_moe(group, path: str, factor: float):
    """One MoE layer (moe.moe_mlp) with its experts over the P ranks (expert_parallel), forward and
    backward of a scalar loss on this rank's tokens, one layer span; checked against the layer with
    every expert on one process, run on every rank's tokens (expert gradients sum over all of them)."""
    from minipar import comm, trace                           # noqa: PLC0415
    from minipar.show import tracing                                  # noqa: PLC0415
    from minipar.model import moe
    from minipar.model.gpt import FAMILY as GPT2                              # noqa: PLC0415
    from minipar.autograd import ops
    from minipar.parallel.expert import expert_parallel                        # noqa: PLC0415
    from minipar.autograd.tensor import Tensor                                   # noqa: PLC0415
    P, r = group.size, group.rank
    (B, T, C), E, K = MOE_SHAPE, MOE_EXPERTS, MOE_TOP_K
    weights, (xs, probes) = moe_weights(E, C), moe_inputs(P, B, T, C)
    placement = expert_parallel.ExpertPlacement(group, E)

    def layer(x, probe, place):
        """-> (y, dx, {name: gradient}, Decisions) of the layer on x (B, T, C)."""
        params = {n: Tensor(w.copy(), requires_grad=True) for n, w in weights.items()
                  if place is None or place.owns(n)}
        s = moe.MoESettings(E, K, factor, stats=[], placement=place)
        xt = Tensor(x.copy(), requires_grad=True)
        with trace.layer("moe"):
            y = moe.moe_mlp(params, 0, xt, s, GPT2)
        ops.sum(ops.mul(y, Tensor(probe))).backward()
        return y.data, xt.grad, {n: p.grad for n, p in params.items()}, s.stats[0][1]

    tracing.start(group, f"rank {r} ep{r}", peek=True)
    y, dx, grads, decisions = layer(xs[r], probes[r], placement)
    with trace.paused():                                                # the combine weights, for the picture
        x2 = xs[r].reshape(B * T, C)
        w = moe.Router.apply(x2, weights["h.0.mlp.router.weight"], moe.MoESettings(E, K, factor),
                             moe.Decisions(), B * T).data
    with comm.untracked():                                              # not part of the picture
        mine = np.concatenate([decisions.choice.ravel(), w.ravel(), decisions.kept.ravel(),
                               [placement.theory_bytes]]).astype(np.float64)
        every = comm.all_gather(group, mine).reshape(P, -1)
    N = B * T
    routing = [{"choice": row[:N * K].astype(int).reshape(N, K).tolist(),
                "weights": row[N * K:2 * N * K].reshape(N, K).tolist(),
                "kept": row[2 * N * K:3 * N * K].astype(bool).reshape(N, K).tolist()} for row in every]
    tracing.finish(group, path, {"what": "moe-dispatch", "E": E, "K": K, "N": N, "C": C, "factor": factor,
                               "cap": moe.capacity(N, K, E, factor), "routing": routing,
                               "counted": [int(row[-1]) for row in every],
                               "encoding": f"x[i, 0] = x[i, C-1] = (i+1)/{MOE_MARK} for token i"})
    # the same layer on one process, every expert local, on every rank's tokens
    ref = [layer(xs[q], probes[q], None) for q in range(P)]
    want = {"y": ref[r][0], "dx": ref[r][1], "router": ref[r][2]["h.0.mlp.router.weight"]}
    want.update({n: sum(g[2][n] for g in ref) for n in grads if n != "h.0.mlp.router.weight"})
    have = {"y": y, "dx": dx, "router": grads["h.0.mlp.router.weight"], **grads}
    for name, v in want.items():
        if not np.allclose(have[name], v, rtol=1e-12, atol=1e-12):
            raise ExplainError(f"rank {r}: the MoE layer's {name} differs from the one-process layer's by "
                               f"{np.abs(have[name] - v).max():.3g}")


# --- the trace, read ------------------------------------------------------------------------------
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


# --- the drawing ----------------------------------------------------------------------------------
# Six panels from one MoEPicture (moe_picture), top to bottom: (a) the router on each
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
