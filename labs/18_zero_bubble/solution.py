"""Lab 18, solved by hand: a Linear's backward split in B and W, and ZB-H1's order.

B is the input's gradient, dx = dy W^T, which the layer below (and the previous pipeline
stage) waits for; W is the weight's and the bias's, dW = x^T dy and db = sum of dy, which only
the optimizer step needs. linear_backward computes only the parts it is asked for, so the
autograd can run B now and W later without doing any work twice.

ZB-H1 is 1F1B with each backward split: the B's keep 1F1B's places, and the W's that 1F1B
would have run with them are moved to where the stage would otherwise wait: stage s leaves
its first s W's for the very end.
"""
from minipar.parallel.pipeline.schedules import (Backward, Forward, RecvActivation, RecvGrad, SendActivation,
                                                 SendGrad, WeightGrad)


def grad_input(dy, w):
    """B: dx = dy @ w.T, on any leading dims."""
    return dy @ w.T


def grad_weight(dy, x):
    """W: dW = x^T dy over every row (all leading dims flattened), db = dy summed over them."""
    c_in, c_out = x.shape[-1], dy.shape[-1]
    rows_x = x.reshape(-1, c_in)
    rows_dy = dy.reshape(-1, c_out)
    dw = rows_x.T @ rows_dy
    db = rows_dy.sum(axis=0)
    return dw, db


def linear_backward(dy, x, w, needs):
    """Only what `needs` asks for: B's dx, W's dW and db."""
    need_x, need_w, need_b = needs
    dx = grad_input(dy, w) if need_x else None
    dw = db = None
    if need_w or need_b:
        dw_all, db_all = grad_weight(dy, x)
        if need_w:
            dw = dw_all
        if need_b:
            db = db_all
    return dx, dw, db


def forward_steps(stage, n_stages, mb):
    steps = []
    if stage > 0:
        steps.append(RecvActivation(mb))
    steps.append(Forward(mb))
    if stage < n_stages - 1:
        steps.append(SendActivation(mb))
    return steps


def b_steps(stage, n_stages, mb):
    """B with its messages: the gradient goes back to the previous stage right after B."""
    steps = []
    if stage < n_stages - 1:
        steps.append(RecvGrad(mb))
    steps.append(Backward(mb))
    if stage > 0:
        steps.append(SendGrad(mb))
    return steps


def zb_h1(stage, n_stages, n_micro):
    """1F1B's warm-up; s pairs F B with their W's held back; F B W; B W; the held-back W's."""
    warmup = min(n_stages - 1 - stage, n_micro)
    todo = []
    f = b = w = 0
    while f < warmup:
        todo += forward_steps(stage, n_stages, f)
        f += 1
    held = 0
    while held < stage and f < n_micro:
        todo += forward_steps(stage, n_stages, f)
        todo += b_steps(stage, n_stages, b)
        f, b, held = f + 1, b + 1, held + 1
    while f < n_micro:
        todo += forward_steps(stage, n_stages, f)
        todo += b_steps(stage, n_stages, b)
        todo.append(WeightGrad(w))
        f, b, w = f + 1, b + 1, w + 1
    while b < n_micro:
        todo += b_steps(stage, n_stages, b)
        todo.append(WeightGrad(w))
        b, w = b + 1, w + 1
    while w < n_micro:
        todo.append(WeightGrad(w))
        w += 1
    return todo
