"""Group, the traffic ledger, and the one way a message moves: a polled Isend/Irecv.

Everything in `minipar.comm` is built from the pieces in this file:

- `Group(mpi_comm)` wraps a communicator (world or a sub-group, any size, 1 included). It
  duplicates it, so minipar's messages can never be confused with anyone else's.
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
- Every message is counted in a per-process ledger twice: under the name of the top-level
  call (`traffic()`: all_reduce, send, ...) and under the axis of the group it was sent on
  (`traffic_by_axis()`: "dp", "tp", "pp", "zero", "world", None for an untagged group);
  `reset_traffic()` clears both. Each call's counts go to both, so for every field
  (calls, bytes_sent, bytes_recv) the axes sum to the same total as the operations. The axis
  is a label given where the group is made (`Group(comm, axis="dp")`, or `g.with_axis("zero")`
  for the same group's messages under another label): the bytes of each parallelism axis
  are tagged where they are sent, not guessed afterwards from operation names. Messages
  are also printed when `MINIPAR_TRACE=1`: `rank 1 -> 2 | all_reduce step 3/6 | 4096 B`
  (world ranks, printed by the sender).
- `MINIPAR_DEBUG=1`: before each collective the ranks all-gather a short description of the
  call (operation, dtype, shape, root, op, call number) and every rank raises
  `CollectiveMismatch` listing what each rank called if they differ.
- `send(g, x, dst)` / `recv(g, src)` carry dtype and shape in a 128-byte header message
  followed by the payload message; both are counted in the ledger. `send_async` and
  `recv_async` post the same messages and return a Handle (a pipeline's sends must not block).

Bytes go on the wire as raw bytes (MPI.BYTE), so any NumPy dtype works, float16 and
ml_dtypes' bfloat16 included; reductions are NumPy ufuncs applied in place.
"""
import functools
import os
import socket
import sys
import time
import traceback

import numpy as np
from mpi4py import MPI

from minipar import trace as _trace

BYTE = MPI.BYTE
OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}

# Tags: collective call k of a group uses tag k % _TAG_CYCLE (so overlapping async calls never
# match each other's messages); point-to-point and the debug check have their own tags.
# The MPI standard guarantees tags up to 32767.
_TAG_CYCLE = 32000
TAG_P2P = 32001
TAG_DEBUG = 32002
TAG_TOPOLOGY = 32003
TAG_P2P_GRAD = 32004        # a second point-to-point stream: the pipeline's gradients (tag=)
HOST_BYTES = 64             # a host name as exchanged when a Group is made
HEADER_BYTES = 128          # send/recv header: b"<dtype>|<shape>" padded with zeros
_NAP_AFTER = 0.05           # seconds of waiting before it sleeps between polls
_NAP = 0.0005


class CommError(RuntimeError):
    """A collective or point-to-point call failed."""


class CommTimeout(CommError, TimeoutError):
    """No progress for MINIPAR_COMM_TIMEOUT seconds."""


class CollectiveMismatch(CommError):
    """MINIPAR_DEBUG: ranks of a group called different collectives (or shapes, dtypes...)."""


def _env_flag(name):
    return os.environ.get(name, "0").strip().lower() not in ("", "0", "false", "no", "off")


# --------------------------------------------------------------------------------------------
# The ledger: {key: {"calls", "bytes_sent", "bytes_recv", "seconds"}} for this process, kept
# twice: by top-level operation and by the axis of the group (Group.axis). Every finished
# call adds its counts to one entry of each, so the two always have the same totals.

_LEDGER = {}        # op -> [calls, bytes_sent, bytes_recv, seconds, bytes_sent_inter, bytes_recv_inter]
_AXES = {}          # axis -> the same fields: the same calls, by axis
_FIELDS = ("calls", "bytes_sent", "bytes_recv", "seconds", "bytes_sent_inter", "bytes_recv_inter")


def traffic():
    """What this process sent and received, per top-level operation (a copy)."""
    return {name: dict(zip(_FIELDS, entry)) for name, entry in _LEDGER.items()}


def traffic_by_axis():
    """What this process sent and received, per axis of the group it went through (a copy):
    {axis: {"calls", "bytes_sent", "bytes_recv", "seconds"}}; axis None for untagged groups."""
    return {axis: dict(zip(_FIELDS, entry)) for axis, entry in _AXES.items()}


def reset_traffic():
    """Clear the ledger: by operation and by axis."""
    _LEDGER.clear()
    _AXES.clear()


class untracked:
    """with comm.untracked(): ... -> messages sent inside are left out of the ledger (and
    of a --trace): the trace's own clock ping-pong and gathering (minipar/trace/__init__.py)."""

    def __enter__(self):
        self.saved = ({k: list(v) for k, v in _LEDGER.items()}, {k: list(v) for k, v in _AXES.items()})
        self.rec, _trace.RECORDER = _trace.RECORDER, None

    def __exit__(self, *exc):
        for ledger, saved in zip((_LEDGER, _AXES), self.saved):
            ledger.clear()
            ledger.update(saved)
        _trace.RECORDER = self.rec


def _account(name, axis, sent, recvd, seconds, sent_inter, recvd_inter):
    """One finished call, added to both ledgers: under its operation and under its axis."""
    for ledger, key in ((_LEDGER, name), (_AXES, axis)):
        e = ledger.get(key)
        if e is None:
            ledger[key] = [1, sent, recvd, seconds, sent_inter, recvd_inter]
        else:
            e[0] += 1
            e[1] += sent
            e[2] += recvd
            e[3] += seconds
            e[4] += sent_inter
            e[5] += recvd_inter


# --------------------------------------------------------------------------------------------

_HOOK_INSTALLED = False


def abort_on_error():
    """Make an uncaught exception on any rank print its traceback and end the whole job.

    Without this, the other ranks would wait for the dead one (until their timeout).
    Installed by the first Group created in a world of more than one process.
    """
    global _HOOK_INSTALLED
    if _HOOK_INSTALLED:
        return
    _HOOK_INSTALLED = True
    previous = sys.excepthook

    def hook(kind, value, tb):
        if MPI.Is_finalized() or MPI.COMM_WORLD.Get_size() == 1:
            return previous(kind, value, tb)
        text = "".join(traceback.format_exception(kind, value, tb))
        rank = MPI.COMM_WORLD.Get_rank()
        sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        sys.stderr.write(f"[rank {rank}] aborting the job (uncaught exception)\n")
        abort_world(1)

    sys.excepthook = hook


# How long an aborting rank lets the launcher forward what it has just printed: MPICH's
# hydra tears the job down as soon as it handles the abort, and may do so before it has
# read the rank's last lines from their pipe (seen: an empty stderr, 1 run in 12 on 2 busy
# cores, when two ranks abort at once).
ABORT_GRACE_S = 0.3


def abort_world(code: int):
    """End every rank of the job with exit code `code`, after flushing this rank's output
    and giving the launcher ABORT_GRACE_S to forward it. Never returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)             # Abort can return when another rank's abort is already ending the job


class Group:
    """A set of ranks that talk to each other: wraps (a duplicate of) an mpi4py communicator.

    g.rank, g.size    this process's rank in the group, and the group size
    g.comm            the duplicated communicator (safe to use for MPI's own calls in tests)
    g.world_ranks     world rank of each group rank (what the trace prints)
    g.axis            the ledger category of its messages (traffic_by_axis): the parallelism
                      axis, "dp", "tp", "pp" (ProcessGrid's groups), "world"...; None: untagged
    g.with_axis(a)    the same group, its messages counted under axis a (see with_axis)
    g.nodes           the host of each group rank, numbered 0, 1, ... in order of first
                      appearance; g.node, g.n_nodes; g.local_ranks (the group ranks on this
                      rank's host) and g.local_rank (this rank's index among them)
    debug, trace, timeout default to MINIPAR_DEBUG, MINIPAR_TRACE, MINIPAR_COMM_TIMEOUT;
    host (the name this rank reports) to MINIPAR_HOST, else socket.gethostname().

    Which ranks share a host is learnt when the group is made: the ranks pass their host
    names round a ring (p-1 steps of HOST_BYTES; set-up, like the communicator's Dup, so not
    in the ledger). Every message is then also counted as inter-host or not (the ledger's
    bytes_sent_inter, bytes_recv_inter), and a group that spans hosts uses the hierarchical
    algorithms (hierarchical.py) for large messages.
    """

    def __init__(self, comm, *, axis=None, debug=None, trace=None, timeout=None, host=None):
        self.comm = comm.Dup()          # a message space of our own (creating one is allowed)
        self.axis = axis
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        mine, world = self.comm.Get_group(), MPI.COMM_WORLD.Get_group()
        ranks = mine.Translate_ranks(list(range(self.size)), world)
        mine.Free()
        world.Free()
        self.world_ranks = [w if w != MPI.UNDEFINED else r for r, w in enumerate(ranks)]
        self.debug = _env_flag("MINIPAR_DEBUG") if debug is None else bool(debug)
        self.trace = _env_flag("MINIPAR_TRACE") if trace is None else bool(trace)
        self.timeout = float(os.environ.get("MINIPAR_COMM_TIMEOUT", "600")) if timeout is None \
            else float(timeout)
        self.calls = 0                  # collective calls so far: tag and debug call number
        self._scratch = [None, None]    # receive buffers reused by blocking calls: scratch()
        self._views = {}                # (slot, shape, dtype) -> view of a scratch buffer
        self.receiving = set()          # sources with a recv_async in flight (one at a time)
        if MPI.COMM_WORLD.Get_size() > 1:
            abort_on_error()
        self.host = host or os.environ.get("MINIPAR_HOST") or socket.gethostname()
        self.remote = (False,) * self.size           # until the hosts are known
        self.set_nodes(_exchange_hosts(self))

    def set_nodes(self, hosts):
        """The topology from every group rank's host name (in group order)."""
        first = {}
        self.nodes = tuple(first.setdefault(h, len(first)) for h in hosts)
        self.hosts = tuple(first)                       # the host names, by node number
        self.n_nodes = len(first)
        self.node = self.nodes[self.rank]
        self.local_ranks = tuple(q for q, n in enumerate(self.nodes) if n == self.node)
        self.local_rank = self.local_ranks.index(self.rank)
        self.remote = tuple(n != self.node for n in self.nodes)    # is group rank q on another host?

    def with_axis(self, axis):
        """This group with its messages counted under `axis` in the ledger: a view (AxisView)
        that shares everything else with g (communicator, call counter and hence tags,
        scratch buffers, pending receives, debug/trace/timeout), so calls on the view and on
        g interleave like calls on g alone. E.g. ZeRO talks on the dp group's ranks but is
        counted apart:

            zero_group = grid.dp_group.with_axis("zero")
        """
        return AxisView(self, axis)

    def __repr__(self):
        axis = "" if self.axis is None else f"axis={self.axis!r}, "
        return f"Group({axis}rank={self.rank}, size={self.size}, world_ranks={self.world_ranks})"

    def begin(self, name, nsteps, describe=None, algorithm=None):
        """Start collective call `name`: a fresh Call, after the debug agreement if enabled.

        describe: a string of everything the ranks must agree on (dtype, shape, op, root...).
        algorithm: its name in a --trace ("ring", "recursive doubling", ...).
        """
        self.calls += 1
        if self.debug and self.size > 1:
            _agree(self, f"{name}({describe or ''})")
        return Call(self, name, nsteps, self.calls % _TAG_CYCLE, algorithm)

    def scratch(self, slot, shape, dtype):
        """Buffer `slot` (0 or 1) viewed as an array of `shape` and `dtype`, reused from call to
        call: what blocking collectives receive into before reducing.

        A fresh np.empty per call is cheap for small messages but, for large ones, is
        page-faulted in again on every call once it is above glibc's mmap threshold (e.g. the
        64 MiB receive buffer of a reduce-scatter of 64 MiB): about a tenth of the call. Each
        slot grows to the largest size asked for and is kept for the life of the Group (its
        axis views use the same). Only blocking calls use it (one at a time); a Handle's
        buffers are its own, since several may be in flight at once.
        """
        key = (slot, shape, dtype)
        view = self._views.get(key)             # the same shapes come back call after call
        if view is None:
            dtype = np.dtype(dtype)
            n = dtype.itemsize
            for d in shape:
                n *= d
            buf = self._scratch[slot]
            if buf is None or buf.nbytes < n:
                buf = self._scratch[slot] = np.empty(max(n, 64), np.uint8)
                self._views.clear()             # views of the old, smaller buffer
            if len(self._views) > 64:
                self._views.clear()
            view = self._views[key] = buf[:n].view(dtype).reshape(shape)
        return view


class AxisView(Group):
    """Group.with_axis(axis): a group under another axis label. Its own attributes are `axis`
    and `group` (the Group it views); every other attribute is read from and written to that
    group, so both use one communicator, one call counter (collective tags never collide),
    the same scratch buffers, pending receives and settings. The methods are Group's, so a
    call started on the view is a Call of the view and counted under its axis.

    Plain Groups pay nothing for the forwarding (__getattr__): it runs on views only.
    """

    def __init__(self, group, axis):
        object.__setattr__(self, "group", group)
        object.__setattr__(self, "axis", axis)

    def __getattr__(self, name):                # only for names the view does not have
        if name == "group":                     # not set yet (copy.copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.group, name)

    def __setattr__(self, name, value):         # e.g. g.calls += 1 in begin(): the group's
        if name == "axis":
            object.__setattr__(self, name, value)
        else:
            setattr(self.group, name, value)

    def with_axis(self, axis):
        return AxisView(self.group, axis)


def _exchange_hosts(g):
    """Every group rank's host name, in group order: a ring all-gather of HOST_BYTES each on
    g's communicator, polled like every wait (a Call never done(): not in the ledger)."""
    p, r = g.size, g.rank
    table = np.zeros((p, HOST_BYTES), np.uint8)
    raw = g.host.encode()[:HOST_BYTES]
    table[r, :len(raw)] = np.frombuffer(raw, np.uint8)
    if p > 1:
        call = Call(g, "topology", p - 1, TAG_TOPOLOGY)
        right, left = (r + 1) % p, (r - 1) % p
        for s in range(p - 1):
            call.wait(call.sendrecv(s + 1, table[(r - s) % p], right, table[(r - s - 1) % p], left))
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in table]


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
        _account(self.name, self.axis, self.sent, self.recvd, end - self.t0, self.sent_inter,
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


# --------------------------------------------------------------------------------------------
# MINIPAR_DEBUG: agree on the call before making it.

_DESC_BYTES = 256


def _agree(g, what):
    """All-gather every rank's description of the call (a ring, p-1 steps of 256 B) and
    raise on every rank if they differ. Counted in the ledger as "debug_check"."""
    text = f"call #{g.calls}: {what}"
    mine = np.zeros(_DESC_BYTES, np.uint8)
    raw = text.encode()[:_DESC_BYTES]
    mine[:len(raw)] = np.frombuffer(raw, np.uint8)
    p, r = g.size, g.rank
    table = np.empty((p, _DESC_BYTES), np.uint8)
    table[r] = mine
    call = Call(g, "debug_check", p - 1, TAG_DEBUG, "ring")
    right, left = (r + 1) % p, (r - 1) % p
    for s in range(p - 1):                      # ring all-gather: pass along what came in
        reqs = call.sendrecv(s + 1, table[(r - s) % p], right, table[(r - s - 1) % p], left)
        call.wait(reqs)
    call.done()
    texts = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in table]
    if len(set(texts)) > 1:
        w = g.world_ranks
        lines = "\n".join(f"  rank {i} (world {w[i]}): {t}" for i, t in enumerate(texts))
        raise CollectiveMismatch(
            f"MINIPAR_DEBUG: the {p} ranks of group {w} disagree on collective call "
            f"#{g.calls}:\n{lines}")


def describe(x, **extra):
    """The debug description of an array argument and the other arguments."""
    parts = [f"{x.dtype}", f"shape={tuple(x.shape)}"] if x is not None else []
    parts += [f"{k}={v}" for k, v in extra.items()]
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------
# Helpers shared by the algorithms.

def array(x):
    return x if type(x) is np.ndarray else np.asarray(x)


def flat(x):
    """x (an ndarray) as a contiguous 1-D array: a view when possible, never written to."""
    return x.ravel()


def result(out, shape, dtype, what):
    """The array a collective writes into: a new one, or the caller's `out` once checked."""
    if out is None:
        return np.empty(shape, dtype)
    if type(out) is np.ndarray and out.shape == shape and out.dtype == dtype:
        flags = out.flags
        if flags.c_contiguous and flags.writeable:
            return out
    if not (type(out) is np.ndarray and out.shape == tuple(shape) and out.dtype == dtype
            and out.flags.c_contiguous and out.flags.writeable):
        got = (f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__)
        raise ValueError(f"{what}: out must be a writeable C-contiguous {np.dtype(dtype)} array "
                         f"of shape {tuple(shape)}, got {got}")
    return out


def reduce_op(op):
    f = OPS.get(op) if isinstance(op, str) else None
    if f is None:
        raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")
    return f


@functools.lru_cache(maxsize=256)
def split_offsets(n, p):
    """Element offsets of np.array_split(range(n), p): piece i is [off[i], off[i+1]).

    A tuple, cached per (n, p): the same bucket sizes come back every training step, and
    building the list cost more than a small message's whole posting."""
    q, rem = divmod(n, p)
    return tuple(i * q + min(i, rem) for i in range(p + 1))


def check_rank(g, rank, what):
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < g.size:
        raise ValueError(f"{what} must be a rank of the group (0..{g.size - 1}), got {rank!r}")
    return int(rank)


# --------------------------------------------------------------------------------------------
# Point-to-point with dtype and shape: a 128-byte header message, then the payload message.

def _dtype_token(dtype):
    if dtype.fields is not None or dtype.hasobject:
        raise TypeError(f"minipar.comm sends plain numeric arrays, not dtype {dtype}")
    return dtype.name if dtype.kind == "V" else dtype.str      # bfloat16 is kind 'V'


def _token_dtype(token):
    try:
        return np.dtype(token)
    except TypeError:
        import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with NumPy)
        return np.dtype(token)


def encode_header(x):
    text = f"{_dtype_token(x.dtype)}|{','.join(str(d) for d in x.shape)}".encode()
    if len(text) > HEADER_BYTES:
        raise ValueError(f"array header too long ({len(text)} B > {HEADER_BYTES} B): {text!r}")
    header = np.zeros(HEADER_BYTES, np.uint8)
    header[:len(text)] = np.frombuffer(text, np.uint8)
    return header


def decode_header(header):
    token, dims = bytes(header).rstrip(b"\0").decode().rsplit("|", 1)    # uint8 is "|u1"
    shape = tuple(int(d) for d in dims.split(",")) if dims else ()
    return _token_dtype(token), shape


def send(g, x, dst, tag=TAG_P2P):
    """Send array x (any dtype and shape) to group rank dst; returns when x may be reused.
    tag: messages between two ranks arrive in order per tag (TAG_P2P, TAG_P2P_GRAD)."""
    dst = check_rank(g, dst, "dst")
    if dst == g.rank:
        raise ValueError(f"rank {g.rank} cannot send to itself")
    x = np.asarray(x)
    header, payload = encode_header(x), flat(x)
    call = Call(g, "send", 2, tag, "point-to-point")
    call.wait(call.isend(1, header, dst) + call.isend(2, payload, dst))
    call.done()


def recv(g, src, tag=TAG_P2P):
    """Receive the next array group rank src sent with send() (with the same tag)."""
    src = check_rank(g, src, "src")
    if src == g.rank:
        raise ValueError(f"rank {g.rank} cannot receive from itself")
    _check_not_receiving(g, src)
    call = Call(g, "recv", 2, tag, "point-to-point")
    header = np.empty(HEADER_BYTES, np.uint8)
    call.wait(call.irecv(1, header, src))
    dtype, shape = decode_header(header)
    out = np.empty(shape, dtype)
    call.wait(call.irecv(2, out.reshape(-1), src))
    call.done()
    return out


# Non-blocking point-to-point: the same two messages, posted at once and finished later.
# A pipeline needs them: in 1F1B's steady state neighbouring stages send to each other at
# the same moment (activation down, gradient up), and two blocking sends of large arrays
# (rendezvous) wait for each other forever. Messages between two ranks of a group arrive in
# the order they were posted, so send_async/recv_async mix freely with send/recv.

def _send_steps(call, header, payload, dst):
    yield call.isend(1, header, dst) + call.isend(2, payload, dst)


def send_async(g, x, dst, tag=TAG_P2P):
    """Start sending array x to group rank dst; returns a Handle (wait() returns None).
    Counted and traced as "send". Leave x alone until the handle is done: its memory is
    on the wire until then."""
    dst = check_rank(g, dst, "dst")
    if dst == g.rank:
        raise ValueError(f"rank {g.rank} cannot send to itself")
    x = np.asarray(x)
    header = encode_header(x)
    payload = flat(x)
    return _p2p_handle(g, "send", lambda call: _send_steps(call, header, payload, dst), tag)


def _recv_steps(call, src):
    try:
        header = np.empty(HEADER_BYTES, np.uint8)
        yield call.irecv(1, header, src)
        dtype, shape = decode_header(header)
        out = np.empty(shape, dtype)
        yield call.irecv(2, out.reshape(-1), src)
    finally:
        call.g.receiving.discard(src)
    return out


def _check_not_receiving(g, src):
    if src in g.receiving:
        raise CommError(f"rank {g.world_ranks[g.rank]}: a recv_async from rank {g.world_ranks[src]} "
                        f"is still pending; finish it first (its payload receive is posted only "
                        f"once its header has arrived, so a second receive would take that payload)")


def recv_async(g, src):
    """Start receiving the next array group rank src sends; returns a Handle whose wait()
    returns the new array. Counted as "recv". One at a time per source: until it is done,
    another recv or recv_async from src raises CommError."""
    src = check_rank(g, src, "src")
    if src == g.rank:
        raise ValueError(f"rank {g.rank} cannot receive from itself")
    _check_not_receiving(g, src)
    g.receiving.add(src)
    return _p2p_handle(g, "recv", lambda call: _recv_steps(call, src))


def _p2p_handle(g, name, steps, tag=TAG_P2P):
    call = Call(g, name, 2, tag, "point-to-point")
    return Handle(call, steps(call))
