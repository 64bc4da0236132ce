"""--trace FILE.json: what every rank did and when, as one file for Perfetto (ui.perfetto.dev)
or chrome://tracing, in the Trace Event Format that PyTorch's profiler also writes.

What is recorded (docs/pictures.md shows how to read it):
- one process row per rank, named by its grid coordinates ("rank 5 dp1 tp0 pp1"), with two
  threads: compute (tid 1) and communication (tid 2);
- compute spans ("X" events): each training step, each micro-batch's forward and backward
  (category "microbatch", args kind F/B, mb, stage), each layer inside them ("h.3 forward",
  "h.3 backward"), the waits after backward, the optimizer step, validation, checkpoint
  saves and the --verify twin;
- every collective and point-to-point call (category "comm"): op, algorithm, group axis, the
  group (its world ranks), peers, bytes sent and received, and each message (step,
  send/recv, peer, bytes). A blocking call is an "X" span on the communication thread; a
  call that runs in the background (a Handle: data parallelism's buckets, a pipeline's
  sends) is an async pair ("b" when it starts, "e" when it completes, matched by id),
  because several of them are in flight at once and one thread's spans may not overlap.

How:
- Off (the default), RECORDER is None: `span()` and `layer()` return one shared no-op
  context, comm's Call and the autograd loop test `RECORDER is not None` once per message or
  node, and nothing is stored.
- Per-layer backward spans come for free from the autograd's order: backward walks nodes
  in reverse creation order (tensor.py), so the nodes that `layer("h.3")` saw created in
  forward are walked back to back. layer() notes the creation numbers around the layer;
  backward_labeler() turns each run of nodes from one layer into one span.
- Clocks: each rank times with its own perf_counter. At start, rank 0 plays ping-pong with
  every rank (8 rounds; the round with the smallest round trip wins) and estimates that
  rank's offset as (t_sent + t_back)/2 - t_rank, good to half that round trip. finish()
  sends every rank's events to rank 0 (point-to-point, one rank at a time, any job size),
  which shifts them onto its own clock and writes the file atomically. The offsets and
  round trips are in the file's metadata (otherData.minipar).
- The trace's own messages (ping-pong, gathering) are kept out of the ledger, so the comm
  events of a rank add up exactly to what its ledger (comm.traffic_by_axis) counted while
  recording: the metadata keeps that part of each rank's ledger ("ledger_by_axis": calls,
  bytes_sent, bytes_recv per axis) to check it.
"""
from __future__ import annotations

import bisect
import contextlib
import itertools
import time

RECORDER = None             # this process's Recorder while tracing, else None
nodes = itertools.count()   # numbers the autograd's graph nodes in order of creation (tensor.py);
                            # here, below the autograd, so that layer() can bracket a layer's nodes

COMPUTE, COMM = 1, 2        # the two threads of every rank's process row
NOTHING = _NULL = contextlib.nullcontext()      # what span() is when tracing is off
PING_ROUNDS = 8


class Recorder:
    """This rank's events, in its own clock (perf_counter seconds)."""

    def __init__(self, name: str, peek: bool = False):
        self.name = name                # the process row's name
        self.peek = peek                # also keep each float64 message's first/last value
        self.clock = [(0.0, 0.0)]       # rank 0: [(offset_s, rtt_s)] per rank (show/tracing.py)
        self.ledger0 = {}               # the ledger by axis when recording began
        self.t0 = time.perf_counter()
        self.events = []                # [ph, name, cat, tid, start, end, args, id]
        self.layers = []                # (first seq, last seq, name): forward layers, in order
        self.layer_lo = []              # their first seqs (bisect)
        self.in_layer = False
        self.ids = 0                    # async event ids
        self.paused = 0

    def complete(self, name, cat, start, end, tid=COMPUTE, args=None):
        if not self.paused:
            self.events.append(["X", name, cat, tid, start, end, args, None])

    def call(self, c, end):
        """A finished comm Call (comm/calls.py): a span on the communication thread."""
        if self.paused:
            return
        w = c.g.world_ranks
        msgs = [[step, kind, w[peer], n] + extra for step, kind, peer, n, *extra in c.log]
        args = {"op": c.name, "algorithm": c.algorithm, "axis": c.axis, "group": list(w),
                "peers": sorted({m[2] for m in msgs}), "bytes_sent": c.sent, "bytes_recv": c.recvd,
                "steps": c.nsteps, "messages": msgs}
        if c.asynchronous:
            self.ids += 1
            self.events.append(["b", c.name, "comm", COMM, c.t0, end, args, self.ids])
        else:
            self.events.append(["X", c.name, "comm", COMM, c.t0, end, args, None])

    def backward_labeler(self):
        """f(seq) for each node backward visits, f(None) at the end: a span per run of
        nodes from one forward layer ("h.3 backward"); nodes outside every layer are one
        span "backward (no layer)"."""
        current = [None, None]          # layer name, start time

        def label(seq):
            name = None
            if seq is not None:
                i = bisect.bisect_right(self.layer_lo, seq) - 1
                if i >= 0 and seq <= self.layers[i][1]:
                    name = self.layers[i][2]
                name = name or "(no layer)"
            if name != current[0]:
                now = time.perf_counter()
                if current[0] is not None:
                    self.complete(f"{current[0]} backward", "layer", current[1], now,
                                  args={"layer": current[0], "pass": "backward"})
                current[0], current[1] = name, now
        return label


# --- what the code calls (all no-ops when tracing is off) ---------------------------------------

@contextlib.contextmanager
def _span(rec, name, cat, args):
    start = time.perf_counter()
    try:
        yield
    finally:
        rec.complete(name, cat, start, time.perf_counter(), args=args or None)


def span(name: str, cat: str, **args):
    """with trace.span("optimizer step", "optimizer"): ... -> a compute span."""
    rec = RECORDER
    return _NULL if rec is None else _span(rec, name, cat, args)


@contextlib.contextmanager
def _layer(rec, name):
    lo = next(nodes)
    rec.in_layer = True
    start = time.perf_counter()
    try:
        yield
    finally:
        rec.in_layer = False
        rec.complete(f"{name} forward", "layer", start, time.perf_counter(),
                     args={"layer": name, "pass": "forward"})
        rec.layers.append((lo, next(nodes), name))
        rec.layer_lo.append(lo)


def layer(name: str):
    """with trace.layer("h.3"): x = block(x) -> a forward span, and the backward of the nodes
    made inside becomes a span "h.3 backward". Layers do not nest: inside one, this is a
    plain forward span."""
    rec = RECORDER
    if rec is None:
        return _NULL
    if rec.in_layer:
        return _span(rec, f"{name} forward", "layer", {"layer": name, "pass": "forward"})
    return _layer(rec, name)


@contextlib.contextmanager
def paused():
    """Record nothing inside (the --verify twin: one span for the whole re-run)."""
    rec = RECORDER
    if rec is not None:
        rec.paused += 1
    try:
        yield
    finally:
        if rec is not None:
            rec.paused -= 1


def install(rec: Recorder | None) -> Recorder | None:
    """Make `rec` this process's recorder (None: stop recording); returns the one before.
    minipar/show/tracing.py starts and finishes a run's trace with it."""
    global RECORDER
    prev, RECORDER = RECORDER, rec
    return prev
