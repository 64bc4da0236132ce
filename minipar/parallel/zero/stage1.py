"""ZeRO stage 1: the optimizer state sharded; the gradient synchroniser every stage builds on.

One step, per stage (M micro-batches; a "unit is ready" when backward has produced the
last gradient of its parameters, signalled by the gradient hooks of tensor.py):
  stage 1  gradients accumulate over the micro-batches in a full flat buffer per unit
           (p.grad are views of it). In the last micro-batch's backward each ready unit
           is reduce-scattered (asynchronously, while backward goes on), so the rank gets
           the summed gradient of its shard. It updates its shard of the parameters with
           AdamW, and an all-gather rebuilds the full parameters on every rank.
           Bytes sent per rank: (N-1)/N * n_pad twice = plain DP's all-reduce.
  stage 2  stage2.py
  stage 3  stage3.py
"""
from __future__ import annotations

import time

import numpy as np

from minipar import comm
from minipar.optim.adamw import sum_of_squares
from minipar.comm.sent import sent
from minipar.parallel.zero.formulas import calls_of
from minipar.parallel.zero.units import Unit


class Stage1:
    """ZeRO stage 1 as the gradient synchroniser of the dp group (model.contract.GradSync:
    zero_grad, start_step, sync_now, finish, grad_norm_sq, local_found_inf, tied_grad,
    exposed_seconds) and the keeper of the units' parameters and gradients. Its messages go
    on each unit's group, counted in the ledger under the axis "zero". The sharded optimizer
    (optimizer.ShardedAdamW) shares its units and asks it where the parameter shards are
    (own_params) and what follows an update (after_update)."""

    stage = 1
    params_sharded = False      # the Unit buffers this stage keeps: full flat parameters
    grads_sharded = False       # and a full flat gradient, kept over the micro-batches
    reshard_after_forward = True    # stage 3's choice (stage3.py); formulas.collectives_per_step reads it
    wire = None                     # stage 3's ZeRO++ (zpp.Wire); formulas.calls_of reads it

    def __init__(self, model, units: list[Unit], group: comm.Group, dtype):
        """units: built with this class's params_sharded and grads_sharded (build.build);
        group: the dp group (clipping's norm: a dp all-reduce, not ZeRO's own); dtype: the
        parameters' storage dtype."""
        self.model, self.units, self.dp_group = model, units, group
        # the ranks a (non-expert) unit is sharded over, and its replicas with hybrid sharding
        self.N, self.R = (units[0].N, units[0].R) if units else (group.size, 1)
        self.dtype = np.dtype(dtype)
        self.unit_of = {id(p): u for u in units for p in u.params}
        self.talk_now = True        # does the coming backward reduce-scatter (sync_now)?
        self.exposed_seconds = 0.0
        self.started = []           # units whose reduce-scatter is in flight, in the order started
        for u in units:
            self.adopt(u)
            for p in u.params:
                p.register_grad_hook(self._on_grad_ready)

    def adopt(self, u: Unit):
        """The unit's parameters become views of its full flat buffer."""
        u.point(u.param_flat)

    # --- sizes and the memory report -------------------------------------------------------
    @property
    def P(self) -> int:
        return sum(u.n for u in self.units)

    @property
    def P_pad(self) -> int:
        return sum(u.n_pad for u in self.units)

    @property
    def padding(self) -> int:
        return self.P_pad - self.P

    def param_bytes(self) -> int:
        """Bytes of the parameter buffers this rank keeps: the full flat ones."""
        return sum(u.param_flat.nbytes for u in self.units)

    def grad_bytes(self) -> int:
        """Bytes of the gradient buffers this rank keeps: the full flat ones."""
        return sum(u.grad_full.nbytes for u in self.units)

    def traffic_theory(self, micro_batches: int) -> float:
        """Bytes a rank sends per step by formula: traffic_split's, inside and across hosts."""
        return sum(self.traffic_split(micro_batches).values())

    def traffic_split(self, micro_batches: int) -> dict:
        """{"inside", "across"}: the bytes a rank sends per step that stay on its host and
        those that cross to another: each unit's calls (formulas.calls_of) as sent by the
        algorithm comm runs for each (comm.sent): formulas.traffic_theory's (N-1)/N per
        reduce-scatter or all-gather, and the replicas' all-reduce."""
        inside = across = 0
        for u in self.units:
            for op, group, x, calls in calls_of(self.stage, u, self.dtype.itemsize, micro_batches,
                                                self.reshard_after_forward, self.wire):
                a, b = sent(op, group, x)
                inside, across = inside + calls * a, across + calls * b
        return {"inside": inside, "across": across}

    # --- the data-parallel interface (train.train_step, pipeline.PipelineEngine) ------------
    def zero_grad(self):
        for u in self.units:
            for p, view in zip(u.params, u.unflatten(u.grad_full)):
                p.set_grad_buffer(view)                      # the next backward overwrites

    def start_step(self):
        self.started = []
        for u in self.units:
            u.pending, u.handle, u.received = len(u.params), None, 0

    def sync_now(self, on: bool):
        """A backward is about to run; stage 1 communicates only during the last one."""
        self.talk_now = on

    def _on_grad_ready(self, p):
        u = self.unit_of[id(p)]
        if not self._count(u, p):
            return
        u.pending -= 1
        if u.pending == 0:
            self._unit_ready(u)
            self.started.append(u)
        for other in self.units:                 # push every message in flight along
            for h in (other.handle, other.replica_handle):
                if h is not None:
                    h.test()
        # land the finished reduce-scatters in the order they were started, the same on every
        # rank, so that the replicas' all-reduces (calls on one group) start in one order too
        while self.started and self.started[0].handle.done:
            self._landed(self.started.pop(0))

    def _count(self, u: Unit, p) -> bool:
        """Does p's gradient count towards its unit being ready? Stage 1: it already lies in
        grad_full (p.grad is a view of it); only the backward that talks counts."""
        return self.talk_now

    def _unit_ready(self, u: Unit):
        """Start the unit's reduce-scatter. The shard lands in its own place in grad_full: no new array."""
        u.handle = comm.reduce_scatter_async(u.group, u.grad_full, out=u.grad_full[u.lo:u.hi])

    def _landed(self, u: Unit):
        """The unit's reduce-scatter is over (or is waited for): add its piece into the gradient
        shard. Hybrid sharding, in the backward that ends the step: start the all-reduce of the
        summed shard across its replicas (in place)."""
        piece = u.handle.wait()                                          # (shard,)
        self._receive(u, piece)
        u.received += 1
        u.handle, u.pending = None, len(u.params)
        if u.replicas is not None and self.talk_now:
            u.replica_handle = comm.all_reduce_async(u.replicas, u.grad_shard, out=u.grad_shard)

    def _drain(self):
        """Finish the reduce-scatters in flight, then the replicas' all-reduces they started."""
        while self.started:
            self._landed(self.started.pop(0))
        for u in self.units:
            if u.replica_handle is not None:
                u.replica_handle.wait()
                u.replica_handle = None

    def _receive(self, u: Unit, piece: np.ndarray):
        """The unit's summed gradient shard: stage 1's one piece, a view of grad_full."""
        u.grad_shard = piece

    def finish(self):
        """After the last backward: wait for every reduce-scatter."""
        t0 = time.perf_counter()
        self._drain()
        for u in self.units:
            if u.received == 0:
                raise RuntimeError(f"ZeRO unit of {u.names[0]} ...: {u.pending} of {len(u.params)} "
                                   f"gradient(s) never became ready")
        self.exposed_seconds = time.perf_counter() - t0

    def tied_grad(self, w) -> np.ndarray:
        """The pipeline's tied-embedding exchange: this rank's shard of wte's gradient."""
        return self.unit_of[id(w)].grad_shard

    def grad_norm_sq(self, model=None) -> float:
        """Sum of squared gradients of the whole model, each parameter once: this rank's
        shards (each element of a unit is owned by one dp rank; the padding is zero), summed
        over dp, then over tp and pp as the model counts them (model.reduce_norm_sq)."""
        local = 0.0
        for u in self.units:
            if u.replicas is not None and u.replicas.rank != 0:
                continue                         # hybrid: the first replica counts the shard
            for p, sh, _ in u.segments:
                if self.model.counts_in_norm(p.name):
                    local += sum_of_squares(u.grad_shard[sh])
        total = comm.all_reduce(self.dp_group, np.array([local]))[0] if self.dp_group.size > 1 else local
        return self.model.reduce_norm_sq(float(total))

    def local_found_inf(self, model=None) -> bool:
        """Does this rank's gradient shard hold an inf or NaN? (model: interfaces.GradSync's
        argument; the shards are this object's own.)"""
        return any(not np.isfinite(u.grad_shard).all() for u in self.units)

    # --- the parameters around the optimizer's update ---------------------------------------
    def own_params(self, u: Unit) -> np.ndarray:
        """This rank's shard of the unit's parameters, which the update writes: a view of param_flat."""
        return u.param_flat[u.lo:u.hi]

    def after_update(self, u: Unit, w_shard: np.ndarray):
        """The all-gather that rebuilds the full parameters from every rank's updated shard."""
        comm.all_gather(u.group, w_shard.copy(), out=u.param_flat)
