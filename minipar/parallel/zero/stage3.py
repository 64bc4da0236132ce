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
"""
from __future__ import annotations

import numpy as np

from minipar import comm
from minipar.autograd.tensor import Function, is_grad_enabled
from minipar.parallel.zero.stage2 import Stage2
from minipar.parallel.zero.units import Unit, _placeholder


class Regather(Function):
    """Identity in value. Forward: the units' parameters are released (their forward is
    over). Backward: they are all-gathered again, before the ops that produced x run
    their backward with them."""

    def forward(self, x, sync, units):
        self.sync, self.units = sync, units
        for u in units:
            sync.release(u)
        return x

    def backward(self, g):
        for u in self.units:
            self.sync.gather(u, again=True)
        return g, None, None


class Stage3(Stage2):
    """Stage 2, plus: the parameters sharded. They are gathered around each piece of the
    model's forward and backward (gather, release, Regather) and live as shards between."""

    stage = 3
    params_sharded = True       # a parameter shard per unit, no full parameter buffer

    def __init__(self, model, units: list[Unit], group: comm.Group, dtype):
        super().__init__(model, units, group, dtype)
        if not isinstance(model.parts.gathers, Gathers):
            raise ValueError("ZeRO-3 gathers each unit around its piece of the forward: build the model with "
                             "Parts(gathers=stage3.Gathers()) (parallelize does, for --zero 3)")
        model.parts.gathers.bind(self)

    def adopt(self, u: Unit):
        """The unit's parameters start released: placeholders until the first gather."""
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

    def _unit_ready(self, u: Unit):
        """Stage 2's reduce-scatter, then backward is done with the unit's parameters."""
        super()._unit_ready(u)
        self.release(u, after_backward=True)

    # --- gathering and releasing parameters ------------------------------------------------
    def gather(self, u: Unit, again: bool = False):
        """All-gather the unit's parameters and point them at the result. again: backward's
        re-gather, into the buffer the forward's ops kept (see the module docstring)."""
        if not again or u.param_gathered is None:
            u.param_gathered = comm.all_gather(u.group, u.param_shard)          # (n_pad,)
        else:
            comm.all_gather(u.group, u.param_shard, out=u.param_gathered)
        u.point(u.param_gathered)

    def release(self, u: Unit, after_backward: bool = False):
        """Forward is done with the unit (poison the buffer, keep it for the re-gather when a
        graph holds it), or backward is (drop it)."""
        for p in u.params:
            p.data = _placeholder(p.shape, self.dtype)
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
    backward). Built with the model (parallelize), before the units exist; Stage3 binds its
    units when it is built, and until then the pieces run as they are."""

    def __init__(self):
        self.sync = None
        self.blocks = {}                             # block i -> its units (with experts: two)
        self.outer = []                              # the embedding-side units

    def bind(self, sync: Stage3):
        self.sync = sync
        family = sync.model.family
        for u in sync.units:
            i = family.block_of(u.names[0])
            if i is not None:
                self.blocks.setdefault(i, []).append(u)
        self.outer = [u for u in sync.units if family.block_of(u.names[0]) is None]

    def embed(self, run, idx):
        for u in self.outer if self.sync is not None else ():
            self.sync.gather(u)
        return run(idx)

    def block(self, run, i: int, x):
        if self.sync is None:
            return run(i, x)
        for u in self.blocks[i]:
            self.sync.gather(u)
        return Regather.apply(run(i, x), self.sync, self.blocks[i])

    def head(self, run, x):
        return run(x) if self.sync is None else Regather.apply(run(x), self.sync, self.outer)
