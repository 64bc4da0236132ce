"""How a run ends before its last step: it diverged, it was asked to stop, an output failed,
or a rank left. Each ends every rank with one line and an exit code of its own
(docs/debugging.md has the table):

    0    the run finished                         1    --verify failed, or an error
    2    bad flags, layout, data or checkpoint     3    the run diverged
    4    a rank left the run early                 5    an output could not be written
    130  interrupted by SIGINT (Ctrl-C)           143  stopped by SIGTERM (a scheduler's notice)

Divergence (Watch): a loss or gradient norm that is not finite (float32/float64: the step
has already changed the weights), or with fp16/bf16 more than --max-skipped-steps skipped
steps in a row, or the fp16 loss scale below --min-loss-scale. Every rank holds the same loss
(summed over dp, broadcast over pp), norm, skip and scale, so every rank decides alike
without a message. A checkpoint is never written after it (checkpoint.save refuses NaN too).

Signals (Requests): SIGINT and SIGTERM, to mpirun (which forwards them) or to any one rank,
are noted by a handler, and the ranks agree at the end of every step (agree: one 4-byte max
all-reduce, left out of the ledger and the trace) on the first reason any of them has. With
--save, SIGTERM first writes a checkpoint of the finished steps: what Slurm sends before
SIGKILL. A second signal, or one outside the steps, ends the job at once.
"""
from __future__ import annotations

import contextlib
import math
import signal
import sys
import threading

import numpy as np

OK, FAILED, BAD_CONFIG, DIVERGED, LEFT, OUTPUT_FAILED = 0, 1, 2, 3, 4, 5
INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}
REASONS = {0: None, 1: "output", 2: "SIGINT", 3: "SIGTERM"}       # agree()'s codes, by priority


class Stop(Exception):
    """End the run on every rank with `code`; `line` is what rank 0 prints."""

    def __init__(self, code: int, line: str):
        super().__init__(line)
        self.code, self.line = code, line


class Interrupted(BaseException):
    """A signal outside the steps, or a second one: the job ends now (a BaseException, so
    that no `except Exception` on the way swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Requests:
    """What this rank was asked: a signal's number, or an output that failed."""

    def __init__(self):
        self.signum = None
        self.output_error = None            # one line: the file and the error
        self.in_steps = False
        self.step = None                    # the step running now

    @contextlib.contextmanager
    def installed(self):
        """The handler on SIGINT and SIGTERM while the run lasts; then the ones before it (a
        test or a lab calls the trainer in its own process). Only the main thread may set
        handlers: elsewhere none is installed."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        before = {sig: signal.signal(sig, self.handler) for sig in INTERRUPTED}
        try:
            yield self
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def handler(self, signum, frame):
        if not self.in_steps or self.signum is not None:
            raise Interrupted(signum)
        self.signum = signum

    def local_code(self) -> int:
        if self.signum is not None:
            return 3 if self.signum == signal.SIGTERM else 2
        return 1 if self.output_error else 0


def agree(world_group, code: int) -> int:
    """The largest reason code of every rank (0: go on); one untracked all-reduce."""
    if world_group is None or world_group.size == 1:
        return code
    from minipar import comm  # noqa: PLC0415
    with comm.untracked():
        # int32: the step's skip flag is the one int64 max all-reduce (lab 09's seam finds it so)
        return int(comm.all_reduce(world_group, np.array([code], dtype=np.int32), op="max")[0])


class Watch:
    """Divergence, step by step (module docstring); check(row) -> the line, or None."""

    def __init__(self, args):
        self.args = args
        self.last_finite = None             # (step, loss)
        self.skipped_in_a_row = 0

    def check(self, row: dict, scale_now: float | None = None) -> str | None:
        """scale_now: the fp16 scaler's scale after this step's update (None otherwise)."""
        a, step, loss, norm = self.args, row["step"], row["loss"], row["grad_norm"]
        if row["skipped"]:
            self.skipped_in_a_row += 1
            if self.skipped_in_a_row > a.max_skipped_steps:
                return (f"{self.skipped_in_a_row} steps in a row skipped for inf/NaN gradients at step {step} "
                        f"(--max-skipped-steps {a.max_skipped_steps})")
            if scale_now is not None and not scale_now >= a.min_loss_scale:     # NaN too
                return (f"the fp16 loss scale fell to {scale_now:g} after step {step}, below "
                        f"--min-loss-scale {a.min_loss_scale:g}: the gradients overflow at any scale")
            return None
        self.skipped_in_a_row = 0
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return f"loss {loss} and gradient norm {norm} at step {step}: not finite"
        self.last_finite = (step, loss)
        return None

    def line(self, why: str, checkpoint: tuple | None) -> str:
        last = (f"the last finite loss {self.last_finite[1]:.4f} at step {self.last_finite[0]}"
                if self.last_finite else "no finite loss in this run before it")
        where = (f"the last good checkpoint is {checkpoint[0]} (step {checkpoint[1]})" if checkpoint
                 else "no checkpoint was written (--save DIR --save-every N keeps one)")
        return f"minipar.train: the run diverged: {why}; {last}; {where}; stopping every rank"


def say(line: str):
    print(line, file=sys.stderr, flush=True)
