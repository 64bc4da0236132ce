"""Lab 18: the zero-bubble split. A Linear's backward in two passes, B (the input's gradient,
which the previous pipeline stage waits for) and W (the weight's and the bias's, which only
the optimizer step needs), and ZB-H1, the pipeline order that runs the W's where 1F1B idles
(Qi et al. 2024, arXiv:2401.10241; labs/18_zero_bubble/README.md has the pictures).

A Linear computes y = x @ w + b with x (..., Cin), w (Cin, Cout), b (Cout,), y (..., Cout).
From dy = dL/dy (..., Cout):
    B   dx = dy @ w^T                                        (..., Cin)
    W   dw = x^T dy, summed over every row (all leading dims)   (Cin, Cout)
        db = dy summed over every leading dim                   (Cout,)
The arrays are float64 or float32; return the inputs' dtype. Never modify an input (W reads x
and dy after B has run) and return new arrays, not views of an input.

The schedule is a list of instructions (import them from minipar.parallel.pipeline.schedules),
each holding the micro-batch mb (0 .. m-1):

    Forward(mb)         run this stage's layers on mb, keep what backward needs
    Backward(mb)        B only: the gradient of this stage's input (a WeightGrad comes later)
    WeightGrad(mb)      W: this stage's parameters' gradients of mb
    RecvActivation(mb)  the input of mb            <- previous stage   (never on the first stage)
    SendActivation(mb)  this stage's output of mb  -> next stage       (never on the last)
    RecvGrad(mb)        gradient of the output     <- next stage       (never on the last)
    SendGrad(mb)        gradient of the input      -> previous stage   (never on the first)

A Recv right before the Forward/Backward that needs it, a Send right after the op that made it
(SendGrad right after the Backward, never after the W). minipar's one_f_one_b is given: its
list is 1F1B's, which ZB-H1 starts from. You can check and draw your lists beside this file:

    from minipar.parallel.pipeline import schedules
    from minipar.show import draw
    r = schedules.check(4, 8, zb_h1)                  # raises ScheduleError on a deadlock
    print(r.bubble, r.peak_in_flight); print(draw.ascii_gantt(r.timeline, 4))

Check:  make lab L=18        (or: .venv/bin/python -m labs.grade 18 --student this_file.py)
"""
import numpy as np  # noqa: F401

from minipar.parallel.pipeline.schedules import (Backward, Forward, RecvActivation, RecvGrad,  # noqa: F401
                                                 SendActivation, SendGrad, WeightGrad, one_f_one_b)


def grad_input(dy, w):
    """B: the gradient of the Linear's input, dx = dy @ w.T.
    dy (..., Cout) any number of leading dims (none of them may be 0 rows too), w (Cin, Cout).
    Returns a new array (..., Cin) of dy's dtype; dy and w untouched."""
    raise NotImplementedError("lab 18: B, the input gradient, see labs/18_zero_bubble/README.md")


def grad_weight(dy, x):
    """W: the gradients of the Linear's weight and bias, (dw, db).
    dy (..., Cout), x (..., Cin) with the same leading dims (possibly no rows at all).
    dw = x^T dy summed over every row: (Cin, Cout); db = dy summed over every leading dim: (Cout,).
    New arrays of dy's dtype (zeros when there are no rows); dy and x untouched."""
    raise NotImplementedError("lab 18: W, the weight and bias gradients, see labs/18_zero_bubble/README.md")


def linear_backward(dy, x, w, needs):
    """The Linear's backward as minipar's autograd calls it: needs = (need_x, need_w, need_b),
    three bools (one pass asks for all three; backward_split's B for dx only; its W for dw and
    db only). Returns (dx, dw, db), None for each part not asked for. Compute only what is
    asked: call grad_input once if need_x, grad_weight once if need_w or need_b, and neither
    otherwise (the grader counts the calls)."""
    raise NotImplementedError("lab 18: the backward that honours the mask, see labs/18_zero_bubble/README.md")


def zb_h1(stage, n_stages, n_micro):
    """ZB-H1 (Qi et al. 2024, arXiv:2401.10241): the list of instructions of `stage`
    (0 .. n_stages-1) for n_micro micro-batches. With p = n_stages, m = n_micro, s = stage, in
    micro-batch order within each kind (F's 0, 1, ...; B's 0, 1, ...; W's 0, 1, ...):
      warm-up     min(p - s - 1, m) forwards (1F1B's);
      then        up to s times: the next F, then the next B, its W held back;
      then        while forwards remain: the next F, the next B, the next W;
      then        while backwards remain: the next B, the next W;
      last        the W's still to do (the s held back).
    Each F and B with its messages; a W has none. Returns a new list on every call. At most p
    micro-batches between F and W on any stage; with F = B = W and m >= p the bubble is
    (p-1)/(3m+p-1)."""
    raise NotImplementedError("lab 18: the ZB-H1 order, see labs/18_zero_bubble/README.md")
