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

from numbers import Integral

from minipar.model.gpt import GPTConfig, param_specs
from minipar.parallel.pipeline import interleaved as _interleaved
from minipar.parallel.pipeline import zero_bubble as _zero_bubble
from minipar.parallel.pipeline.check import Report, check, programs  # noqa: F401  (the checker, re-exported)


from minipar.parallel.pipeline.instructions import (COMPUTE, RECVS, SENDS, Backward, Forward,  # noqa: F401
                                                    Instruction, RecvActivation, RecvGrad, ScheduleError,
                                                    SendActivation, SendGrad, WeightGrad, _backward,
                                                    _check_numbers, _forward, neighbour)


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


def schedule(name: str, stage: int, n_stages: int, n_micro: int, virtual: int = 1) -> list:
    """The instructions of `stage` under the schedule called `name` (a key of SCHEDULES);
    virtual: model chunks per rank, for the interleaved schedule only."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name == "interleaved":
        return SCHEDULES[name](stage, n_stages, n_micro, virtual)
    if virtual != 1:
        raise ValueError(f"virtual stages ({virtual}) are for the interleaved schedule, not {name}")
    return SCHEDULES[name](stage, n_stages, n_micro)


def bubble_theory(name: str, n_stages: int, n_micro: int, virtual: int = 1) -> float:
    """The idle fraction of a step (idle time / (p * makespan), the one definition minipar
    uses throughout) under schedule `name` in theory, every op of one length: F = B = W
    (a whole backward B + W = 2 F). Each stage idles (p-1) x (what the fill and drain cost):
        naive        one stage works at a time                        (p-1)/p
        gpipe, 1f1b  (p-1)(F + B + W) of m(F + B + W) + that          (p-1)/(m+p-1)
        interleaved  (p-1)(F + B + W)/V (Narayanan et al. 2021, §2.2)  (p-1)/(Vm+p-1)
        zb-h1        (p-1)(F + B - W) (Qi et al. 2024, Table 2)        (p-1)/(3m+p-1)
        zb-h2        (p-1) F: the fill at the start of a synchronous step (zero_bubble.py)
                                                                       (p-1)/(3m+p-1)
    zero_bubble.idle_theory gives each with unequal, measured op times."""
    p, m, V = n_stages, n_micro, virtual
    if name == "naive":
        return (p - 1) / p
    if name == "interleaved":
        return (p - 1) / (V * m + p - 1)
    if name in ("zb-h1", "zb-h2"):
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (m + p - 1)


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


def rank_layers(n_layer: int, stage: int, n_stages: int, n_chunks: int = 1) -> list:
    """The layer ranges of the chunks rank `stage` holds: with n_chunks V the layers are
    partitioned into p*V virtual stages and the rank holds stage, stage + p, ... (interleaved.py)."""
    parts = partition(n_layer, n_stages * n_chunks)
    return [parts[c * n_stages + stage] for c in range(n_chunks)]


def stage_param_names(cfg: GPTConfig, stage: int, n_stages: int, n_chunks: int = 1) -> list:
    """Canonical names (docs/design.md §2) of the parameters `stage` holds, in model order: its
    blocks; the first stage the embeddings (wte and wpe; Llama's embed_tokens); the last the
    final norm and lm_head (untied) or, tied, its own copy of the token embedding (Megatron's
    embedding group: both ends hold it and all-reduce its gradient). With one stage that is
    every name once. With n_chunks V > 1: the names of every virtual stage the rank holds
    (rank_layers), the embeddings on rank 0's chunk 0 and the head on rank p-1's chunk V-1."""
    if n_chunks > 1:
        held = {n for c in range(n_chunks)
                for n in stage_param_names(cfg, c * n_stages + stage, n_stages * n_chunks)}
        return [n for n, _, _ in param_specs(cfg) if n in held]
    parts = partition(cfg.n_layer, n_stages)
    if not (isinstance(stage, Integral) and 0 <= stage < n_stages):
        raise ValueError(f"stage must be in 0..{n_stages - 1} for {n_stages} stages, got {stage!r}")
    layers = parts[stage]
    first, last = stage == 0, stage == n_stages - 1
    names, family = [], cfg.family
    for name, _, _ in param_specs(cfg):
        place = family.place(name)
        if place == "block":
            keep = family.block_of(name) in layers
        elif place == "embedding":
            keep = first or (last and cfg.tie_embeddings)
        elif place == "positions":
            keep = first
        else:                                   # the final norm, the untied head
            keep = last
        if keep:
            names.append(name)
    return names


# --------------------------------------------------------------------------------------------
# The registry: the three above, and the schedules in their own files.

SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": _interleaved.interleaved,
             "zb-h1": _zero_bubble.zb_h1, "zb-h2": _zero_bubble.zb_h2}
