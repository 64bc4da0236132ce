"""Lab 07, solved by hand: GPipe and 1F1B as one stage's list of instructions.

Each micro-batch's forward is wrapped in the messages it needs (receive the input unless
this is the first stage, send the output unless it is the last), and so is its backward
(receive the output's gradient unless last, send the input's gradient unless first). The
two schedules differ only in the order the wrapped forwards and backwards are laid down.
"""
from minipar.parallel.pipeline.schedules import (Backward, Forward, RecvActivation, RecvGrad, SendActivation,
                                                 SendGrad)


def forward_steps(stage, n_stages, mb):
    """Receive mb's input (not on the first stage), forward it, send the output (not on the last)."""
    steps = []
    if stage > 0:
        steps.append(RecvActivation(mb))
    steps.append(Forward(mb))
    if stage < n_stages - 1:
        steps.append(SendActivation(mb))
    return steps


def backward_steps(stage, n_stages, mb):
    """Receive the gradient of mb's output (not on the last stage), backward, send the
    gradient of its input (not on the first)."""
    steps = []
    if stage < n_stages - 1:
        steps.append(RecvGrad(mb))
    steps.append(Backward(mb))
    if stage > 0:
        steps.append(SendGrad(mb))
    return steps


def gpipe(stage, n_stages, n_micro):
    """Every forward in micro-batch order, then every backward newest first."""
    todo = []
    for mb in range(n_micro):
        todo += forward_steps(stage, n_stages, mb)
    for mb in range(n_micro - 1, -1, -1):
        todo += backward_steps(stage, n_stages, mb)
    return todo


def one_f_one_b(stage, n_stages, n_micro):
    """Warm-up forwards, then one forward and one backward in turn, then the last backwards."""
    stages_after_me = n_stages - 1 - stage
    warmup = min(stages_after_me, n_micro)
    todo = []
    next_forward = next_backward = 0
    # warm-up: one forward for each stage downstream, so the last stage never waits
    while next_forward < warmup:
        todo += forward_steps(stage, n_stages, next_forward)
        next_forward += 1
    # steady state: a new micro-batch in, the oldest one's backward out
    while next_forward < n_micro:
        todo += forward_steps(stage, n_stages, next_forward)
        next_forward += 1
        todo += backward_steps(stage, n_stages, next_backward)
        next_backward += 1
    # cool-down: the micro-batches still in flight
    while next_backward < n_micro:
        todo += backward_steps(stage, n_stages, next_backward)
        next_backward += 1
    return todo
