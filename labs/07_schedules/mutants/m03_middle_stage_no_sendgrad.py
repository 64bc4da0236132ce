# criterion: well-formed lists
"""Mutant: `elif` where two `if`s were meant: a middle stage, which both receives its output's
gradient and sends its input's, only receives; the stage before it would wait for that
gradient forever (schedules.check reports the deadlock; the per-stage check, first, names
the missing SendGrad)."""
from minipar.parallel.schedules import Backward, Forward, RecvActivation, RecvGrad, SendActivation, SendGrad


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
    steps = [Backward(mb)]
    if stage < n_stages - 1:
        steps.insert(0, RecvGrad(mb))
    elif stage > 0:                      # one branch taken: a middle stage never sends
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
