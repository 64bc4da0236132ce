"""Zero-bubble pipeline schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism",
arXiv:2401.10241): --schedule zb-h1 and zb-h2.

Every backward is split in two (backward_split.py): B, the gradient of the stage's input,
which the previous stage waits for, and W, the gradients of its weights, which nobody waits
for until the optimizer step. A Backward instruction then runs B only, and a WeightGrad
instruction runs W later, where the stage would otherwise idle. With F, B, W the times of a
stage's forward, B and W of one micro-batch, each stage idles per step

    1F1B   (p-1)(F + B + W)       the pipe fills and drains at the pace of whole backwards
    ZB-H1  (p-1)(F + B - W)       B alone climbs the pipe; the W's fill the drain
    ZB-H2  (p-1) F                only the fill at the start of the step is left

(idle_theory; at F = B = W, (p-1)/(3m+p-1) of the step for both ZB schedules against
(p-1)/(m+p-1) for 1F1B). The paper counts ZB-H2 as zero: it also overlaps one step's fill with
the previous step's drain, which needs its optimizer-step post-validation. minipar steps the
optimizer after every stage has finished (the gradient norm and the inf check are all-reduces
over the pipeline), so each step starts with an empty pipe and the (p-1) F of the fill stays;
the gain of ZB-H2 over ZB-H1 shows when W is shorter than B.

ZB-H1 keeps 1F1B's memory: at most p micro-batches in flight on any stage, counted from a
micro-batch's F to its W (W needs the layers' inputs and output gradients, kept until then).
Stage s of p: p - s - 1 forwards (1F1B's warm-up); then s times one F and one B with the W
left for later; then F, B, W for the rest of the forwards; then B, W for the remaining
backwards; then the s W's left behind. The first stage (s = 0) leaves none.

ZB-H2 lets up to 2p - 1 micro-batches be in flight and is built by a rule rather than by
hand: every stage, as soon as it is free, runs its next ready B, else its next forward if
fewer than 2p - 1 micro-batches are in flight and the input is there, else its oldest W.
The rule is run once, for all stages together, with F = B = W = 1 time unit (an event
simulation, deterministic), and each stage's order of F, B and W is its schedule.
"""
from __future__ import annotations

from functools import lru_cache

from minipar.parallel.pipeline.instructions import WeightGrad, _backward, _check_numbers, _forward


def _instructions(stage: int, n_stages: int, order) -> list:
    """[("F"|"B"|"W", mb), ...] -> instructions, with the messages around F and B."""
    out = []
    for kind, mb in order:
        out += (_forward(stage, n_stages, mb) if kind == "F" else _backward(stage, n_stages, mb)
                if kind == "B" else [WeightGrad(mb)])
    return out


def zb_h1(stage: int, n_stages: int, n_micro: int) -> list:
    """ZB-H1 for `stage` (see the module)."""
    _check_numbers(n_stages, n_micro, stage)
    p, m = n_stages, n_micro
    order, f, b, w = [], 0, 0, 0
    for _ in range(min(p - stage - 1, m)):                        # warm-up, as 1F1B
        order.append(("F", f))
        f += 1
    for _ in range(stage):                                        # F, B: W left for the drain
        if f == m:
            break
        order += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    while f < m:                                                  # F, B, W
        order += [("F", f), ("B", b), ("W", w)]
        f, b, w = f + 1, b + 1, w + 1
    while b < m:                                                  # B, W
        order += [("B", b), ("W", w)]
        b, w = b + 1, w + 1
    order += [("W", k) for k in range(w, m)]                      # the W's left behind
    return _instructions(stage, p, order)


def zb_h2(stage: int, n_stages: int, n_micro: int) -> list:
    """ZB-H2 for `stage` (see the module: the rule, simulated at unit times)."""
    _check_numbers(n_stages, n_micro, stage)
    return _instructions(stage, n_stages, _h2_orders(n_stages, n_micro)[stage])


@lru_cache(maxsize=64)
def _h2_orders(p: int, m: int) -> tuple:
    """Every stage's order of ("F"|"B"|"W", mb) under ZB-H2's rule, F = B = W = 1."""
    limit = 2 * p - 1
    clock = [0] * p
    act = [{mb: 0 for mb in range(m)}] + [{} for _ in range(p - 1)]   # input of mb there at time t
    grad = [{} for _ in range(p)]                                      # output gradient of mb there
    next_f, in_flight = [0] * p, [0] * p
    forwarded = [[] for _ in range(p)]                                 # F done, B not yet, in order
    waiting_w = [[] for _ in range(p)]                                 # B done, W not yet, in order
    orders = [[] for _ in range(p)]
    for _ in range(3 * m * p):
        best = None                                                    # (start, stage, kind, mb)
        for s in range(p):
            options = []
            if forwarded[s]:
                mb = forwarded[s][0]
                ready = clock[s] if s == p - 1 else grad[s].get(mb)
                if ready is not None:
                    options.append((max(clock[s], ready), 0, "B", mb))
            mb = next_f[s]
            if mb < m and in_flight[s] < limit and mb in act[s]:
                options.append((max(clock[s], act[s][mb]), 1, "F", mb))
            if waiting_w[s]:
                options.append((clock[s], 2, "W", waiting_w[s][0]))
            if options:
                first = min(o[0] for o in options)
                start, _, kind, mb = min(o for o in options if o[0] == first)   # B, then F, then W
                if best is None or start < best[0]:
                    best = (start, s, kind, mb)
        start, s, kind, mb = best
        clock[s] = start + 1
        orders[s].append((kind, mb))
        if kind == "F":
            next_f[s] += 1
            in_flight[s] += 1
            forwarded[s].append(mb)
            if s < p - 1:
                act[s + 1][mb] = clock[s]
        elif kind == "B":
            forwarded[s].pop(0)
            waiting_w[s].append(mb)
            if s > 0:
                grad[s - 1][mb] = clock[s]
        else:
            waiting_w[s].pop(0)
            in_flight[s] -= 1
    return tuple(tuple(o) for o in orders)


def idle_theory(name: str, n_stages: int, n_micro: int, f: float, b: float, w: float,
                n_chunks: int = 1) -> float:
    """Idle time of each stage in one step, in theory, from a stage's times of one
    micro-batch's F, B and W (for the unsplit schedules b + w is the whole backward):
    1F1B and GPipe (p-1)(f+b+w); interleaved (p-1)(f+b+w)/V; ZB-H1 (p-1)(f + max(b-w, 0))
    (Qi et al.'s (p-1)(F + B - W) while W <= B; with W > B the fill's (p-1) f is the floor);
    ZB-H2 (p-1) f; naive (p-1) m (f+b+w)."""
    p, m = n_stages, n_micro
    return {"naive": (p - 1) * m * (f + b + w), "gpipe": (p - 1) * (f + b + w), "1f1b": (p - 1) * (f + b + w),
            "interleaved": (p - 1) * (f + b + w) / n_chunks, "zb-h1": (p - 1) * (f + max(b - w, 0.0)),
            "zb-h2": (p - 1) * f}[name]


def bubble_from_times(name: str, n_stages: int, n_micro: int, f: float, b: float, w: float,
                      n_chunks: int = 1) -> float:
    """idle_theory as a fraction of the step: idle / (m (f + b + w) + idle)."""
    idle = idle_theory(name, n_stages, n_micro, f, b, w, n_chunks)
    work = n_micro * (f + b + w)
    return idle / (work + idle) if work + idle > 0 else 0.0
