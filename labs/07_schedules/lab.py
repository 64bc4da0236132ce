"""Lab 07's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): the "gpipe" and "1f1b" entries of minipar.parallel.pipeline.schedules.SCHEDULES,
the table that schedules.schedule() looks a --schedule name up in. PipelineEngine builds its
stage's instruction list through schedule(), so the trainer walks the student's lists.
The child (drive.lists) only records what gpipe and one_f_one_b returned for p = 1..8 stages,
m = 1..16 micro-batches and every stage; here the lists are rebuilt as real instructions
(recorded()) and judged: the rules one stage's list keeps on its own (each micro-batch's
Forward and Backward once, exactly the messages the stage needs, each right beside its op);
minipar's simulator schedules.check (every stage's list run together, messages as FIFO
queues) for deadlocks, message order and the bubble against schedules.bubble_theory; the
activations in flight, counted along each list; and the order of forwards and backwards the
contract gives each schedule.

The student draws a schedule, theirs beside minipar's, with labs/07_schedules/show.py.
"""
import os
from dataclasses import dataclass, field
from numbers import Integral

import numpy as np

from labs.framework import Criterion, load_drive, trainer_flags
from labs.results import Opaque, key
from labs.pipeline_lists import check_placed
from labs.scan import Allowed
from minipar.show import draw
from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.schedules import (Backward, Forward, RecvActivation, RecvGrad, ScheduleError,
                                                 SendActivation, SendGrad)

TITLE = "GPipe and 1F1B pipeline schedules as instruction lists"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
KINDS = drive.KINDS
SMALL = 4                   # up to p = m = SMALL a failure's line also holds the lists or the charts
SHOW = ".venv/bin/python -m labs.07_schedules.show {name} {p} {m} --student YOUR_FILE"
BACKWARD_TIMES = (1.0, 2.0)               # a backward as long as a forward, and twice as long
ALLOWED = Allowed(
    modules={"minipar.parallel.pipeline.schedules": {"Forward", "Backward", "RecvActivation", "SendActivation", "RecvGrad",
                                            "SendGrad", "ScheduleError", "bubble_theory"}},
    refused={f"minipar.parallel.pipeline.schedules.{n}": why for n, why in (
        ("gpipe", "minipar's own GPipe: this lab grades yours"),
        ("one_f_one_b", "minipar's own 1F1B: this lab grades yours"),
        ("naive", "minipar's own schedule: build the lists yourself"),
        ("schedule", "minipar's schedules by name: this lab grades yours"),
        ("SCHEDULES", "minipar's schedules by name: this lab grades yours"),
        ("check", "minipar's simulator: run it beside your file (labs/07_schedules/show.py), not in it"),
        ("programs", "minipar's simulator's lists: build yours yourself"))})


# --- the record, rebuilt ----------------------------------------------------------------------

class Other:
    """An item that is not one of the six instructions, as the child described it."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return self.text

    __str__ = __repr__


def value(d, fn: str):
    """The value drive.described() recorded: the value itself when plain, else an Opaque that
    prints as '<type object>'."""
    if not (isinstance(d, dict) and isinstance(d.get("type"), str)):
        damaged(fn, "an odd value is not described")
    return d["value"] if "value" in d else Opaque(d["type"], f"<{d['type']} object>")


@dataclass
class Returned:
    """What one call returned: the container's kind (drive.CONTAINERS) and, when it is not a
    list, its type's name and a line saying what it is; its items rebuilt (the first drive.items_kept(m)); its length;
    whether a second call returned another object."""
    container: str
    items: list = field(default_factory=list)
    length: int = 0
    fresh: bool = True
    typename: str = "list"
    text: str = "a list"


def damaged(fn: str, why: str):
    raise AssertionError(f"the record of {fn}'s lists is not what the child writes ({why}): "
                         f"the code under test tampered with it")


def recorded(res, fn: str) -> dict:
    """{(p, m, stage): Returned} of the student's function `fn`, from the child's arrays."""
    kinds, mbs, mbtypes, rows, fresh = (res.get(0, key(k, fn)) for k in ("kinds", "mbs", "mbtypes", "rows", "fresh"))
    odd, containers = res.get(0, key("odd", fn)), res.get(0, key("containers", fn))
    calls = drive.stage_cases()
    for name, a, dtype, shape in (("kinds", kinds, np.int8, None), ("mbs", mbs, np.int64, None),
                                  ("mbtypes", mbtypes, np.int8, None),
                                  ("rows", rows, np.int64, (len(calls), 4)), ("fresh", fresh, np.bool_, (len(calls),))):
        if not isinstance(a, np.ndarray) or a.dtype != dtype or (shape and a.shape != shape) or \
                (not shape and a.ndim != 1):
            damaged(fn, f"{name} is {type(a).__name__} {getattr(a, 'dtype', '')} {getattr(a, 'shape', '')}")
    if mbs.shape != kinds.shape or mbtypes.shape != kinds.shape or not isinstance(odd, dict) or \
            not isinstance(containers, dict):
        damaged(fn, "the items' arrays or side tables do not match")
    if kinds.size and (kinds.min() < 0 or kinds.max() > drive.UNKEPT or mbtypes.min() < 0
                       or mbtypes.max() > len(drive.NP_INTS)):
        damaged(fn, "an item's kind or micro-batch type code is out of range")
    kind_list, mb_list, type_list = kinds.tolist(), mbs.tolist(), mbtypes.tolist()
    out = {}
    for row, ((p, m, s), (start, n, length, code), again) in enumerate(zip(calls, rows.tolist(), fresh.tolist())):
        if not (0 <= start and 0 <= n <= min(length, drive.items_kept(m)) and start + n <= len(kind_list)
                and 0 <= code < len(drive.CONTAINERS)):
            damaged(fn, f"row {row} is {(start, n, length, code)}")
        r = Returned(drive.CONTAINERS[code], length=length, fresh=bool(again))
        if code:
            c = containers.get(str(row))
            v = value(c, fn)
            r.typename = c["type"]
            r.text = f"a {c['type']}" if isinstance(v, Opaque) else f"{v!r} (a {c['type']})"
        for i in range(start, start + n):
            r.items.append(item(fn, kind_list[i], mb_list[i], type_list[i], odd.get(str(i))))
        out[(p, m, s)] = r
    return out


def item(fn: str, kind: int, mb: int, mbtype: int, odd):
    """One item rebuilt: the instruction, with its micro-batch and chunk as returned, or an Other."""
    if kind == drive.UNKEPT:
        return Other(f"<an odd item past the first {drive.ODD_KEPT:,} (another type, or an odd micro-batch "
                     f"or chunk): not kept>")
    if kind == drive.OTHER:
        return Other(repr(value(odd, fn)))
    if odd is None:
        if mbtype == 0:
            return KINDS[kind](mb)
        try:
            return KINDS[kind](np.dtype(drive.NP_INTS[mbtype - 1]).type(mb))
        except (OverflowError, ValueError):
            damaged(fn, f"micro-batch {mb} does not fit its type {drive.NP_INTS[mbtype - 1]}")
    if not (isinstance(odd, dict) and "mb" in odd and "chunk" in odd):
        damaged(fn, "an odd item is not described")
    return KINDS[kind](value(odd["mb"], fn), value(odd["chunk"], fn))


def program(r: Returned, what: str, m: int) -> list:
    """The items of a call as a list (as schedules.check would list() them); AssertionError
    when there is nothing to walk or more than a stage can hold."""
    if r.container == "not iterable":
        raise AssertionError(f"{what} returned {r.text}, not a list")
    if r.length > len(r.items):
        many = f"more than {len(r.items)}" if r.container == "iterable" else f"{r.length}"
        raise AssertionError(f"{what} returned {many} items; a stage of m = {m} micro-batches holds at most "
                             f"6m = {6 * m} instructions (each micro-batch's Forward, Backward and four messages)")
    return list(r.items)


class Recorded:
    """A schedule function for schedules.check that returns the recorded lists."""

    def __init__(self, name: str, table: dict):
        self.__name__, self.table = name, table

    def __call__(self, s, p, m):
        return program(self.table[(p, m, s)], drive.describe_call(self.__name__, p, m, s), m)


def functions():
    """(schedule name, the student's function's name) for GPipe and 1F1B."""
    return list(drive.NAMES.items())


def show(prog, limit: int = 40) -> str:
    """A list of instructions as one line: 'RecvAct(0) F0 SendAct(0) ...'."""
    text = " ".join(map(str, prog[:limit]))
    return text + (f" ... ({len(prog)} in all)" if len(prog) > limit else "")


def chart(fn, p: int, m: int, backward_time: float = 1.0) -> str:
    """The simulated Gantt chart (draw.ascii_gantt) as one line, a [row] per stage; '' when
    the case is large or the schedule does not run."""
    if p > SMALL or m > SMALL:
        return ""
    try:
        report = schedules.check(p, m, fn, backward_time=backward_time)
    except (ScheduleError, AssertionError):
        return ""
    return " ".join(f"[{row}]" for row in draw.ascii_gantt(report.timeline, p).splitlines())


# --- well-formed lists ------------------------------------------------------------------------

def why_needed(kind, s: int) -> str:
    return {Forward: "every stage runs each micro-batch's Forward once",
            Backward: "every stage runs each micro-batch's Backward once",
            RecvActivation: f"stage {s} is not the first: each forward's input comes from stage {s - 1}",
            SendActivation: f"stage {s} is not the last: stage {s + 1} needs each micro-batch's output",
            RecvGrad: f"stage {s} is not the last: each backward needs its output's gradient from stage {s + 1}",
            SendGrad: f"stage {s} is not the first: stage {s - 1} needs each micro-batch's input gradient"}[kind]


def why_not(kind, s: int) -> str:
    return {RecvActivation: "the first stage has no previous stage (its input is the batch)",
            SendGrad: "the first stage has no previous stage to send an input gradient to",
            SendActivation: f"stage {s} is the last: there is no next stage",
            RecvGrad: f"stage {s} is the last: its backward starts from the loss"}[kind]


# (earlier, later, why): on one stage, for one micro-batch
ORDER = [(RecvActivation, Forward, "a forward needs its input received first"),
         (Forward, SendActivation, "an output is sent after the forward that computes it"),
         (Forward, Backward, "a backward follows its forward"),
         (SendActivation, Backward, "the executor sends the output it keeps until the backward frees it"),
         (RecvGrad, Backward, "a backward needs its output's gradient received first"),
         (Backward, SendGrad, "an input's gradient is sent after the backward that computes it")]
# each message beside its op: a Recv right before it (+1), a Send right after it (-1)
BESIDE = {RecvActivation: (Forward, +1, "a Recv comes right before the op that needs it"),
          RecvGrad: (Backward, +1, "a Recv comes right before the op that needs it"),
          SendActivation: (Forward, -1, "a Send comes right after the op that made it"),
          SendGrad: (Backward, -1, "a Send comes right after the op that made it")}


def well_formed(r: Returned, fn: str, p: int, m: int, s: int):
    """One stage's list on its own (AssertionError naming the item otherwise)."""
    what = drive.describe_call(fn, p, m, s)
    if r.container != "list":
        raise AssertionError(f"{what} returned {r.text[:200]}, not a list (PipelineEngine walks the list twice)")
    prog = program(r, what, m)
    if not r.fresh:
        raise AssertionError(f"{what} returned the very list object it returned for the same arguments before: "
                             f"return a new list on every call (its caller owns it)")
    context = f"; the list: {show(prog)}"
    at = {}                                     # (kind, mb) -> the items it is at
    for k, ins in enumerate(prog):
        if type(ins) not in KINDS:
            raise AssertionError(f"{what}: item {k} is {ins!r}, not a Forward, Backward, RecvActivation, "
                                 f"SendActivation, RecvGrad or SendGrad of minipar.parallel.pipeline.schedules{context}")
        mb = ins.mb
        if not (isinstance(mb, Integral) and not isinstance(mb, bool)):
            raise AssertionError(f"{what}: item {k} is {ins!r}: micro-batch {mb!r} is not an int{context}")
        if not 0 <= mb < m:
            raise AssertionError(f"{what}: item {k} is {ins!r}: micro-batch {mb!r} is not in 0..{m - 1}{context}")
        chunk = ins.chunk
        if not (isinstance(chunk, Integral) and not isinstance(chunk, bool) and chunk == 0):
            raise AssertionError(f"{what}: item {k} is {ins!r}: chunk {chunk!r}; these schedules have one chunk "
                                 f"of layers per stage: leave chunk at its default 0 "
                                 f"({type(ins).__name__}(mb)){context}")
        at.setdefault((type(ins), int(mb)), []).append(k)
    check_placed(prog, at, KINDS, ORDER, BESIDE, m, s, p, what, context, not_here=why_not,
                 missing=lambda kind, s: f": {why_needed(kind, s)}")


def judge_well_formed(res):
    """Each stage's list on its own: a new list of minipar's six instructions, micro-batches
    ints in 0..m-1 (chunk 0), each Forward and Backward once, one of each message the stage
    needs and none it cannot have, each after what it depends on (ORDER) and right beside
    its op (BESIDE)."""
    for _, fn in functions():
        table = recorded(res, fn)
        for p, m, s in drive.stage_cases():
            well_formed(table[(p, m, s)], fn, p, m, s)


# --- the simulator ----------------------------------------------------------------------------

def judge_no_deadlock(res):
    """Every stage's list run together by schedules.check (eager sends, as the executor's):
    no stage waits forever, and every receive gets the micro-batch it names."""
    for name, fn in functions():
        table = recorded(res, fn)
        for p, m in drive.cases():
            run = Recorded(fn, table)
            try:
                schedules.check(p, m, run)
            except ScheduleError as e:
                report = str(e) if str(e).startswith(f"{fn} p=") else f"{fn} p={p} m={m}: {e}"
                lists = "; ".join(f"stage {s}: {show(run(s, p, m))}" for s in range(p))
                if p <= SMALL and m <= SMALL:
                    lists = f"; the lists: {lists}; minipar's chart: {chart(name, p, m)}"
                else:
                    lists = ""
                raise AssertionError(f"{report}{lists}; draw it: {SHOW.format(name=name, p=p, m=m)}") from None


def peak_in_flight(prog) -> tuple:
    """(the most micro-batches forwarded and not yet backwarded, the item where it is reached)."""
    alive = peak = 0
    where = None
    for k, ins in enumerate(prog):
        if isinstance(ins, Forward):
            alive += 1
            if alive > peak:
                peak, where = alive, k
        elif isinstance(ins, Backward):
            alive -= 1
    return peak, where


def judge_in_flight(res):
    """Activations alive at once on each stage, counted along its list: at most p - s under
    1F1B (PipeDream-Flush's bound), all m under GPipe."""
    ones, gpipes = recorded(res, "one_f_one_b"), recorded(res, "gpipe")
    for p, m in drive.cases():
        for s in range(p):
            prog = program(ones[(p, m, s)], drive.describe_call("one_f_one_b", p, m, s), m)
            peak, k = peak_in_flight(prog)
            if peak > p - s:
                picture = chart(Recorded("one_f_one_b", ones), p, m)
                raise AssertionError(
                    f"one_f_one_b p={p} m={m} stage {s}: {peak} micro-batches' activations alive at item {k} "
                    f"({prog[k]}), 1F1B holds at most p - s = {p - s} on stage {s}"
                    + (f"; yours: {picture}" if picture else "") + f"; the list: {show(prog)}")
            prog = program(gpipes[(p, m, s)], drive.describe_call("gpipe", p, m, s), m)
            peak, k = peak_in_flight(prog)
            if peak != m:
                raise AssertionError(f"gpipe p={p} m={m} stage {s}: at most {peak} micro-batches' activations "
                                     f"alive at once, GPipe holds all m = {m} (every forward before the first "
                                     f"backward); the list: {show(prog)}")


def judge_bubble(res):
    """The simulated idle fraction, 1 - busy / (p * makespan) (schedules.check's report), equals
    schedules.bubble_theory's (p-1)/(m+p-1), with backward as long as forward and twice as long."""
    for name, fn in functions():
        table = recorded(res, fn)
        for p, m in drive.cases():
            run = Recorded(fn, table)
            want = schedules.bubble_theory(name, p, m)
            for backward_time in BACKWARD_TIMES:
                try:
                    r = schedules.check(p, m, run, backward_time=backward_time)
                except ScheduleError as e:
                    raise AssertionError(f"{fn} p={p} m={m} does not run in minipar's simulator ({e}): "
                                         f"see 'no deadlock'") from None
                if abs(r.bubble - want) <= 1e-12:
                    continue
                yours, minipars = chart(run, p, m, backward_time), chart(name, p, m, backward_time)
                raise AssertionError(
                    f"{fn} p={p} m={m}, forward 1 and backward {backward_time:g} time units: simulated "
                    f"bubble {r.bubble:.4f}, theory (p-1)/(m+p-1) = {want:.4f} (difference {r.bubble - want:+.3g}); "
                    f"makespan {r.makespan:g}, theory (m+p-1)(F+B) = {(m + p - 1) * (1 + backward_time):g}"
                    + (f"; yours: {yours}; minipar's: {minipars}" if yours else "")
                    + f"; draw it: {SHOW.format(name=name, p=p, m=m)}")


# --- the order the contract gives -------------------------------------------------------------

def contract_order(fn: str, p: int, m: int, s: int) -> list:
    """[(Forward | Backward, mb, phase)] of stage s as the contract orders them, phase naming
    the rule each comes from."""
    if fn == "gpipe":
        return [(Forward, mb, "GPipe runs every forward first, micro-batches 0, 1, ..., m-1") for mb in range(m)] + \
               [(Backward, mb, "then every backward newest first, m-1, ..., 0: a stage frees its activations "
                               "like a stack") for mb in reversed(range(m))]
    w = min(p - s - 1, m)
    warm = f"warm-up: min(p-s-1, m) = {w} forward(s) on stage {s}, micro-batches 0..{w - 1}"
    steady = "steady state: while forwards remain, the next forward, then the oldest backward"
    cool = "cool-down: the backwards still to do, oldest first"
    out = [(Forward, mb, warm) for mb in range(w)]
    for k in range(m - w):
        out += [(Forward, w + k, steady), (Backward, k, steady)]
    return out + [(Backward, mb, cool) for mb in range(m - w, m)]


def judge_order(res):
    """On every stage, the forwards and backwards in the order the contract gives: GPipe's
    F0 .. F(m-1) B(m-1) .. B0; 1F1B's warm-up, steady state and cool-down, each in
    micro-batch order."""
    for _, fn in functions():
        table = recorded(res, fn)
        for p, m, s in drive.stage_cases():
            what = drive.describe_call(fn, p, m, s)
            prog = program(table[(p, m, s)], what, m)
            ops = [(k, ins) for k, ins in enumerate(prog) if type(ins) in (Forward, Backward)]
            want = contract_order(fn, p, m, s)
            got_line = " ".join(str(ins) for _, ins in ops)
            want_line = " ".join(str(kind(mb)) for kind, mb, _ in want)
            for i, (kind, mb, rule) in enumerate(want):
                if i >= len(ops):
                    raise AssertionError(f"{what}: its forwards and backwards end after {len(ops)}, "
                                         f"{kind(mb)} is wanted next ({rule}); yours: {got_line}; "
                                         f"the contract's: {want_line}")
                k, ins = ops[i]
                if type(ins) is not kind or not (isinstance(ins.mb, Integral) and ins.mb == mb):
                    raise AssertionError(f"{what}: forward/backward number {i} is {ins} (item {k}), the contract "
                                         f"wants {kind(mb)} ({rule}); yours: {got_line}; the contract's: {want_line}")
            if len(ops) > len(want):
                raise AssertionError(f"{what}: {len(ops)} forwards and backwards, the contract's 2m = {2 * m}; "
                                     f"yours: {got_line}")


CRITERIA = [
    Criterion("well-formed lists", run="lists", judge=judge_well_formed, timeout=30,
              uses=("gpipe", "one_f_one_b"),
              hint="wrap each Forward as RecvActivation, Forward, SendActivation and each Backward as RecvGrad, "
                   "Backward, SendGrad, without the messages the first and the last stage have no neighbour for; "
                   "build a new list on every call"),
    Criterion("no deadlock (schedules.check)", run="lists", judge=judge_no_deadlock, timeout=30,
              uses=("gpipe", "one_f_one_b"),
              hint=".venv/bin/python -m labs.07_schedules.show (README, Hints) runs "
                   "minipar.parallel.pipeline.schedules.check on your lists and draws them; a stage must not wait for a "
                   "message its neighbour sends only after it gets one back"),
    Criterion("activations in flight", run="lists", judge=judge_in_flight, timeout=30,
              uses=("gpipe", "one_f_one_b"),
              hint="1F1B's warm-up on stage s is min(p - s - 1, m) forwards; after it, each new forward "
                   "comes with the backward of the oldest micro-batch in flight"),
    Criterion("bubble (p-1)/(m+p-1)", run="lists", judge=judge_bubble, timeout=30,
              uses=("gpipe", "one_f_one_b"),
              hint="idle time comes from a stage waiting longer than it must: draw your chart beside "
                   "minipar's with .venv/bin/python -m labs.07_schedules.show"),
    Criterion("order of forwards and backwards", run="lists", judge=judge_order, timeout=30,
              uses=("gpipe", "one_f_one_b"),
              hint="GPipe: F0 .. F(m-1), then B(m-1) .. B0 on every stage; 1F1B: the warm-up forwards, then "
                   "the next forward and the oldest backward in turn, then the rest of the backwards"),
    Criterion("trainer --pp 4 1f1b", ranks=4, timeout=120,
              trainer=trainer_flags("--pp", "4", "--micro-batches", "8", "--schedule", "1f1b", n_layer=4),
              uses=("one_f_one_b",),
              hint="each rank's minipar.parallel.pipeline.stage.PipelineEngine walks your list for its stage; "
                   "the grader compares the run with its own single-process twin"),
    Criterion("trainer --pp 2 gpipe", ranks=2, timeout=90,
              trainer=trainer_flags("--pp", "2", "--micro-batches", "4", "--schedule", "gpipe"),
              uses=("gpipe",),
              hint="each rank's minipar.parallel.pipeline.stage.PipelineEngine walks your list for its stage; "
                   "the grader compares the run with its own single-process twin"),
]
