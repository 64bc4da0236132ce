"""One call in flight, and the one way a message moves: a polled Isend/Irecv.

Everything in `minipar.comm` sends and receives through a Call: its posting methods count
every message for the ledger (ledger.py), and its wait is the only wait.

- A collective is a Python *generator*: it posts the Isend/Irecv of one step, `yield`s the
  requests, and is resumed once they have completed. Written this way the ring in `ring.py`
  reads like blocking code, and the same generator runs either to the end at once (`run`,
  the blocking call) or a step at a time while other work goes on (`Handle`, what
  `all_reduce_async` returns: each `handle.test()` advances it as far as it can).
- Waiting is polling: `Testall`, and while it says no, give the core away (sched_yield) and
  test again; after 50 ms of waiting, nap 0.5 ms between tests. With more ranks than cores
  (4 on 2 here) the rank we wait for often needs our core: measured, any busy spinning
  before yielding made every message size slower. No wait blocks inside MPI, so every wait
  gives up after `MINIPAR_COMM_TIMEOUT` seconds (default 600) without progress, with an
  error that names the operation, the step, and the peer of each message still pending.
- Messages are also printed when `MINIPAR_TRACE=1`: `rank 1 -> 2 | all_reduce step 3/6 | 4096 B`
  (world ranks, printed by the sender).
"""
import os
import time

import numpy as np
from mpi4py import MPI

from minipar import trace as _trace
from minipar.comm.errors import CommTimeout
from minipar.comm.ledger import account
from minipar.comm.protocol import BYTE

_NAP_AFTER = 0.05           # seconds of waiting before it sleeps between polls
_NAP = 0.0005


class Call:
    """One collective call in flight: its tag, step counter, byte counts, and the wait loop.

    The posting methods are on every message's critical path, so they are kept lean; what a
    timeout message needs (the step, and the peer and size of each message of the step) is
    just remembered in `posted`, in the order the requests are posted. With --trace (rec is
    the Recorder) every message is also kept in `log`, and done() hands the call over.
    """

    __slots__ = ("g", "name", "axis", "tag", "nsteps", "step", "sent", "recvd", "t0", "comm",
                 "trace", "posted", "blocking", "algorithm", "rec", "log", "asynchronous",
                 "remote", "sent_inter", "recvd_inter")

    def __init__(self, g, name, nsteps, tag, algorithm=None):
        self.g, self.name, self.nsteps, self.tag = g, name, nsteps, tag
        self.axis = g.axis              # the ledger's axis: the group the call was started on
        self.comm, self.trace = g.comm, g.trace
        self.step = self.sent = self.recvd = self.sent_inter = self.recvd_inter = 0
        self.remote = g.remote          # remote[q]: is group rank q on another host?
        self.posted = []
        self.blocking = False           # set by run(): may receive into the group's scratch
        self.algorithm = algorithm
        self.rec = _trace.RECORDER      # None unless --trace
        self.log = []                   # with rec: (step, "send"/"recv", peer, bytes[, first, last])
        self.asynchronous = False       # set by Handle: runs in the background
        self.t0 = time.perf_counter()

    def buffer(self, slot, shape, dtype):
        """A receive buffer: the group's reused scratch slot when the call is blocking, else
        (a Handle's call) a new array."""
        if self.blocking:
            return self.g.scratch(slot, shape, dtype)
        return np.empty(shape, dtype)

    # Posting messages. Buffers are contiguous 1-D ndarrays of any dtype, sent as raw bytes;
    # empty ones are skipped (both sides always know the sizes). Each returns a request list.

    def isend(self, step, buf, dst):
        if step != self.step:
            self.step, self.posted = step, []
        n = buf.nbytes
        if not n:
            return []
        self.sent += n
        if self.remote[dst]:
            self.sent_inter += n
        self.posted.append(("send to", dst, n))
        if self.trace:
            self.print_send(step, dst, n)
        if self.rec is not None:
            self.note(step, "send", dst, buf)
        return [self.comm.Isend([buf, BYTE], dst, self.tag)]

    def irecv(self, step, buf, src):
        if step != self.step:
            self.step, self.posted = step, []
        n = buf.nbytes
        if not n:
            return []
        self.recvd += n
        if self.remote[src]:
            self.recvd_inter += n
        self.posted.append(("receive from", src, n))
        if self.rec is not None:
            self.note(step, "recv", src, buf)
        return [self.comm.Irecv([buf, BYTE], src, self.tag)]

    def sendrecv(self, step, sendbuf, dst, recvbuf, src):
        """Send to dst and receive from src in one step (what MPI_Sendrecv does)."""
        ns, nr = sendbuf.nbytes, recvbuf.nbytes
        if ns and nr:
            self.step = step
            self.posted = [("send to", dst, ns), ("receive from", src, nr)]
            self.sent += ns
            self.recvd += nr
            remote = self.remote
            if remote[dst]:
                self.sent_inter += ns
            if remote[src]:
                self.recvd_inter += nr
            if self.trace:
                self.print_send(step, dst, ns)
            if self.rec is not None:
                self.note(step, "send", dst, sendbuf)
                self.note(step, "recv", src, recvbuf)
            return [self.comm.Isend([sendbuf, BYTE], dst, self.tag),
                    self.comm.Irecv([recvbuf, BYTE], src, self.tag)]
        return self.isend(step, sendbuf, dst) + self.irecv(step, recvbuf, src)

    def note(self, step, kind, peer, buf):
        """--trace: remember the message; with the recorder's peek (minipar.explain), a sent
        float64 buffer's first and last values too, which name the piece it carries."""
        entry = (step, kind, peer, buf.nbytes)
        if self.rec.peek and kind == "send" and buf.dtype == np.float64:
            entry += (float(buf[0]), float(buf[-1]))
        self.log.append(entry)

    def print_send(self, step, dst, nbytes):
        w = self.g.world_ranks
        print(f"rank {w[self.g.rank]} -> {w[dst]} | {self.name} step {step}/{self.nsteps} | "
              f"{nbytes} B", flush=True)

    # Waiting.

    def wait(self, reqs):
        """Poll until every request completed, yielding the core between polls (ranks often
        outnumber cores, and the peer we wait for may need it), napping after a while."""
        testall = MPI.Request.Testall
        if testall(reqs):
            return
        start = time.monotonic()
        while not testall(reqs):
            os.sched_yield()
            waited = time.monotonic() - start
            if waited > _NAP_AFTER:
                if waited > self.g.timeout:
                    self.give_up(reqs, waited)
                time.sleep(_NAP)

    def give_up(self, reqs, waited):
        done_before = []
        for r in reqs:                          # leave nothing half-posted behind us
            done_before.append(r == MPI.REQUEST_NULL or r.Test())
            if not done_before[-1]:
                try:
                    r.Cancel()
                except MPI.Exception:
                    pass
        w = self.g.world_ranks
        posted = self.posted
        if len(posted) == len(reqs):                # name only the messages still pending
            posted = [d for d, done in zip(posted, done_before) if not done]
        what = " and ".join(f"{verb} rank {w[peer]} ({n} B)" for verb, peer, n in posted)
        raise CommTimeout(
            f"rank {w[self.g.rank]}: {self.name} step {self.step}/{self.nsteps} gave up after "
            f"{waited:.1f} s waiting to {what or 'complete'} (MINIPAR_COMM_TIMEOUT="
            f"{self.g.timeout:g}); is that rank in a different call, or dead?")

    def done(self):
        end = time.perf_counter()
        account(self.name, self.axis, self.sent, self.recvd, end - self.t0, self.sent_inter,
                 self.recvd_inter)
        if self.rec is not None:
            self.rec.call(self, end)


def run(call, steps):
    """Drive a collective generator to the end, blocking: the synchronous path."""
    testall = MPI.Request.Testall
    call.blocking = True
    try:
        reqs = next(steps)
        while True:
            if not testall(reqs):
                call.wait(reqs)
            reqs = steps.send(None)
    except StopIteration as stop:
        call.done()
        return stop.value


class Handle:
    """A collective in flight. test() advances it as far as possible without blocking and
    says whether it is finished; wait() finishes it and returns the result.

    Progress happens only inside test()/wait() (and MPI calls), so call test() now and then
    while doing other work, e.g. from a gradient hook between layers of backward. Finish
    every handle (wait(), or test() until True): its buffers are in flight until then, and
    the other ranks are waiting for its messages.
    """

    __slots__ = ("_call", "_steps", "_reqs", "_done", "_result", "_last")

    def __init__(self, call, steps):
        call.asynchronous = True
        self._call, self._steps = call, steps
        self._done, self._result = False, None
        self._reqs = []
        self._last = time.monotonic()
        self._advance()                         # post the first step right away

    def _advance(self):
        try:
            self._reqs = self._steps.send(None)
        except StopIteration as stop:
            self._done, self._result, self._reqs = True, stop.value, []
            self._call.done()
        self._last = time.monotonic()

    def test(self):
        while not self._done and MPI.Request.Testall(self._reqs):
            self._advance()
        if not self._done:
            waited = time.monotonic() - self._last
            if waited > self._call.g.timeout:
                self._call.give_up(self._reqs, waited)
        return self._done

    def wait(self):
        while not self.test():
            if time.monotonic() - self._last < _NAP_AFTER:
                os.sched_yield()
            else:
                time.sleep(_NAP)
        return self._result

    @property
    def done(self):
        return self._done


class Done:
    """A handle that finished when it was made, for the callers of a non-blocking collective
    that computed the result at once (ZeRO++'s qgZ, a lab's blocking seam): test() is True,
    wait() gives the result."""

    done = True

    def __init__(self, value):
        self.value = value

    def test(self):
        return True

    def wait(self):
        return self.value
