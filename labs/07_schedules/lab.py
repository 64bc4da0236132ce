"""Lab 07's seam and criteria (labs/framework.py says what a lab is).

Seam: the "gpipe" and "1f1b" entries of minipar.parallel.schedules.SCHEDULES, the table that
schedules.schedule() looks a --schedule name up in when it is called. PipelineEngine builds
its stage's instruction list through schedule(), so the trainer walks the student's lists.
Oracle, without MPI until the trainer, for p = 1..8 stages and m = 1..16 micro-batches: the
rules one stage's list must keep on its own (each micro-batch's Forward and Backward once,
exactly the messages the stage needs, each after what it depends on); minipar's simulator
schedules.check (every stage's list run together, messages as FIFO queues) for deadlocks,
message order and the bubble against schedules.bubble_theory; and the activations in
flight, counted by walking each list.

Draw a schedule, the student's beside minipar's (the lists, the simulator's verdict, the
Gantt charts):   python -m labs.07_schedules.lab 1f1b 3 4 --student PATH
"""
import argparse
import os
import re
from numbers import Integral

from labs import framework
from labs.framework import Criterion, extra_cases, trainer_flags
from minipar import draw
from minipar.parallel import schedules
from minipar.parallel.schedules import (Backward, Forward, RecvActivation, RecvGrad, ScheduleError, SendActivation,
                                        SendGrad)

TITLE = "GPipe and 1F1B pipeline schedules as instruction lists"
HERE = os.path.dirname(os.path.abspath(__file__))
NAMES = {"gpipe": "gpipe", "1f1b": "one_f_one_b"}      # --schedule name -> the student's function
KINDS = (Forward, Backward, RecvActivation, SendActivation, RecvGrad, SendGrad)
SMALL = 4                   # up to p = m = SMALL a failure's line also holds the lists or the charts
SHOW = "python -m labs.07_schedules.lab {name} {p} {m} --student YOUR_FILE"


def cases() -> list:
    """(p, m) for p = 1..8 stages and m = 1..16 micro-batches, the smallest p first; and a
    teacher's extra "n_stages" and "n_micro" ($MINIPAR_LAB_EXTRA/07_schedules/cases.json)."""
    extra = extra_cases(HERE)
    ps = sorted({*range(1, 9), *map(int, extra.get("n_stages", []))})
    ms = sorted({*range(1, 17), *map(int, extra.get("n_micro", []))})
    return [(p, m) for p in ps for m in ms]


def functions(student):
    """(schedule name, the student's function) for GPipe and 1F1B."""
    return [(name, getattr(student, attr)) for name, attr in NAMES.items()]


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
    except ScheduleError:
        return ""
    return " ".join(f"[{row}]" for row in draw.ascii_gantt(report.timeline, p).splitlines())


# --- the criteria -----------------------------------------------------------------------------

def needed(kind, s: int, p: int) -> bool:
    """Does stage s of p hold one `kind` instruction per micro-batch?"""
    if kind in (RecvActivation, SendGrad):
        return s > 0
    if kind in (SendActivation, RecvGrad):
        return s < p - 1
    return True


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


def check_well_formed(student):
    """Each stage's list on its own: a list of minipar's six instructions, micro-batches in
    0..m-1, each Forward and Backward once, one of each message the stage needs and none it
    cannot have, and each after what it depends on (ORDER)."""
    for _, fn in functions(student):
        for p, m in cases():
            for s in range(p):
                what = f"{fn.__name__}(stage={s}, n_stages={p}, n_micro={m})"
                prog = fn(s, p, m)
                assert type(prog) is list, \
                    f"{what} returned a {type(prog).__name__}, not a list (PipelineEngine walks the list twice)"
                context = f"; the list: {show(prog)}"
                at = {}                                     # (kind, mb) -> the items it is at
                for k, ins in enumerate(prog):
                    assert type(ins) in KINDS, \
                        f"{what}: item {k} is {ins!r}, not a Forward, Backward, RecvActivation, SendActivation, " \
                        f"RecvGrad or SendGrad of minipar.parallel.schedules{context}"
                    mb = ins.mb
                    assert isinstance(mb, Integral) and not isinstance(mb, bool) and 0 <= mb < m, \
                        f"{what}: item {k} is {ins!r}: micro-batch {mb!r} is not in 0..{m - 1}{context}"
                    at.setdefault((type(ins), int(mb)), []).append(k)
                for kind in KINDS:
                    want = 1 if needed(kind, s, p) else 0
                    for mb in range(m):
                        ks = at.get((kind, mb), [])
                        if len(ks) == want:
                            continue
                        if want == 0:
                            problem = f"{kind(mb)} at item {ks[0]}, but {why_not(kind, s)}"
                        elif not ks:
                            problem = f"no {kind(mb)}: {why_needed(kind, s)}"
                        else:
                            problem = f"{kind(mb)} {len(ks)} times (items {ks}), once wanted"
                        raise AssertionError(f"{what}: {problem}{context}")
                for first, then, why in ORDER:
                    for mb in range(m):
                        a, b = at.get((first, mb)), at.get((then, mb))
                        if a and b and a[0] > b[0]:
                            raise AssertionError(f"{what}: {first(mb)} at item {a[0]} comes after {then(mb)} "
                                                 f"at item {b[0]}: {why}{context}")


def check_no_deadlock(student):
    """Every stage's list run together by schedules.check (eager sends, as the executor's):
    no stage waits forever, and every receive gets the micro-batch it names."""
    for name, fn in functions(student):
        for p, m in cases():
            try:
                schedules.check(p, m, fn)
            except ScheduleError as e:
                report = str(e) if str(e).startswith(f"{fn.__name__} p=") else f"{fn.__name__} p={p} m={m}: {e}"
                lists = "; ".join(f"stage {s}: {show(fn(s, p, m))}" for s in range(p))
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


def check_in_flight(student):
    """Activations alive at once on each stage, counted along its list: at most p - s under
    1F1B (PipeDream-Flush's bound), all m under GPipe."""
    for p, m in cases():
        for s in range(p):
            prog = student.one_f_one_b(s, p, m)
            peak, k = peak_in_flight(prog)
            if peak > p - s:
                picture = chart(student.one_f_one_b, p, m)
                raise AssertionError(
                    f"one_f_one_b p={p} m={m} stage {s}: {peak} micro-batches' activations alive at item {k} "
                    f"({prog[k]}), 1F1B holds at most p - s = {p - s} on stage {s}"
                    + (f"; yours: {picture}" if picture else "") + f"; the list: {show(prog)}")
            prog = student.gpipe(s, p, m)
            peak, k = peak_in_flight(prog)
            if peak != m:
                raise AssertionError(f"gpipe p={p} m={m} stage {s}: at most {peak} micro-batches' activations "
                                     f"alive at once, GPipe holds all m = {m} (every forward before the first "
                                     f"backward); the list: {show(prog)}")


def check_bubble(student):
    """The simulated idle fraction, 1 - busy / (p * makespan) (schedules.check's report), equals
    schedules.bubble_theory's (p-1)/(m+p-1), with backward as long as forward and twice as long."""
    for name, fn in functions(student):
        for p, m in cases():
            want = schedules.bubble_theory(name, p, m)
            for backward_time in (1.0, 2.0):
                r = schedules.check(p, m, fn, backward_time=backward_time)
                if abs(r.bubble - want) <= 1e-12:
                    continue
                yours, minipars = chart(fn, p, m, backward_time), chart(name, p, m, backward_time)
                raise AssertionError(
                    f"{fn.__name__} p={p} m={m}, forward 1 and backward {backward_time:g} time units: simulated "
                    f"bubble {r.bubble:.4f}, theory (p-1)/(m+p-1) = {want:.4f} (difference {r.bubble - want:+.3g}); "
                    f"makespan {r.makespan:g}, theory (m+p-1)(F+B) = {(m + p - 1) * (1 + backward_time):g}"
                    + (f"; yours: {yours}; minipar's: {minipars}" if yours else "")
                    + f"; draw it: {SHOW.format(name=name, p=p, m=m)}")


def install(student):
    """schedule("gpipe" | "1f1b", ...) builds the student's lists (PipelineEngine asks it once
    per rank); counter() is how many lists were built here."""
    calls = [0]

    def seam(fn):
        def build(stage, n_stages, n_micro):
            calls[0] += 1
            return fn(stage, n_stages, n_micro)
        build.__name__ = fn.__name__
        return build

    for name, fn in functions(student):
        schedules.SCHEDULES[name] = seam(fn)
    return lambda: calls[0]



CRITERIA = [
    Criterion("well-formed lists", check=check_well_formed, timeout=30,
              hint="wrap each Forward as RecvActivation, Forward, SendActivation and each Backward as RecvGrad, "
                   "Backward, SendGrad, without the messages the first and the last stage have no neighbour for"),
    Criterion("no deadlock (schedules.check)", check=check_no_deadlock, timeout=30,
              hint="minipar.parallel.schedules.check(p, m, your_function) gives this report without the "
                   "grader; a stage must not wait for a message its neighbour sends only after it gets one back"),
    Criterion("activations in flight", check=check_in_flight, timeout=30,
              hint="1F1B's warm-up on stage s is min(p - s - 1, m) forwards; after it, each new forward "
                   "comes with the backward of the oldest micro-batch in flight"),
    Criterion("bubble (p-1)/(m+p-1)", check=check_bubble, timeout=30,
              hint="idle time comes from a stage waiting longer than it must: compare your chart with "
                   "minipar.draw.ascii_gantt(minipar.parallel.schedules.check(p, m, '1f1b').timeline, p)"),
    Criterion("trainer --pp 4 1f1b --verify", ranks=4, timeout=120,
              trainer=trainer_flags("--pp", "4", "--micro-batches", "8", "--schedule", "1f1b", n_layer=4),
              hint="each rank's minipar.parallel.pipeline.PipelineEngine walks your list for its stage; "
                   "--verify compares the run with one process"),
    Criterion("trainer --pp 2 gpipe --verify", ranks=2, timeout=90,
              trainer=trainer_flags("--pp", "2", "--micro-batches", "4", "--schedule", "gpipe"),
              hint="each rank's minipar.parallel.pipeline.PipelineEngine walks your list for its stage; "
                   "--verify compares the run with one process"),
]


# --- python -m labs.07_schedules.lab NAME P M [--student PATH]: see a schedule ---------------------

def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m labs.07_schedules.lab",
                                 description="Print each stage's list of a schedule, the simulator's verdict "
                                             "and the Gantt chart, beside minipar's.")
    ap.add_argument("schedule", choices=tuple(NAMES))
    ap.add_argument("n_stages", type=int)
    ap.add_argument("n_micro", type=int)
    ap.add_argument("--student", metavar="PATH", default=os.path.join(HERE, "student.py"),
                    help="the file [labs/07_schedules/student.py]")
    ap.add_argument("--backward-time", type=float, default=1.0, help="a backward's length, a forward's is 1 [1]")
    args = ap.parse_args(argv)
    p, m, name = args.n_stages, args.n_micro, args.schedule
    fn = getattr(framework.load(args.student, "student"), NAMES[name])
    stuck = {}
    try:
        report = schedules.check(p, m, fn, backward_time=args.backward_time)
        verdict = report.summary()
    except ScheduleError as e:
        report, verdict = None, f"ScheduleError: {e}"
        stuck = {int(s): int(k) for s, k in re.findall(r"stage (\d+),? (?:at )?instruction (\d+)", str(e))}
    print(f"{fn.__name__}, p={p} stages, m={m} micro-batches (>> marks where a stage is stuck):")
    for s in range(p):
        prog = list(fn(s, p, m))
        print(f"  stage {s}: " + " ".join((">>" if stuck.get(s) == k else "") + str(ins) for k, ins in enumerate(prog)))
    print(verdict)
    if report is not None:
        print(draw.ascii_gantt(report.timeline, p))
    ref = schedules.check(p, m, name, backward_time=args.backward_time)
    print(f"minipar's {name}: {ref.summary()}")
    print(draw.ascii_gantt(ref.timeline, p))


if __name__ == "__main__":
    main()
