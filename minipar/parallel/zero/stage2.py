"""ZeRO stage 2: stage 1 with the gradients sharded too.

One step (stage1.py says what a ready unit is):
  stage 2  in every micro-batch's backward each ready unit's gradient is copied into a
           transient flat buffer, reduce-scattered and added into the rank's gradient
           shard; the full gradient is dropped. The update and all-gather are stage 1's.
           Bytes: M reduce-scatters + 1 all-gather (= plain DP when M = 1).
"""
from __future__ import annotations

import numpy as np

from minipar import comm
from minipar.parallel.zero.stage1 import Stage1
from minipar.parallel.zero.units import Unit


class Stage2(Stage1):
    """Stage 1, plus: the gradients sharded. No full gradient lives between backwards: each
    micro-batch's is staged (grad_staging), reduce-scattered and added into grad_shard."""

    stage = 2
    grads_sharded = True        # a gradient shard per unit, no full gradient buffer

    def grad_bytes(self) -> int:
        """Bytes of the gradient buffers this rank keeps: the shards."""
        return sum(u.grad_shard.nbytes for u in self.units)

    def zero_grad(self):
        for u in self.units:
            for p in u.params:
                p.grad = None

    def sync_now(self, on: bool):
        """Stages 2 and 3 reduce-scatter in every backward: first finish the previous one's
        (before talk_now turns to the coming backward's: a hybrid shard is all-reduced across
        its replicas only once it holds every micro-batch's sum)."""
        self._drain()
        super().sync_now(on)

    def _count(self, u: Unit, p) -> bool:
        """Keep a copy of p's gradient in the unit's transient flat buffer only; it counts in
        every backward."""
        if u.grad_staging is None:
            u.grad_staging = np.zeros(u.n_pad, dtype=self.dtype)        # (n_pad,), transient
        i = u.params.index(p)
        u.grad_staging[u.offsets[i]:u.offsets[i] + u.sizes[i]] = p.grad.reshape(-1)
        p.grad = None
        return True

    def _unit_ready(self, u: Unit):
        """Start the reduce-scatter of this micro-batch's gradient."""
        u.handle = comm.reduce_scatter_async(u.group, u.grad_staging)

    def _receive(self, u: Unit, piece: np.ndarray):
        """Add the micro-batch's piece into the gradient shard (the first one replaces it);
        the staged full gradient is dropped."""
        if u.received == 0:
            u.grad_shard[...] = piece
        else:
            u.grad_shard += piece
        u.grad_staging = None
