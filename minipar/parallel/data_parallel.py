"""Data parallelism: every dp rank holds the whole model, runs its own slice of the global
batch, and the ranks sum their gradients before the (identical) optimizer step.

What is split:       the global batch of B sequences: dp rank r takes rows
                     [r*B/dp, (r+1)*B/dp), then cuts them into M micro-batches.
What is sent:        every gradient, once per step, summed over the dp group (all-reduce).
                     Each micro-batch loss is divided by the *global* token count B*T, so
                     the sum over ranks and micro-batches is the single-process mean.
How many bytes:      a ring all-reduce of n bytes sends 2(p-1)/p * n per rank, so one step
                     sends 2(p-1)/p * 4P bytes for P float32 parameters, and half that
                     with --precision fp16/bf16: the buckets are flat buffers in the
                     parameters' dtype, so 2-byte gradients travel as 2 bytes.
When:                naive: one blocking all-reduce per parameter after backward ends.
                     bucketed: parameters are grouped, in reverse order, into buckets of
                     about --bucket-mb; a bucket's all-reduce starts from the gradient hook
                     of its last parameter, while backward goes on with earlier layers,
                     and is awaited before the optimizer step. Only the time spent waiting
                     after backward ends ("exposed" communication) costs step time.

Both modes give the same numbers: the same sums, just issued at different times. Each
is a GradSync (below), as is NoSync (one dp rank, nothing to send) and ZeRO's stages
(zero/stage1.py).
One step of it reads

    sync.zero_grad(); sync.start_step()
    for each micro-batch:  sync.sync_now(last micro-batch?); loss.backward()
    sync.finish()                       # every .grad (or shard) now summed over dp
    norm = sqrt(sync.grad_norm_sq(model))

with the pipeline calling sync_now / finish / tied_grad from its schedule instead.
"""
from __future__ import annotations

import hashlib
import time
from typing import Protocol

import numpy as np

from minipar import comm
from minipar.comm.helpers import split_offsets
from minipar.comm.ledger import human_bytes
from minipar.optim.adamw import sum_of_squares
from minipar.optim.mixed_precision import local_found_inf


class GradSync(Protocol):
    """Gradient synchronisation over the dp group, as the trainer and the pipeline use it."""

    exposed_seconds: float    # the last step's wait for communication after backward

    def zero_grad(self) -> None:
        """Clear (or mark for overwriting) every gradient before a step."""

    def start_step(self) -> None:
        """A step begins: reset the per-step bookkeeping."""

    def sync_now(self, on: bool) -> None:
        """A backward is about to run; communicate during it only if `on` (the last one)."""

    def finish(self) -> None:
        """After the last backward: wait until every gradient is summed over dp."""

    def grad_norm_sq(self, model) -> float:
        """The sum of squares of the whole model's summed gradients, each counted once."""

    def local_found_inf(self, model) -> bool:
        """Does any gradient this rank holds contain inf or NaN?"""

    def tied_grad(self, w) -> np.ndarray:
        """The array holding the tied wte.weight's gradient that the pipeline's two ends
        exchange: w.grad, or with ZeRO this rank's shard of it."""


class GradSyncBase:
    """What the synchronisers of this file share: the parameters, clearing their gradients,
    and the norm and overflow check of what this rank holds (already summed: a subclass
    sends in sync_now and finish)."""

    exposed_seconds = 0.0

    def __init__(self, params):
        self.params = list(params)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def start_step(self):
        pass

    def sync_now(self, on: bool):
        pass

    def finish(self):
        pass

    def grad_norm_sq(self, model) -> float:
        return model.grad_norm_sq()

    def local_found_inf(self, model) -> bool:
        return local_found_inf(model.parameters())

    def tied_grad(self, w) -> np.ndarray:
        return w.grad


class NoSync(GradSyncBase):
    """The synchroniser of a single dp rank: every gradient is already the whole batch's, so
    nothing is sent."""


class DataParallelNaive(GradSyncBase):
    """The lesson: after backward, all-reduce each parameter's gradient, one at a time."""

    def __init__(self, params, group: comm.Group):
        super().__init__(params)
        self.group = group

    def finish(self):
        """After the last backward: sum every gradient over the dp group."""
        t0 = time.perf_counter()
        for p in self.params:
            p.grad = comm.all_reduce(self.group, p.grad)
        self.exposed_seconds = time.perf_counter() - t0


class Bucket:
    """A group of parameters whose gradients live in one flat buffer (p.grad are views)."""

    def __init__(self, params, dtype):
        self.params = params
        self.flat = np.zeros(sum(p.size for p in params), dtype=dtype)     # (n,)
        self.views, self.spans, off = [], [], 0
        for p in params:
            self.views.append(self.flat[off:off + p.size].reshape(p.shape))
            self.spans.append((off, off + p.size))                        # p's elements in flat
            off += p.size
        self.pending = len(params)
        self.handle = None

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes


class DataParallelBucketed(GradSyncBase):
    """Gradient buckets all-reduced asynchronously while backward runs (PyTorch DDP's idea).

    Gradients accumulate straight into the buckets' flat buffers (each p.grad is a view),
    so a finished bucket is sent as it is, with no packing copy. A gradient hook on every
    parameter counts down its bucket; at zero the bucket's all-reduce starts, and every
    hook also pushes the buckets already in flight (MPI makes progress only inside calls).
    """

    def __init__(self, params, group: comm.Group, bucket_mb: float = 1.0):
        self.params, self.group = list(params), group
        dtype = self.params[0].data.dtype
        self.buckets = [Bucket([self.params[i] for i in members], dtype)
                        for members in bucket_members([p.data.nbytes for p in self.params], bucket_mb)]
        self.bucket_of = {}
        for b in self.buckets:
            for p, view in zip(b.params, b.views):
                self.bucket_of[id(p)] = b
                p.grad = view
                p.register_grad_hook(self._on_grad_ready)
        self.sync = True
        self.exposed_seconds = 0.0

    def zero_grad(self):
        for b in self.buckets:                   # no memset: the next backward writes each
            for p, view in zip(b.params, b.views):   # gradient into its view
                p.set_grad_buffer(view)

    def sync_now(self, on: bool):
        """Communicate during the coming backward? Only for the last micro-batch."""
        self.sync = on

    def start_step(self):
        for b in self.buckets:
            b.pending, b.handle = len(b.params), None

    def _on_grad_ready(self, p):
        if not self.sync:
            return
        b = self.bucket_of[id(p)]
        b.pending -= 1
        if b.pending == 0:
            b.handle = comm.all_reduce_async(self.group, b.flat, out=b.flat)   # in place
        for other in self.buckets:               # push every bucket in flight a little further
            if other.handle is not None and not other.handle.done:
                other.handle.test()

    def finish(self):
        """After the last backward: wait for every bucket. Each bucket is summed in place, so
        p.grad (a view of its bucket) then holds the sum."""
        t0 = time.perf_counter()
        for b in self.buckets:
            if b.handle is None:                 # a parameter that got no gradient this step
                raise RuntimeError(f"bucket of {len(b.params)} parameters never became ready: "
                                   f"{b.pending} gradient(s) missing")
            b.handle.wait()
        self.exposed_seconds = time.perf_counter() - t0

    def grad_norm_sq(self, model) -> float:
        """The clipping norm's sum of squares, with the work split over dp: after finish()
        every rank holds the same summed buckets, so each squares only piece r of each bucket
        (np.array_split, the piece it reduced), one 8-byte all-reduce adds the dp pieces, and
        model.reduce_norm_sq adds tp and pp. Each parameter counts once (model.counts_in_norm).
        At dp = 2 this halves the norm's cost per rank."""
        n, r = self.group.size, self.group.rank
        local = 0.0
        for b in self.buckets:
            off = split_offsets(b.flat.size, n)
            lo, hi = off[r], off[r + 1]
            for p, (start, end) in zip(b.params, b.spans):
                a, z = max(start, lo), min(end, hi)
                if a < z and model.counts_in_norm(p.name):
                    local += sum_of_squares(b.flat[a:z])
        total = comm.all_reduce(self.group, np.array([local]))[0] if n > 1 else local
        return model.reduce_norm_sq(float(total))


def bucket_members(nbytes: list, bucket_mb: float) -> list[list[int]]:
    """Which parameters share a bucket (indices into the parameter list, given each one's
    gradient bytes): walked in reverse, since backward produces the last layers first, a
    bucket closes as soon as it holds >= bucket_mb MiB. The planner counts buckets so too."""
    limit = max(1, int(bucket_mb * 1024 * 1024))
    buckets, members, size = [], [], 0
    for i in reversed(range(len(nbytes))):
        members.append(i)
        size += nbytes[i]
        if size >= limit:
            buckets.append(members)
            members, size = [], 0
    if members:
        buckets.append(members)
    return buckets


def make(params, group: comm.Group, mode: str = "bucketed", bucket_mb: float = 1.0):
    if mode == "naive":
        return DataParallelNaive(params, group)
    if mode == "bucketed":
        return DataParallelBucketed(params, group, bucket_mb)
    raise ValueError(f"unknown data-parallel mode {mode!r} (bucketed, naive)")


def weights_digest(params) -> np.ndarray:
    """sha256 of every parameter's bytes, as 32 uint8 (for the replica check)."""
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(p.data).tobytes())
    return np.frombuffer(h.digest(), dtype=np.uint8).copy()


def check_replicas(params, group: comm.Group):
    """Raise on every rank if the dp replicas' weights are not bit-identical."""
    digests = comm.all_gather(group, weights_digest(params)).reshape(group.size, -1)
    differ = [r for r in range(group.size) if not np.array_equal(digests[r], digests[0])]
    if differ:
        raise RuntimeError(f"data-parallel replicas diverged: dp ranks {differ} differ from dp rank 0")
    return digests[0].tobytes().hex()[:16]


# --- the summary's data-parallel figures ----------------------------------------------------

def grad_sync_theory(P_bytes: int, ranks: int, experts: tuple[int, int] | None = None) -> float:
    """Bytes a rank's gradient all-reduce sends per step by formula: 2(p-1)/p x the gradients'
    P_bytes, p = the ranks they are summed over (dp x cp). With --ep, experts = (N_e, P_e):
    the experts' P_e bytes are summed over their own N_e replicas, the rest over p."""
    if experts is None:
        return 2 * (ranks - 1) / ranks * P_bytes
    ne, Pe = experts
    return 2 * (ranks - 1) / ranks * (P_bytes - Pe) + 2 * (ne - 1) / ne * Pe


def summary(rows_log: list, *, mode: str | None, buckets: int, theory: float, P_bytes: int,
            digest: str | None, ranks: int, cp: int, ep: int) -> tuple[dict, list[str]]:
    """docs/design.md §8's `data_parallel` figures, and the lines: the gradient all-reduce's
    bytes per step (the rows' grad_sync_bytes) beside grad_sync_theory (its line only for an
    all-reduce mode: ZeRO reports its own), and the replicas' weights hash when they were
    compared (check_replicas over `ranks`, dp x cp ones)."""
    grad_sync = float(np.mean([r["grad_sync_bytes"] for r in rows_log]))
    exposed = float(np.mean([r["exposed_comm_s"] for r in rows_log]))
    step_time = float(np.mean([r["step_time"] for r in rows_log]))
    out = {"mode": mode, "buckets": buckets, "grad_sync_bytes_per_step": grad_sync,
           "theory_bytes_per_step": theory, "exposed_comm_s_per_step": exposed,
           "step_time_s": step_time, "replicas_sha256_16": digest}
    lines = []
    if mode is not None and not mode.startswith("zero"):
        ratio = grad_sync / theory if theory else float("nan")
        lines.append(f"  data parallel: gradient all-reduce sent {human_bytes(grad_sync)}/step "
                     f"per rank; theory 2(p-1)/p x {human_bytes(P_bytes)}"
                     + (" (experts' p: their replicas)" if ep > 1 else "") + f" = {human_bytes(theory)} "
                     f"(ratio {ratio:.3f}); exposed comm "
                     f"{exposed * 1e3:.1f} ms/step ({exposed / step_time:.0%} of the step)")
    if digest is not None:
        lines.append(f"  replicas identical across {ranks} " + ("dp" if cp == 1 else "dp x cp")
                     + f" ranks (weights sha256 {digest})")
    return out, lines
