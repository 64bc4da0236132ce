"""Pipeline schedules as data: what each stage does, in order, written as plain instructions.

A pipeline cuts the layers into p *stages* (one per pp rank) and the batch into m
*micro-batches*. A schedule is, for each stage, a list of instructions executed in order:

    Forward(mb)         run this stage's layers on micro-batch mb, keep the activations
    Backward(mb)        backpropagate mb through this stage, free its activations
    SendActivation(mb)  this stage's output of mb  -> next stage      (not on the last)
    RecvActivation(mb)  the input of mb            <- previous stage  (not on the first)
    SendGrad(mb)        gradient of this stage's input for mb -> previous stage (not first)
    RecvGrad(mb)        gradient of this stage's output for mb <- next stage    (not last)

A Recv comes right before the Forward/Backward that needs it, a Send right after the op
that produced it. Because a schedule is data (ShallowSpeed's idea), it can be printed,
checked for deadlock and drawn without MPI: `check()` runs every stage's list together,
with messages as FIFO queues, and draw.ascii_gantt() draws the timeline. An executor over
MPI (parallel/pipeline.py) only has to walk its own stage's list.

The three schedules, p=4 stages, m=8 micro-batches, F and B one time unit each
(`draw.ascii_gantt(check(4, 8, name, backward_time=1).timeline, 4)`; '.' is an idle stage):

naive: one micro-batch at a time, forward down the pipe and backward up, then the next
(the first 2 of the 8 micro-batches shown). Only one stage ever works.

    stage 0 |F0............B0F1............B1 ...
    stage 1 |..F0........B0....F1........B1.. ...
    stage 2 |....F0....B0........F1....B1.... ...
    stage 3 |......F0B0............F1B1...... ...

GPipe (Huang et al. 2019): all forwards, then all backwards. Backwards run in reverse
micro-batch order: the last stage starts with the micro-batch it has just forwarded, and
each stage frees its activations like a stack (in order would take the same time).

    stage 0 |F0F1F2F3F4F5F6F7............B7B6B5B4B3B2B1B0
    stage 1 |..F0F1F2F3F4F5F6F7........B7B6B5B4B3B2B1B0..
    stage 2 |....F0F1F2F3F4F5F6F7....B7B6B5B4B3B2B1B0....
    stage 3 |......F0F1F2F3F4F5F6F7B7B6B5B4B3B2B1B0......

1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM's non-interleaved schedule):
stage s does min(p-s-1, m) warm-up forwards, then alternates one forward and one backward,
then finishes the remaining backwards (cool-down). Same time as GPipe, but stage s never
holds more than p-s micro-batches of activations (GPipe holds all m).

    stage 0 |F0F1F2F3......B0F4B1F5B2F6B3F7B4..B5..B6..B7
    stage 1 |..F0F1F2....B0F3B1F4B2F5B3F6B4F7B5..B6..B7..
    stage 2 |....F0F1..B0F2B1F3B2F4B3F5B4F6B5F7B6..B7....
    stage 3 |......F0B0F1B1F2B2F3B3F4B4F5B5F6B6F7B7......

The bubble. GPipe and 1F1B keep each stage idle for p-1 forward slots while the pipe
fills and p-1 backward slots while it drains, beside m of each doing work:

    bubble = idle / (p * makespan) = (p-1) / (m+p-1)            (0.273 for p=4, m=8)

exactly with F = B (and, in this simulation, with B = 2F too). The naive schedule wastes
(p-1)/p (0.75 for p=4), whatever m. More micro-batches shrink the bubble; 1F1B's gain
over GPipe is memory, not time. bubble_theory() below is this formula (the executor's
summary and the planner both take it from there).

Sends in the executor. With a Recv right before its op and a Send right after its op,
1F1B's steady state has neighbours s and s+1 each *sending* to the other at the same
moment (activation of one micro-batch down, gradient of another up). If a send blocks
until its receive is posted (MPI's rendezvous protocol, used for large messages), they
deadlock: `check(p, m, "1f1b", rendezvous=True)` raises ScheduleError whenever p >= 2 and
m >= 2 (tested to p=8, m=16). Megatron posts both at once (`send_forward_recv_backward`,
batched isend/irecv). Here the executor must post each Send without waiting for it (an
Isend whose buffer is kept until it completes, at the latest before the optimizer step):
the eager mode of `check()`, in which sends never block and receives wait. naive and
GPipe pass both modes.

Also here: `partition()`, the contiguous layer split, and `stage_param_names()`, the
canonical parameter names (docs/design.md §2) a stage owns.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field
from numbers import Integral

from minipar.model import GPTConfig, param_specs


class ScheduleError(ValueError):
    """A schedule that deadlocks, loses or duplicates a micro-batch, or mismatches a message."""


# --------------------------------------------------------------------------------------------
# Instructions. `peer` and `kind` tell the checker (and the executor) where a message goes.

@dataclass(frozen=True)
class Instruction:
    mb: int                     # micro-batch index, 0 .. m-1
    short = "?"

    def __str__(self):
        return f"{self.short}({self.mb})"


@dataclass(frozen=True)
class Forward(Instruction):
    short = "F"

    def __str__(self):
        return f"F{self.mb}"


@dataclass(frozen=True)
class Backward(Instruction):
    short = "B"

    def __str__(self):
        return f"B{self.mb}"


@dataclass(frozen=True)
class SendActivation(Instruction):
    short, kind, peer = "SendAct", "act", +1      # to the next stage


@dataclass(frozen=True)
class RecvActivation(Instruction):
    short, kind, peer = "RecvAct", "act", -1      # from the previous stage


@dataclass(frozen=True)
class SendGrad(Instruction):
    short, kind, peer = "SendGrad", "grad", -1    # to the previous stage


@dataclass(frozen=True)
class RecvGrad(Instruction):
    short, kind, peer = "RecvGrad", "grad", +1    # from the next stage


SENDS, RECVS = (SendActivation, SendGrad), (RecvActivation, RecvGrad)


def _check_numbers(n_stages, n_micro, stage=None):
    for what, v in (("n_stages", n_stages), ("n_micro", n_micro)):
        if not isinstance(v, Integral) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{what} must be an integer >= 1, got {v!r}")
    if stage is not None and (not isinstance(stage, Integral) or not 0 <= stage < n_stages):
        raise ValueError(f"stage must be in 0..{n_stages - 1} for {n_stages} stages, got {stage!r}")


def _forward(stage, n_stages, mb):
    """Receive the input (unless first stage), forward, send the output (unless last)."""
    return ([RecvActivation(mb)] if stage > 0 else []) + [Forward(mb)] + \
           ([SendActivation(mb)] if stage < n_stages - 1 else [])


def _backward(stage, n_stages, mb):
    """Receive the output's gradient (unless last stage), backward, send the input's (unless first)."""
    return ([RecvGrad(mb)] if stage < n_stages - 1 else []) + [Backward(mb)] + \
           ([SendGrad(mb)] if stage > 0 else [])


# --------------------------------------------------------------------------------------------
# The three schedules: (stage, n_stages, n_micro) -> this stage's instructions, in order.

def naive(stage: int, n_stages: int, n_micro: int) -> list:
    """One micro-batch at a time: its forward and backward on every stage before the next.
    Each stage's list is just F then B per micro-batch; the messages make it sequential."""
    _check_numbers(n_stages, n_micro, stage)
    return [ins for mb in range(n_micro)
            for ins in _forward(stage, n_stages, mb) + _backward(stage, n_stages, mb)]


def gpipe(stage: int, n_stages: int, n_micro: int) -> list:
    """All forwards in order, then all backwards in reverse order (last in, first out)."""
    _check_numbers(n_stages, n_micro, stage)
    out = []
    for mb in range(n_micro):
        out += _forward(stage, n_stages, mb)
    for mb in reversed(range(n_micro)):
        out += _backward(stage, n_stages, mb)
    return out


def one_f_one_b(stage: int, n_stages: int, n_micro: int) -> list:
    """PipeDream-Flush / Megatron non-interleaved 1F1B. At most p - stage micro-batches of
    activations alive: a stage starts a new forward only after a backward frees one."""
    _check_numbers(n_stages, n_micro, stage)
    n_warmup = min(n_stages - stage - 1, n_micro)
    out = []
    # warm-up: fill the pipe; the last stage needs none, stage s the p-s-1 it is ahead of
    for mb in range(n_warmup):
        out += _forward(stage, n_stages, mb)
    # steady state: forward micro-batch n_warmup + k, then backward micro-batch k
    for k in range(n_micro - n_warmup):
        out += _forward(stage, n_stages, n_warmup + k)
        out += _backward(stage, n_stages, k)
    # cool-down: drain the backwards of the micro-batches still in flight
    for mb in range(n_micro - n_warmup, n_micro):
        out += _backward(stage, n_stages, mb)
    return out


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b}


def schedule(name: str, stage: int, n_stages: int, n_micro: int) -> list:
    """The instructions of `stage` under the schedule called `name` (a key of SCHEDULES)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](stage, n_stages, n_micro)


def bubble_theory(name: str, n_stages: int, n_micro: int) -> float:
    """The idle fraction of a step under schedule `name` in theory, F and B each of one
    length on every stage (the module docstring): (p-1)/(m+p-1) for GPipe and 1F1B,
    which fill and drain the pipe once; (p-1)/p for naive, one stage working at a time."""
    p, m = n_stages, n_micro
    return (p - 1) / p if name == "naive" else (p - 1) / (m + p - 1)


# --------------------------------------------------------------------------------------------
# The checker: run every stage's list together, without MPI.

@dataclass
class Report:
    name: str                   # schedule name (or the function's)
    n_stages: int
    n_micro: int
    ok: bool                    # True: check() raises ScheduleError otherwise
    makespan: float             # end of the last op
    busy: list                  # per stage: time spent in Forward/Backward
    bubble: float               # idle fraction: 1 - sum(busy) / (n_stages * makespan)
    bubble_theory: float        # (p-1)/(m+p-1), GPipe's and 1F1B's with F = B
    peak_in_flight: list        # per stage: most micro-batches forwarded, not yet backwarded
    timeline: list = field(repr=False)   # (stage, "F"/"B", mb, start, end), by stage then start

    def summary(self) -> str:
        return (f"{self.name} p={self.n_stages} m={self.n_micro}: makespan {self.makespan:g}, "
                f"bubble {self.bubble:.3f} (theory {self.bubble_theory:.3f}), "
                f"peak in flight {self.peak_in_flight}")


def check(n_stages: int, n_micro: int, schedule_fn_or_name, *, rendezvous: bool = False,
          forward_time: float = 1.0, backward_time: float = 2.0) -> Report:
    """Simulate all stages of a schedule and prove it sound, or raise ScheduleError.

    Messages are FIFO queues per (src, dst, kind). Eager mode (default): a send never
    blocks, a receive waits until its message is there. rendezvous=True: a send also waits
    until the receiver has posted the matching receive. Checked: no deadlock (every stage
    finishes); on every stage each micro-batch is forwarded once and backwarded once, after
    its forward and after its inputs arrived; every Recv gets the Send of its micro-batch.
    The timeline gives every op its earliest start (F and B take forward_time and
    backward_time, messages 0); with rendezvous=True a send waits for its receiver.
    """
    _check_numbers(n_stages, n_micro)
    if not (forward_time >= 0 and backward_time >= 0):
        raise ValueError(f"op times must be >= 0, got forward {forward_time}, backward {backward_time}")
    p, m = n_stages, n_micro
    if isinstance(schedule_fn_or_name, str):
        schedule(schedule_fn_or_name, 0, p, m)                 # a clear error for a bad name
        name, fn = schedule_fn_or_name, SCHEDULES[schedule_fn_or_name]
    else:
        fn = schedule_fn_or_name
        name = getattr(fn, "__name__", "schedule")
    progs = [list(fn(s, p, m)) for s in range(p)]

    pc, clock = [0] * p, [0.0] * p
    queues = defaultdict(deque)                # (src, dst, kind) -> deque of (mb, time sent)
    done = [{"F": set(), "B": set(), "act": set(), "grad": set(), "sent": set()} for _ in range(p)]
    in_flight, peak, timeline = [0] * p, [0] * p, []

    def where(s):
        return f"stage {s}, instruction {pc[s]} ({progs[s][pc[s]]})"

    def run_op(s, ins):                        # Forward / Backward: check, then time it
        d, mb = done[s], ins.mb
        kind = "F" if isinstance(ins, Forward) else "B"
        if mb in d[kind]:
            did = "forwarded" if kind == "F" else "backwarded"
            raise ScheduleError(f"{where(s)}: micro-batch {mb} already {did}")
        if kind == "F" and s > 0 and mb not in d["act"]:
            raise ScheduleError(f"{where(s)}: forward before RecvAct({mb}) brought its input")
        if kind == "B" and mb not in d["F"]:
            raise ScheduleError(f"{where(s)}: backward of micro-batch {mb} before its forward")
        if kind == "B" and s < p - 1 and mb not in d["grad"]:
            raise ScheduleError(f"{where(s)}: backward before RecvGrad({mb}) brought its gradient")
        d[kind].add(mb)
        in_flight[s] += 1 if kind == "F" else -1
        peak[s] = max(peak[s], in_flight[s])
        start = clock[s]
        clock[s] += forward_time if kind == "F" else backward_time
        timeline.append((s, kind, mb, start, clock[s]))

    def check_message(s, ins):                 # a Send or Recv that is legal on this stage
        dst = s + ins.peer
        if not 0 <= dst < p:
            end, other = ("first", "previous") if dst < 0 else ("last", "next")
            raise ScheduleError(f"{where(s)}: the {end} stage has no {other} stage")
        if isinstance(ins, SENDS):
            produced_by = "F" if isinstance(ins, SendActivation) else "B"
            if ins.mb not in done[s][produced_by]:
                raise ScheduleError(f"{where(s)}: sends micro-batch {ins.mb} before its "
                                    f"{'Forward' if produced_by == 'F' else 'Backward'}")
            if (ins.kind, ins.mb) in done[s]["sent"]:
                raise ScheduleError(f"{where(s)}: micro-batch {ins.mb} already sent")
        return dst

    def receive(s, ins, mb_got, t_sent):       # a Recv completes: match and record it
        src = s + ins.peer
        if mb_got != ins.mb:
            raise ScheduleError(f"{where(s)}: expected {ins.kind} of micro-batch {ins.mb} from "
                                f"stage {src}, but the next message is micro-batch {mb_got}")
        done[s][ins.kind].add(ins.mb)
        clock[s] = max(clock[s], t_sent)

    def step(s) -> bool:                       # advance stage s by one instruction if it can
        ins = progs[s][pc[s]]
        if not isinstance(ins, Instruction) or type(ins) is Instruction:
            raise ScheduleError(f"{where(s)}: not an instruction")
        if not (isinstance(ins.mb, Integral) and 0 <= ins.mb < m):
            raise ScheduleError(f"{where(s)}: micro-batch {ins.mb!r} is not in 0..{m - 1}")
        if isinstance(ins, (Forward, Backward)):
            run_op(s, ins)
        elif isinstance(ins, SENDS):
            dst = check_message(s, ins)
            if rendezvous:                     # wait until dst stands at the matching Recv
                other = progs[dst][pc[dst]] if pc[dst] < len(progs[dst]) else None
                if not (isinstance(other, RECVS) and other.kind == ins.kind and dst + other.peer == s):
                    return False
                t = max(clock[s], clock[dst])
                receive(dst, other, ins.mb, t)
                clock[s] = t
                pc[dst] += 1
            else:
                queues[(s, dst, ins.kind)].append((ins.mb, clock[s]))
            done[s]["sent"].add((ins.kind, ins.mb))
        else:                                  # a Recv
            src = check_message(s, ins)
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
                                f"sends): " + "; ".join(_blocked(progs, pc, s)
                                                        for s in range(p) if pc[s] < len(progs[s])))

    for s in range(p):
        for kind, what in (("F", "Forward"), ("B", "Backward")):
            missing = sorted(set(range(m)) - done[s][kind])
            if missing:
                raise ScheduleError(f"stage {s} never runs {what} of micro-batch(es) {missing}")
    # No message is left over: stage s+1 received all m activations (each Forward needs
    # one) and stage s sent at most m (one per Forward); the same for gradients.

    makespan = max(clock)
    busy = [sum(e - b for st, _, _, b, e in timeline if st == s) for s in range(p)]
    return Report(name=name, n_stages=p, n_micro=m, ok=True, makespan=makespan, busy=busy,
                  bubble=1.0 - sum(busy) / (p * makespan) if makespan > 0 else 0.0,
                  bubble_theory=bubble_theory("gpipe", p, m), peak_in_flight=peak,
                  timeline=sorted(timeline, key=lambda r: (r[0], r[3])))


def _blocked(progs, pc, s) -> str:
    """What stage s, stuck at its current instruction, waits for."""
    ins, peer = progs[s][pc[s]], s + progs[s][pc[s]].peer
    here = f"stage {s} at instruction {pc[s]} ({ins})"
    there = "finished" if pc[peer] >= len(progs[peer]) else \
        f"at instruction {pc[peer]} ({progs[peer][pc[peer]]})"
    if isinstance(ins, SENDS):
        recv = "RecvAct" if ins.kind == "act" else "RecvGrad"
        return f"{here} waits for stage {peer} ({there}) to post {recv}({ins.mb})"
    send = "SendAct" if ins.kind == "act" else "SendGrad"
    return f"{here} waits for {send}({ins.mb}) from stage {peer} ({there})"


# --------------------------------------------------------------------------------------------
# Which layers and which parameters a stage holds.

def partition(n_layer: int, n_stages: int) -> list:
    """Contiguous, balanced layer ranges, one per stage; sizes differ by at most 1.

    The n_layer % n_stages extra layers go to the middle stages, later ones first
    (p-2, p-3, ..., 1), and then to the last stage: never to the first, which holds the
    embeddings and, under 1F1B, the most activations (p micro-batches); the last holds the
    head but only one micro-batch. Example: 6 layers on 4 stages -> sizes 1, 2, 2, 1."""
    for what, v in (("n_layer", n_layer), ("n_stages", n_stages)):
        if not isinstance(v, Integral) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{what} must be an integer >= 1, got {v!r}")
    if n_stages > n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {n_stages} pipeline stages: "
                         f"a stage would have no layer (use at most {n_layer} stages)")
    base, extra = divmod(n_layer, n_stages)
    takes_extra = (list(range(n_stages - 2, 0, -1)) + [n_stages - 1])[:extra]
    sizes = [base + (s in takes_extra) for s in range(n_stages)]
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def stage_param_names(cfg: GPTConfig, stage: int, n_stages: int) -> list:
    """Canonical names (docs/design.md §2) of the parameters `stage` holds, in model order: its
    blocks; the first stage wte and wpe; the last ln_f and lm_head (untied) or, tied, its
    own copy of wte (Megatron's embedding group: both ends hold wte and all-reduce its
    gradient). With one stage that is every name once."""
    parts = partition(cfg.n_layer, n_stages)
    if not (isinstance(stage, Integral) and 0 <= stage < n_stages):
        raise ValueError(f"stage must be in 0..{n_stages - 1} for {n_stages} stages, got {stage!r}")
    layers = parts[stage]
    first, last = stage == 0, stage == n_stages - 1
    names = []
    for name, _, _ in param_specs(cfg):
        if name.startswith("h."):
            keep = int(name.split(".")[1]) in layers
        elif name == "wte.weight":
            keep = first or (last and cfg.tie_embeddings)
        elif name == "wpe.weight":
            keep = first
        else:                                   # ln_f.*, lm_head.weight
            keep = last
        if keep:
            names.append(name)
    return names
