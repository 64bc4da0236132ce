"""Pipeline instructions: what one stage does, one step at a time (schedules.py says how
schedules are made of them), and where each message goes.

    Forward(mb, chunk)         run the chunk's layers on micro-batch mb, keep the activations
    Backward(mb, chunk)        backpropagate mb through the chunk (with a WeightGrad later: B only)
    WeightGrad(mb, chunk)      W: the chunk's parameters' gradients of mb (zero_bubble.py)
    SendActivation, RecvActivation, SendGrad, RecvGrad (mb, chunk)   the messages around them

chunk is 0 except in the interleaved schedule, where a rank holds several chunks of layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral


class ScheduleError(ValueError):
    """A schedule that deadlocks, loses or duplicates a micro-batch, or mismatches a message."""


# --------------------------------------------------------------------------------------------
# Instructions. `peer` and `kind` tell the checker (and the executor) where a message goes.

@dataclass(frozen=True)
class Instruction:
    mb: int                     # micro-batch index, 0 .. m-1
    chunk: int = 0              # which of the rank's model chunks (interleaved.py); 0 otherwise
    short = "?"
    compute = False             # F, B and W print as "F3" ("F3@1": chunk 1), messages as "SendAct(3)"

    def __str__(self):
        if self.compute:
            return f"{self.short}{self.mb}" + (f"@{self.chunk}" if self.chunk else "")
        return f"{self.short}({self.mb}{f', chunk {self.chunk}' if self.chunk else ''})"


@dataclass(frozen=True)
class Forward(Instruction):
    short, compute = "F", True


@dataclass(frozen=True)
class Backward(Instruction):
    """The whole backward, or with a WeightGrad later only its B part (backward_split.py)."""
    short, compute = "B", True


@dataclass(frozen=True)
class WeightGrad(Instruction):
    """W: the parameters' gradients of a micro-batch whose Backward ran B only (zero_bubble.py)."""
    short, compute = "W", True


@dataclass(frozen=True)
class SendActivation(Instruction):
    short, kind, peer = "SendAct", "act", +1      # to the next (virtual) stage


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
COMPUTE = (Forward, Backward, WeightGrad)


def neighbour(stage: int, chunk: int, peer: int, n_stages: int, n_chunks: int = 1):
    """(rank, chunk) of the virtual stage `peer` (+1 next, -1 previous) away from chunk `chunk`
    of rank `stage`, or None past either end. Virtual stage v = chunk * p + stage: rank r holds
    chunks r, r + p, r + 2p, ... (interleaved.py); with one chunk, the next rank."""
    v = chunk * n_stages + stage + peer
    if not 0 <= v < n_stages * n_chunks:
        return None
    return v % n_stages, v // n_stages


def _check_numbers(n_stages, n_micro, stage=None):
    for what, v in (("n_stages", n_stages), ("n_micro", n_micro)):
        if not isinstance(v, Integral) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{what} must be an integer >= 1, got {v!r}")
    if stage is not None and (not isinstance(stage, Integral) or not 0 <= stage < n_stages):
        raise ValueError(f"stage must be in 0..{n_stages - 1} for {n_stages} stages, got {stage!r}")


def _forward(stage, n_stages, mb, chunk=0, n_chunks=1):
    """Receive the input (unless the first virtual stage), forward, send the output (unless last)."""
    first = neighbour(stage, chunk, -1, n_stages, n_chunks) is None
    last = neighbour(stage, chunk, +1, n_stages, n_chunks) is None
    return ([] if first else [RecvActivation(mb, chunk)]) + [Forward(mb, chunk)] + \
           ([] if last else [SendActivation(mb, chunk)])


def _backward(stage, n_stages, mb, chunk=0, n_chunks=1):
    """Receive the output's gradient (unless the last virtual stage), backward, send the
    input's (unless the first)."""
    first = neighbour(stage, chunk, -1, n_stages, n_chunks) is None
    last = neighbour(stage, chunk, +1, n_stages, n_chunks) is None
    return ([] if last else [RecvGrad(mb, chunk)]) + [Backward(mb, chunk)] + \
           ([] if first else [SendGrad(mb, chunk)])
