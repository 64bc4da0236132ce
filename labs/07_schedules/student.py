"""Lab 07: the GPipe and 1F1B pipeline schedules, written as data.

A pipeline cuts the model into p stages (one per rank) and the batch into m micro-batches.
A schedule is, for each stage, the list of instructions that stage executes, in order
(labs/07_schedules/README.md has the pictures). Use these six classes, each holding the
micro-batch index mb (0 .. m-1):

    Forward(mb)         run this stage's layers on mb, keep its activations
    Backward(mb)        backpropagate mb through this stage, free its activations
    RecvActivation(mb)  the input of mb            <- previous stage   (never on the first stage)
    SendActivation(mb)  this stage's output of mb  -> next stage       (never on the last)
    RecvGrad(mb)        gradient of the output     <- next stage       (never on the last)
    SendGrad(mb)        gradient of the input      -> previous stage   (never on the first)

Put a Recv right before the Forward/Backward that needs it, and a Send right after the op
that produced it. Every stage runs each micro-batch's Forward and Backward exactly once, and
has exactly one of each message it needs per micro-batch. Sends never block (the executor
posts them and moves on); a Recv waits until its message has arrived. Messages between two
stages arrive in the order they were sent.

Build the lists yourself: import the instruction classes, not minipar's own gpipe,
one_f_one_b, schedule(), SCHEDULES or check() (the grader's scan refuses them in this file).
Return a new list on every call. You can check and draw your lists without MPI, beside this
file (in a shell or a script of your own that imports it):

    .venv/bin/python -m labs.07_schedules.show 1f1b 4 8 --student this_file.py

    from minipar.parallel.pipeline import schedules
    from minipar.show import draw
    report = schedules.check(4, 8, one_f_one_b)         # raises ScheduleError on a deadlock
    print(draw.ascii_gantt(report.timeline, 4))

Check:  make lab L=07        (or: .venv/bin/python -m labs.grade 07 --student this_file.py)
"""
from minipar.parallel.pipeline.schedules import (Backward, Forward, RecvActivation, RecvGrad,  # noqa: F401
                                                 SendActivation, SendGrad)


def gpipe(stage, n_stages, n_micro):
    """GPipe (arXiv:1811.06965): the list of instructions of `stage` (0 .. n_stages-1) for
    n_micro micro-batches. Every forward in micro-batch order 0, 1, ..., m-1, then every
    backward in reverse order m-1, ..., 0 (the last stage starts with the micro-batch it has
    just forwarded; activations are freed like a stack). Each Forward with its messages:
    RecvActivation(mb) before it unless stage 0, SendActivation(mb) after it unless the last
    stage; each Backward: RecvGrad(mb) before it unless the last stage, SendGrad(mb) after it
    unless stage 0. Returns a new list; with one stage it is F0 ... F(m-1) B(m-1) ... B0.
    Peak: all m micro-batches' activations alive before the first backward."""
    raise NotImplementedError("lab 07: the GPipe schedule, see labs/07_schedules/README.md")


def one_f_one_b(stage, n_stages, n_micro):
    """1F1B (PipeDream-Flush, arXiv:2104.04473; Megatron-LM's non-interleaved schedule): the
    list of instructions of `stage` for n_micro micro-batches, in three phases:
      warm-up    min(n_stages - stage - 1, n_micro) forwards, micro-batches 0, 1, ...;
      steady     then, while forwards remain: the next forward, then the oldest backward;
      cool-down  the backwards still to do, oldest first.
    Forwards and backwards each run in micro-batch order, with their messages as in gpipe().
    Returns a new list. The last stage needs no warm-up (F0 B0 F1 B1 ...); stage s never
    holds more than n_stages - s micro-batches' activations; the bubble is GPipe's,
    (p-1)/(m+p-1) of the step."""
    raise NotImplementedError("lab 07: the 1F1B schedule, see labs/07_schedules/README.md")
