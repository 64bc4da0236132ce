"""The schedule checker: run every stage's instruction list together, without MPI, and prove
the schedule sound or raise ScheduleError (schedules.py says what a schedule is).

Messages are FIFO queues per (src rank, dst rank, kind). Eager mode (the default, as the
executor's non-blocking sends): a send never blocks, a receive waits until its message is
there. rendezvous=True: a send also waits until the receiver has posted the matching receive.

Checked, on every rank and for every (chunk, micro-batch): forwarded once, after its input
arrived (unless it is the first virtual stage); backwarded once, after its forward and after
its output's gradient arrived (unless the last virtual stage); with a split backward
(WeightGrad in the list: zero_bubble.py) its W once, after its B, and a W for every B; every
Recv gets the Send of its (chunk, micro-batch); no deadlock. Virtual stages: rank s's chunk c
is virtual stage c*p + s; messages go to the neighbouring virtual stage, so rank p-1's chunk
c sends to rank 0's chunk c + 1 (schedules.neighbour).

The timeline gives every op its earliest start: a forward takes forward_time, a whole
backward backward_time; a split backward's B and W take half of it each, unless
weight_time is given (then B takes backward_time - weight_time); messages take 0. Each time
is one number for every stage, or a list of one per stage (a measured, unbalanced pipeline). The peak
in flight counts micro-batches (times chunks) forwarded and not yet backwarded, or with a
split backward not yet through W: what W still needs is kept until then.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from numbers import Integral

from minipar.parallel.pipeline.instructions import (COMPUTE, RECVS, SENDS, Instruction, ScheduleError,
                                                    SendActivation, WeightGrad, _check_numbers, neighbour)


@dataclass
class Report:
    name: str                   # schedule name (or the function's)
    n_stages: int
    n_micro: int
    ok: bool                    # True: check() raises ScheduleError otherwise
    makespan: float             # end of the last op
    busy: list                  # per stage: time spent in Forward/Backward/WeightGrad
    bubble: float               # idle fraction: 1 - sum(busy) / (n_stages * makespan)
    bubble_theory: float        # schedules.bubble_theory of the named schedule (GPipe's for a function)
    peak_in_flight: list        # per stage: most micro-batches in flight (see the module)
    timeline: list = field(repr=False)   # (stage, kind, mb, start, end), by stage then start;
    #                                      kind "F", "B" or "W", and the chunk after it if > 0 ("F1")
    n_chunks: int = 1

    def summary(self) -> str:
        return (f"{self.name} p={self.n_stages} m={self.n_micro}"
                + (f" V={self.n_chunks}" if self.n_chunks > 1 else "")
                + f": makespan {self.makespan:g}, bubble {self.bubble:.3f} (theory "
                  f"{self.bubble_theory:.3f}), peak in flight {self.peak_in_flight}")


def programs(n_stages: int, n_micro: int, schedule_fn_or_name, virtual: int = 1):
    """(name, every stage's instruction list) of a schedule given by name or as a function
    (stage, n_stages, n_micro[, n_chunks])."""
    from minipar.parallel.pipeline import schedules          # (it imports this module)
    p, m = n_stages, n_micro
    if isinstance(schedule_fn_or_name, str):
        name = schedule_fn_or_name
        return name, [schedules.schedule(name, s, p, m, virtual) for s in range(p)]
    fn = schedule_fn_or_name
    name = getattr(fn, "__name__", "schedule")
    return name, [list(fn(s, p, m) if virtual == 1 else fn(s, p, m, virtual)) for s in range(p)]


def check(n_stages: int, n_micro: int, schedule_fn_or_name, *, virtual: int = 1, rendezvous: bool = False,
          forward_time: float = 1.0, backward_time: float = 2.0, weight_time: float | None = None) -> Report:
    """Simulate all stages of a schedule (virtual: model chunks per rank) and prove it sound,
    or raise ScheduleError (the module docstring)."""
    from minipar.parallel.pipeline import schedules          # (it imports this module)
    _check_numbers(n_stages, n_micro)
    p, m, V = n_stages, n_micro, virtual
    f_t, b_t = _per_stage(forward_time, p), _per_stage(backward_time, p)
    w_t = [b / 2 for b in b_t] if weight_time is None else _per_stage(weight_time, p)
    if not all(f >= 0 and b >= 0 and 0 <= w <= b for f, b, w in zip(f_t, b_t, w_t)):
        raise ValueError(f"op times must be >= 0 (and W's at most the backward's), got forward "
                         f"{forward_time}, backward {backward_time}, weight {weight_time}")
    name, progs = programs(p, m, schedule_fn_or_name, V)
    split = [any(isinstance(i, WeightGrad) for i in prog) for prog in progs]

    pc, clock = [0] * p, [0.0] * p
    queues = defaultdict(deque)                # (src, dst, kind) -> deque of (chunk, mb, time sent)
    done = [{"F": set(), "B": set(), "W": set(), "act": set(), "grad": set(), "sent": set()} for _ in range(p)]
    in_flight, peak, timeline = [0] * p, [0] * p, []

    def where(s):
        return f"stage {s}, instruction {pc[s]} ({progs[s][pc[s]]})"

    def run_op(s, ins):                        # Forward / Backward / WeightGrad: check, then time it
        d, key = done[s], (ins.chunk, ins.mb)
        kind = ins.short
        if key in d[kind]:
            did = {"F": "forwarded", "B": "backwarded", "W": "through W"}[kind]
            raise ScheduleError(f"{where(s)}: micro-batch {ins.mb}"
                                + (f" (chunk {ins.chunk})" if ins.chunk else "") + f" already {did}")
        first = neighbour(s, ins.chunk, -1, p, V) is None
        last = neighbour(s, ins.chunk, +1, p, V) is None
        if kind == "F" and not first and key not in d["act"]:
            raise ScheduleError(f"{where(s)}: forward before RecvAct({ins.mb}) brought its input")
        if kind == "B" and key not in d["F"]:
            raise ScheduleError(f"{where(s)}: backward of micro-batch {ins.mb} before its forward")
        if kind == "B" and not last and key not in d["grad"]:
            raise ScheduleError(f"{where(s)}: backward before RecvGrad({ins.mb}) brought its gradient")
        if kind == "W" and key not in d["B"]:
            raise ScheduleError(f"{where(s)}: W of micro-batch {ins.mb} before its B")
        d[kind].add(key)
        in_flight[s] += 1 if kind == "F" else -1 if kind == ("W" if split[s] else "B") else 0
        peak[s] = max(peak[s], in_flight[s])
        start = clock[s]
        clock[s] += (f_t[s] if kind == "F" else w_t[s] if kind == "W"
                     else b_t[s] - w_t[s] if split[s] else b_t[s])
        timeline.append((s, kind + (str(ins.chunk) if ins.chunk else ""), ins.mb, start, clock[s]))

    def check_message(s, ins):                 # a Send or Recv that is legal on this stage
        to = neighbour(s, ins.chunk, ins.peer, p, V)
        if to is None:
            end, other = ("first", "previous") if ins.peer < 0 else ("last", "next")
            raise ScheduleError(f"{where(s)}: the {end} stage has no {other} stage")
        if isinstance(ins, SENDS):
            produced_by = "F" if isinstance(ins, SendActivation) else "B"
            if (ins.chunk, ins.mb) not in done[s][produced_by]:
                raise ScheduleError(f"{where(s)}: sends micro-batch {ins.mb} before its "
                                    f"{'Forward' if produced_by == 'F' else 'Backward'}")
            if (ins.kind, ins.chunk, ins.mb) in done[s]["sent"]:
                raise ScheduleError(f"{where(s)}: micro-batch {ins.mb} already sent")
        return to

    def receive(s, ins, chunk_got, mb_got, t_sent):   # a Recv completes: match and record it
        src = neighbour(s, ins.chunk, ins.peer, p, V)[0]
        if (chunk_got, mb_got) != (ins.chunk, ins.mb):
            raise ScheduleError(f"{where(s)}: expected {ins.kind} of micro-batch {ins.mb}"
                                + (f" (chunk {ins.chunk})" if V > 1 else "") + f" from stage {src}, "
                                f"but the next message is micro-batch {mb_got}"
                                + (f" (chunk {chunk_got})" if V > 1 else ""))
        done[s][ins.kind].add((ins.chunk, ins.mb))
        clock[s] = max(clock[s], t_sent)

    def step(s) -> bool:                       # advance stage s by one instruction if it can
        ins = progs[s][pc[s]]
        if not isinstance(ins, Instruction) or type(ins) is Instruction:
            raise ScheduleError(f"{where(s)}: not an instruction")
        if not (isinstance(ins.mb, Integral) and 0 <= ins.mb < m):
            raise ScheduleError(f"{where(s)}: micro-batch {ins.mb!r} is not in 0..{m - 1}")
        if not (isinstance(ins.chunk, Integral) and 0 <= ins.chunk < V):
            raise ScheduleError(f"{where(s)}: chunk {ins.chunk!r} is not in 0..{V - 1}")
        if isinstance(ins, COMPUTE):
            run_op(s, ins)
        elif isinstance(ins, SENDS):
            dst, dst_chunk = check_message(s, ins)
            if rendezvous:                     # wait until dst stands at the matching Recv
                other = progs[dst][pc[dst]] if pc[dst] < len(progs[dst]) else None
                if not (isinstance(other, RECVS) and other.kind == ins.kind
                        and neighbour(dst, other.chunk, other.peer, p, V) == (s, ins.chunk)):
                    return False
                t = max(clock[s], clock[dst])
                receive(dst, other, dst_chunk, ins.mb, t)
                clock[s] = t
                pc[dst] += 1
            else:
                queues[(s, dst, ins.kind)].append((dst_chunk, ins.mb, clock[s]))
            done[s]["sent"].add((ins.kind, ins.chunk, ins.mb))
        else:                                  # a Recv
            src, _ = check_message(s, ins)
            q = queues[(src, s, ins.kind)]
            if not q:
                return False                   # the sender is not there yet
            receive(s, ins, *q.popleft())
        pc[s] += 1
        return True

    while any(pc[s] < len(progs[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pc[s] < len(progs[s]) and step(s):
                moved = True
        if not moved:
            raise ScheduleError(f"{name} p={p} m={m} deadlocks ({'rendezvous' if rendezvous else 'eager'} "
                                f"sends): " + "; ".join(_blocked(progs, pc, s, p, V)
                                                        for s in range(p) if pc[s] < len(progs[s])))

    every = {(c, mb) for c in range(V) for mb in range(m)}
    for s in range(p):
        for kind, what in (("F", "Forward"), ("B", "Backward")) + ((("W", "WeightGrad"),) if split[s] else ()):
            missing = sorted(every - done[s][kind])
            if missing:
                shown = [mb for c, mb in missing] if V == 1 else missing
                raise ScheduleError(f"stage {s} never runs {what} of micro-batch(es) {shown}")
    # No message is left over: every Forward (Backward) past the first (last) virtual stage
    # took one from its queue, and each was sent at most once.

    makespan = max(clock)
    busy = [sum(e - b for st, _, _, b, e in timeline if st == s) for s in range(p)]
    theory = schedules.bubble_theory(name, p, m, V) if name in schedules.SCHEDULES \
        else schedules.bubble_theory("gpipe", p, m)
    return Report(name=name, n_stages=p, n_micro=m, ok=True, makespan=makespan, busy=busy,
                  bubble=1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0,
                  bubble_theory=theory, peak_in_flight=peak,
                  timeline=sorted(timeline, key=lambda r: (r[0], r[3])), n_chunks=V)


def _per_stage(t, p: int) -> list:
    """An op time for every stage: one number for all, or a sequence of p."""
    t = list(t) if isinstance(t, (list, tuple)) else [t] * p
    if len(t) != p:
        raise ValueError(f"op times: {len(t)} given for {p} stages")
    return [float(x) for x in t]


def _blocked(progs, pc, s, p, V) -> str:
    """What stage s, stuck at its current instruction, waits for."""
    ins = progs[s][pc[s]]
    peer = neighbour(s, ins.chunk, ins.peer, p, V)[0]
    here = f"stage {s} at instruction {pc[s]} ({ins})"
    there = "finished" if pc[peer] >= len(progs[peer]) else \
        f"at instruction {pc[peer]} ({progs[peer][pc[peer]]})"
    if isinstance(ins, SENDS):
        recv = "RecvAct" if ins.kind == "act" else "RecvGrad"
        return f"{here} waits for stage {peer} ({there}) to post {recv}({ins.mb})"
    send = "SendAct" if ins.kind == "act" else "SendGrad"
    return f"{here} waits for {send}({ins.mb}) from stage {peer} ({there})"

