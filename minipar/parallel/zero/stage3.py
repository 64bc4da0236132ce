"""ZeRO stage 3: stage 2 with the parameters sharded too.

One step (stage1.py says what a ready unit is):
  stage 3  the parameters themselves are sharded. Before a block's forward its unit is
           all-gathered (the embedding units before the first block), and released right
           after; an identity autograd Function placed after the block (`Regather`)
           all-gathers it again when backward reaches the block, and the gradient hook
           that finds the unit ready reduce-scatters its gradient and releases the
           parameters. The update writes the shard; nothing is gathered after it.
           Bytes: 2 all-gathers + 1 reduce-scatter per micro-batch = 1.5x plain DP.

What "released" means here. DeepSpeed frees a gathered parameter's storage in place. In
NumPy the ops of the block's forward keep references to the arrays they saved for backward
(the weights among them), exactly as they keep activations, so the gathered buffer cannot be
returned to the allocator until backward has passed the block. minipar therefore does what
can be checked: at release the buffer is overwritten with NaN and the parameters point at a
read-only NaN placeholder of their shape (no memory), so any use of a released parameter,
or a backward without its re-gather, turns the loss or the gradients into NaN; the re-gather
writes into the same buffer, and after the unit's backward the buffer is dropped. The
persistent state of a rank (what the summary's `memory` counts) is its shards only.

Hiding the gathers (FSDP2's prefetch and reshard_after_forward):
  prefetch K     when block i's gather is waited for, the gathers of the next K blocks are
                 started too (non-blocking messages), so they travel while block i computes:
                 in forward blocks i+1..i+K, in backward i-1..i-K. A gather that has not
                 arrived when its block starts is waited for: the exposed wait, counted per
                 phase (comm.count("zero", "forward"/"backward", waited=s)).
  reshard off    the forward does not release a block's parameters: they stay gathered until
                 its backward has used them, so backward gathers nothing (1 all-gather per
                 micro-batch instead of 2) and the whole model is gathered at the end of forward.
  Gathered bytes at the peak (formulas.gathered_peak, measured as gathered_peak here): the
  embedding-side units, which stay from embed to head, plus the largest K+1 consecutive blocks
  (reshard on), or every block (off).
With --recompute full a block's forward runs again inside backward (recompute.replaying): its
units are gathered for it (the second all-gather) and kept for the backward that follows it.
"""
from __future__ import annotations

import numpy as np

import time

from minipar import comm, trace
from minipar.autograd import recompute
from minipar.autograd.tensor import Function, is_grad_enabled
from minipar.parallel.zero.formulas import gathered_peak
from minipar.parallel.zero.stage2 import Stage2
from minipar.parallel.zero.units import Unit, _placeholder
from minipar.parallel.zero.zpp import Wire


class Regather(Function):
    """Identity in value, placed after a piece of the model (block i, or the head for the
    embedding-side units). Forward: the piece's units are released (their forward is over;
    with --reshard-after-forward off, kept). Backward: they are gathered again, before the
    ops that produced x run their backward with them, and the next pieces' gathers are
    prefetched (Gathers.backward_enter)."""

    def forward(self, x, gathers, key, keep=False):
        self.gathers, self.key = gathers, key
        if not keep:
            for u in gathers.units_of(key):
                gathers.sync.release(u)
        return x

    def backward(self, g):
        self.gathers.backward_enter(self.key)
        return g, None, None, None


class Stage3(Stage2):
    """Stage 2, plus: the parameters sharded. They are gathered around each piece of the
    model's forward and backward (gather, release, Regather) and live as shards between.
    prefetch: the K pieces gathered ahead; reshard_after_forward: release after forward."""

    stage = 3
    params_sharded = True       # a parameter shard per unit, no full parameter buffer
    prefetch = 0                # blocks gathered ahead (LabZero, labs/08_zero, keeps 0)
    tracks_gathers = True       # gathered_peak, secondary_peak and the waits are counted (not LabZero's)

    def __init__(self, model, units: list[Unit], group: comm.Group, dtype, prefetch: int = 0,
                 reshard_after_forward: bool = True, wire: Wire | None = None):
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.wire = wire or Wire()                          # plain, or ZeRO++ (zpp.py)
        self.wire.bind(units)
        self.gathered_bytes = self.gathered_peak = 0        # gathered buffers in use, and their peak this step
        self.secondary_peak = 0                             # hpZ's secondary shards held, at the peak
        self.in_step = False
        super().__init__(model, units, group, dtype)
        if not isinstance(model.parts.gathers, Gathers):
            raise ValueError("ZeRO-3 gathers each unit around its piece of the forward: build the model with "
                             "Parts(gathers=stage3.Gathers()) (parallelize does, for --zero 3)")
        model.parts.gathers.bind(self)

    def adopt(self, u: Unit):
        """The unit's parameters start released: placeholders until the first gather."""
        u.gather_handle, u.live = None, False
        for p in u.params:
            p.data = _placeholder(p.shape, self.dtype)

    def param_bytes(self) -> int:
        """Bytes of the parameter buffers this rank keeps: the shards."""
        return sum(u.param_shard.nbytes for u in self.units)

    def own_params(self, u: Unit) -> np.ndarray:
        """This rank's shard of the unit's parameters, which the update writes: the shard itself."""
        return u.param_shard

    def after_update(self, u: Unit, w_shard: np.ndarray):
        """Nothing is gathered after the update: the next forward gathers."""

    def gathered_formula(self) -> int:
        """formulas.gathered_peak for this rank's units: what gathered_peak should reach."""
        g, size = self.model.parts.gathers, lambda us: sum(u.n_pad for u in us) * self.dtype.itemsize
        return gathered_peak(size(g.outer), [size(g.blocks[i]) for i in g.order], self.prefetch,
                             self.reshard_after_forward)

    def secondary_formula(self) -> int:
        """hpZ: the secondary shards held at the end of a forward, every unit's n_pad/k."""
        if not self.wire.hpz:
            return 0
        return sum(u.n_pad // u.local.size for u in self.units) * self.dtype.itemsize

    def start_step(self):
        super().start_step()
        self.gathered_peak, self.in_step = self.gathered_bytes, True
        self.secondary_peak = self.wire.secondary_bytes(self.units)

    def finish(self):
        super().finish()
        self.in_step = False

    def _unit_ready(self, u: Unit):
        """Stage 2's reduce-scatter (qgZ's quantized all-to-alls), then backward is done with
        the unit's parameters."""
        if self.wire.qgz:
            u.handle = self.wire.reduce_scatter(u, u.grad_staging)
        else:
            super()._unit_ready(u)
        self.release(u, after_backward=True)

    # --- gathering and releasing parameters ------------------------------------------------
    def start(self, u: Unit, again: bool = False):
        """Start the unit's all-gather (non-blocking), unless its parameters are gathered or on
        their way. again: backward's, into the buffer the forward's ops kept (the module
        docstring); else into a new one."""
        if u.live:
            return
        if not again or u.param_gathered is None:
            u.param_gathered = np.empty(u.n_pad, dtype=self.dtype)
        u.gather_handle = self.wire.start_gather(u, again)
        u.live = True
        self.gathered_bytes += u.param_gathered.nbytes
        self.gathered_peak = max(self.gathered_peak, self.gathered_bytes)

    def gather(self, u: Unit, again: bool = False, phase: str = "forward"):
        """The unit's parameters, there: start its all-gather if nobody has, wait for it (the
        exposed wait of `phase`), and point the parameters at the result."""
        self.start(u, again)
        if u.gather_handle is not None:
            t0 = time.perf_counter()
            with trace.span(f"wait for all-gather {u.names[0]}", "zero", phase=phase, unit=u.names[0]):
                u.gather_handle.wait()
            comm.count("zero", phase, waited=time.perf_counter() - t0)
            u.gather_handle = None
            self.wire.landed(u)
            self.secondary_peak = max(self.secondary_peak, self.wire.secondary_bytes(self.units))
        u.point(u.param_gathered)

    def poll(self):
        """Push every gather in flight along (between pieces of the model)."""
        for u in self.units:
            if u.gather_handle is not None:
                u.gather_handle.test()

    def release(self, u: Unit, after_backward: bool = False):
        """Forward is done with the unit (poison the buffer, keep it for the re-gather when a
        graph holds it; with reshard_after_forward off, in a training step, keep it as it is),
        or backward is (drop it)."""
        if not after_backward and not self.reshard_after_forward and self.in_step:
            return
        if u.gather_handle is not None:          # a prefetch nobody used (an interrupted forward)
            u.gather_handle.wait()
            u.gather_handle, u.wire_recv = None, None
        if after_backward or not self.in_step:
            u.secondary = None                   # hpZ: backward is done with the unit
        for p in u.params:
            p.data = _placeholder(p.shape, self.dtype)
        if u.live:
            self.gathered_bytes -= u.param_gathered.nbytes
            u.live = False
        if u.param_gathered is None:
            return
        if after_backward or not is_grad_enabled():
            u.param_gathered = None
        else:
            u.param_gathered.fill(np.nan)


class Gathers:
    """Parts.gathers under ZeRO-3: the gathers around the model's pieces (embed, block i,
    head). The embedding-side units are gathered before embed and released after head; a
    block's units before the block and released after it (Regather gathers them again in
    backward); with prefetch K the next K blocks' gathers start when a block's is waited for.
    Built with the model (parallelize), before the units exist; Stage3 binds its units when
    it is built, and until then the pieces run as they are."""

    OUTER = "outer"

    def __init__(self):
        self.sync = None
        self.blocks = {}                             # block i -> its units (with experts: two)
        self.outer = []                              # the embedding-side units
        self.order = []                              # the block indices, in forward order

    def bind(self, sync: Stage3):
        self.sync = sync
        family = sync.model.family
        for u in sync.units:
            i = family.block_of(u.names[0])
            if i is not None:
                self.blocks.setdefault(i, []).append(u)
        self.outer = [u for u in sync.units if family.block_of(u.names[0]) is None]
        self.order = sorted(self.blocks)

    def units_of(self, key) -> list:
        return self.outer if key == self.OUTER else self.blocks[key]

    def _ahead(self, i, step: int) -> list:
        """The K blocks after block i in forward (step 1) or backward (step -1) order; i None:
        the first K of that order."""
        order = self.order if step > 0 else self.order[::-1]
        at = 0 if i is None else order.index(i) + 1
        return order[at:at + self.sync.prefetch]

    def _prefetch(self, i, step: int):
        for j in self._ahead(i, step):
            for u in self.blocks[j]:
                self.sync.start(u, again=step < 0)

    def embed(self, run, idx):
        if self.sync is not None:
            for u in self.outer:
                self.sync.gather(u)
            self._prefetch(None, 1)
        return run(idx)

    def block(self, run, i: int, x):
        if self.sync is None:
            return run(i, x)
        replay = recompute.replaying()               # --recompute full: the forward again, in backward
        for u in self.blocks[i]:
            self.sync.gather(u, again=replay, phase="backward" if replay else "forward")
        if replay:
            self._prefetch(i, -1)
        else:
            self._prefetch(i, 1)
        self.sync.poll()
        return Regather.apply(run(i, x), self, i, replay)

    def head(self, run, x):
        return run(x) if self.sync is None else Regather.apply(run(x), self, self.OUTER, False)

    def backward_enter(self, key):
        """Backward reaches the piece `key`: its units gathered again (unless kept), the next
        K blocks of backward prefetched."""
        for u in self.units_of(key):
            self.sync.gather(u, again=True, phase="backward")
        self._prefetch(None if key == self.OUTER else key, -1)
        self.sync.poll()
