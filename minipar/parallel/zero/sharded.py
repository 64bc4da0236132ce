"""ZeRO stages 1, 2 and 3 over the data-parallel group (Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", 2020; DeepSpeed).

Plain data parallelism keeps N identical copies of everything: parameters, gradients and
the optimizer state. ZeRO gives each of the N dp ranks 1/N of the model states instead:

    what each rank keeps (bytes, P parameters, 2-byte storage, fp32 Adam):  params  grads  optimizer
    stage 0  (plain dp, --zero 0)                                   16P  =  2P   +  2P  +  12P
    stage 1  optimizer state sharded                          4P + 12P/N =  2P   +  2P  +  12P/N
    stage 2  + gradients sharded                              2P + 14P/N =  2P   +  2P/N + 12P/N
    stage 3  + parameters sharded                                  16P/N =  2P/N +  2P/N + 12P/N
In fp32 (and float64) the same shapes hold with 4 (8)-byte parameters and gradients and an
8P (16P) optimizer (m and v; the parameters are their own master weights).

The layout. A rank's parameters (its tp slice, its pp stage) are cut into units
(`unit_names`): wte.weight alone, one unit per transformer block, and the rest. Each unit
is flattened in model order into n elements, padded with zeros to n_pad = ceil(n/N)*N, and
dp rank r owns elements [r*n_pad/N, (r+1)*n_pad/N) of it: its shard, the piece r of
np.array_split that comm.reduce_scatter hands it. The optimizer state (fp32 master weights
with --precision fp16/bf16, Adam's m and v) exists only for the owned shard. (PyTorch FSDP
shards each of its flat parameters the same way, unit by unit.)

One step, per stage (M micro-batches; a "unit is ready" when backward has produced the
last gradient of its parameters, signalled by the gradient hooks of tensor.py):
  stage 1  gradients accumulate over the micro-batches in a full flat buffer per unit
           (p.grad are views of it). In the last micro-batch's backward each ready unit
           is reduce-scattered (asynchronously, while backward goes on), so the rank gets
           the summed gradient of its shard. It updates its shard of the parameters with
           AdamW, and an all-gather rebuilds the full parameters on every rank.
           Bytes sent per rank: (N-1)/N * n_pad twice = plain DP's all-reduce.
  stage 2  in every micro-batch's backward each ready unit's gradient is copied into a
           transient flat buffer, reduce-scattered and added into the rank's gradient
           shard; the full gradient is dropped. The update and all-gather are stage 1's.
           Bytes: M reduce-scatters + 1 all-gather (= plain DP when M = 1).
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

Everything here is composable with --tp (each tp rank shards its own slices over its dp
group), --precision (2-byte parameters and gradients travel as 2 bytes; the fp32 master
weights are sharded with m and v), --micro-batches, and --pp for stages 1 and 2 (stage 3
would gather and release every stage's parameters around each of the M micro-batches'
forwards and backwards, interleaved by the schedule; DeepSpeed does not combine them
either, and minipar refuses it).
"""
from __future__ import annotations

import re
import time

import numpy as np

from minipar import comm
from minipar.optim.adamw import adamw_update, sum_of_squares
from minipar.optim.mixed_precision import MixedPrecisionAdamW, optimizer_bytes_per_param
from minipar.autograd.tensor import Function, is_grad_enabled

STAGES = (0, 1, 2, 3)
_BLOCK = re.compile(r"h\.(\d+)\.")


def unit_names(names) -> list[list[str]]:
    """Cut a rank's parameters (canonical names, model order) into the units ZeRO flattens,
    shards and (stage 3) gathers together: wte.weight alone (a tied copy on the last
    pipeline stage must shard exactly like stage 0's), one unit per transformer block, and
    one for the rest (wpe, ln_f, lm_head). Empty units are dropped."""
    wte, blocks, rest = [], {}, []
    for n in names:
        m = _BLOCK.match(n)
        if n == "wte.weight":
            wte.append(n)
        elif m:
            blocks.setdefault(int(m.group(1)), []).append(n)
        else:
            rest.append(n)
    return [u for u in [wte, *blocks.values(), rest] if u]


def padded(n: int, N: int) -> int:
    """A unit of n elements padded so that N ranks get equal shards: ceil(n / N) * N."""
    return -(-n // N) * N


def formula(stage: int, P: int, P_pad: int, N: int, itemsize: int, K: int) -> dict:
    """Bytes per rank of each model state (the table above): `itemsize`-byte parameters and
    gradients, K optimizer bytes per parameter; P the rank's parameters, P_pad with every
    unit padded for N ranks. The planner (minipar/plan/memory.py) takes its memory table from here."""
    params = itemsize * (P if stage == 0 else P_pad // N if stage == 3 else P_pad)
    grads = itemsize * (P if stage == 0 else P_pad // N if stage >= 2 else P_pad)
    optimizer = K * (P if stage == 0 else P_pad // N)
    text = {0: "{s}P + {s}P + {K}P", 1: "{s}P + {s}P + {K}P/N", 2: "{s}P + {s}P/N + {K}P/N",
            3: "{s}P/N + {s}P/N + {K}P/N"}[stage].format(s=itemsize, K=K)
    return {"params": params, "grads": grads, "optimizer": optimizer, "text": text}


def collectives_per_step(stage: int, M: int) -> tuple[int, int]:
    """(reduce-scatters, all-gathers) of each unit in one step of M micro-batches ("One
    step" above): stage 1 one of each; stage 2 a reduce-scatter per micro-batch and one
    all-gather; stage 3 per micro-batch a reduce-scatter and two all-gathers (forward's
    and backward's); stage 0, plain dp's all-reduce, as much as one of each."""
    return {0: (1, 1), 1: (1, 1), 2: (M, 1), 3: (M, 2 * M)}[stage]


def traffic_theory(stage: int, P_pad: int, N: int, itemsize: int, M: int) -> float:
    """Bytes one rank sends per step for its gradient and parameter collectives: a
    reduce-scatter or all-gather of n bytes sends (N-1)/N * n."""
    calls = sum(collectives_per_step(stage, M))
    return calls * (N - 1) / N * itemsize * P_pad


class Unit:
    """One flat, padded group of parameters and this rank's shard of it."""

    def __init__(self, names, params, N: int, rank: int, group=None):
        self.names, self.params = names, params
        self.group, self.N = group, N           # the ranks its shards are spread over ("zero" axis)
        self.sizes = [p.size for p in params]
        self.offsets = np.cumsum([0] + self.sizes)[:-1].tolist()
        self.n = sum(self.sizes)
        self.n_pad = padded(self.n, N)
        self.shard = self.n_pad // N
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        self.dtype = params[0].data.dtype
        # the owned range cut at parameter boundaries: (param, slice of the shard,
        # slice of the parameter's flat data)
        self.segments = []
        for p, off, size in zip(params, self.offsets, self.sizes):
            a, b = max(off, self.lo), min(off + size, self.hi)
            if a < b:
                self.segments.append((p, slice(a - self.lo, b - self.lo), slice(a - off, b - off)))
        self.pending = len(params)
        self.handle = None          # the reduce-scatter in flight
        self.flat_grad = None       # stage 2/3: this micro-batch's full gradient, while ready-ing
        self.full = None            # stage 3: the gathered parameters, between gather and release

    def flatten(self, arrays) -> np.ndarray:
        """The unit's (n_pad,) flat copy of per-parameter arrays (zeros in the padding)."""
        flat = np.zeros(self.n_pad, dtype=arrays[0].dtype)
        for a, off, size in zip(arrays, self.offsets, self.sizes):
            flat[off:off + size] = a.reshape(-1)
        return flat

    def point(self, flat):
        """Make every parameter's data a view of flat (n_pad,)."""
        for p, off, size in zip(self.params, self.offsets, self.sizes):
            p.data = flat[off:off + size].reshape(p.shape)

    def unflatten(self, flat) -> list:
        return [flat[off:off + size].reshape(p.shape) for p, off, size in zip(self.params, self.offsets, self.sizes)]


def _placeholder(shape, dtype) -> np.ndarray:
    """A released parameter: the right shape and dtype, no memory, NaN if read."""
    return np.broadcast_to(np.array(np.nan, dtype=dtype), shape)


class Regather(Function):
    """Identity in value. Forward: the units' parameters are released (their forward is
    over). Backward: they are all-gathered again, before the ops that produced x run
    their backward with them."""

    def forward(self, x, zero, units):
        self.zero, self.units = zero, units
        for u in units:
            zero.release(u)
        return x

    def backward(self, g):
        for u in self.units:
            self.zero.gather(u, again=True)
        return g, None, None


class Zero:
    """ZeRO over the dp group: a gradient synchroniser (data_parallel.GradSync: zero_grad,
    start_step, sync_now, finish, grad_norm_sq, local_found_inf, tied_grad) and the sharded
    optimizer (lr, step, step_count, state) in one object. Its messages go on the dp group's
    ranks, counted in the ledger under the axis "zero".

    Built from a model and its plain optimizer (AdamW or MixedPrecisionAdamW) after any
    checkpoint has been loaded into them: each rank keeps its shard of their state and the
    full optimizer is dropped."""

    def __init__(self, model, opt, group: comm.Group, stage: int, expert_group: comm.Group | None = None,
                 is_expert=None):
        """expert_group, is_expert(name): with expert parallelism, each block's expert
        parameters form units of their own, sharded over expert_group (an expert's dp/ep
        replicas) instead of the whole dp group (docs/moe.md)."""
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        self.model, self.group, self.stage = model, group.with_axis("zero"), stage
        self.dp_group = group                      # clipping's norm: a dp all-reduce, not ZeRO's own
        self.N, self.rank = group.size, group.rank
        self.lr, self.betas, self.eps, self.weight_decay = opt.lr, opt.betas, opt.eps, opt.weight_decay
        self.step_count = opt.step_count
        self.mixed = isinstance(opt, MixedPrecisionAdamW)                # fp32 master weights
        self.scaler = opt.scaler if self.mixed else None
        self.dtype = np.dtype(opt.dtype if self.mixed else model.dtype)  # storage dtype
        named = dict(model.named_parameters())
        masters = dict(zip(named, opt.master)) if self.mixed else {}
        ms, vs = dict(zip(named, opt.m)), dict(zip(named, opt.v))
        self.units, self.unit_of = [], {}
        for names, g in self._unit_groups(unit_names(named), expert_group, is_expert):
            u = Unit(names, [named[n] for n in names], g.size, g.rank, g)
            self.units.append(u)
            for p in u.params:
                self.unit_of[id(p)] = u
            own = slice(u.lo, u.hi)
            u.m = u.flatten([ms[n] for n in names])[own].copy()         # (shard,) optimizer state
            u.v = u.flatten([vs[n] for n in names])[own].copy()
            flat = u.flatten([p.data for p in u.params])                # (n_pad,) storage dtype
            if self.mixed:
                u.master = u.flatten([masters[n] for n in names])[own].copy()
            if stage == 3:
                u.param_shard = flat[own].copy()                        # (shard,)
                for p in u.params:
                    p.data = _placeholder(p.shape, self.dtype)
            else:
                u.param_flat = flat                                     # (n_pad,), p.data its views
                u.point(flat)
            if stage == 1:
                u.grad_flat = np.zeros(u.n_pad, dtype=self.dtype)       # (n_pad,), p.grad its views
            u.grad_shard = np.zeros(u.shard, dtype=self.dtype) if stage >= 2 else None
            for p in u.params:
                p.register_grad_hook(self._on_grad_ready)
        del opt.m, opt.v                                                # only the shards live on
        if self.mixed:
            del opt.master
        self.sync, self.fresh = True, True
        self.exposed_seconds = 0.0
        if stage == 3:
            self._wrap_forward()

    def _unit_groups(self, units, expert_group, is_expert):
        """[(names, the unit's "zero" group)]: every unit over the dp group, or with experts
        each unit cut into its non-expert names (over dp) and its experts' (over expert_group)."""
        if expert_group is None:
            return [(u, self.group) for u in units]
        out = []
        for u in units:
            plain, experts = [n for n in u if not is_expert(n)], [n for n in u if is_expert(n)]
            out += [(plain, self.group)] if plain else []
            out += [(experts, expert_group.with_axis("zero"))] if experts else []
        return out

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

    def state_bytes(self) -> int:
        return sum(u.m.nbytes + u.v.nbytes + (u.master.nbytes if self.mixed else 0) for u in self.units)

    def memory_report(self) -> dict:
        """Bytes this rank holds in its persistent buffers, beside the formula."""
        itemsize = self.dtype.itemsize
        K = optimizer_bytes_per_param(self.mixed, itemsize)
        if self.stage == 3:
            params = sum(u.param_shard.nbytes for u in self.units)
        else:
            params = sum(u.param_flat.nbytes for u in self.units)
        grads = sum((u.grad_flat if self.stage == 1 else u.grad_shard).nbytes for u in self.units)
        f = formula(self.stage, self.P, self.P_pad, self.N, itemsize, K)
        f["text"] = f"{f['text']} (P = {self.P:,} on this rank, N = {self.N}, padded to {self.P_pad:,})"
        spread = [u for u in self.units if u.N != self.N]           # experts: over their replicas
        if spread:
            f = self._formula_with_experts(spread, itemsize, K)
        return {"params": params, "grads": grads, "optimizer": self.state_bytes(), "formula": f,
                "zero": {"stage": self.stage, "N": self.N, "P": self.P, "P_padded": self.P_pad,
                         "padding": self.padding, "units": len(self.units)}}

    def _formula_with_experts(self, spread, itemsize, K) -> dict:
        """The formula, summed over the two kinds of unit: P over N dp ranks, and the experts'
        P_e over their N_e replicas."""
        ids = {id(u) for u in spread}
        plain = [u for u in self.units if id(u) not in ids]
        P, P_pad = sum(u.n for u in plain), sum(u.n_pad for u in plain)
        Pe, Pe_pad, Ne = sum(u.n for u in spread), sum(u.n_pad for u in spread), spread[0].N
        a = formula(self.stage, P, P_pad, self.N, itemsize, K)
        b = formula(self.stage, Pe, Pe_pad, Ne, itemsize, K)
        f = {k: a[k] + b[k] for k in ("params", "grads", "optimizer")}
        f["text"] = (f"{a['text']} + experts' {b['text'].replace('P', 'P_e').replace('N', 'N_e')} (P = {P:,}, "
                     f"N = {self.N}; P_e = {Pe:,}, N_e = {Ne}; padded)")
        return f

    def traffic_theory(self, micro_batches: int) -> float:
        return sum(traffic_theory(self.stage, u.n_pad, u.N, self.dtype.itemsize, micro_batches)
                   for u in self.units)

    # --- the data-parallel interface (train.train_step, pipeline.PipelineEngine) ------------
    def zero_grad(self):
        for u in self.units:
            if self.stage == 1:
                for p, view in zip(u.params, u.unflatten(u.grad_flat)):
                    p.set_grad_buffer(view)                      # the next backward overwrites
            else:
                for p in u.params:
                    p.grad = None

    def start_step(self):
        for u in self.units:
            u.pending, u.handle, u.received = len(u.params), None, 0

    def sync_now(self, on: bool):
        """A backward is about to run; stage 1 communicates only during the last one.
        Stages 2 and 3 reduce-scatter in every backward: first finish the previous one's."""
        self.sync = on
        if self.stage >= 2:
            self._drain()

    def _on_grad_ready(self, p):
        u = self.unit_of[id(p)]
        if self.stage >= 2:                      # keep a copy in the unit's flat buffer only
            if u.flat_grad is None:
                u.flat_grad = np.zeros(u.n_pad, dtype=self.dtype)       # (n_pad,), transient
            i = u.params.index(p)
            u.flat_grad[u.offsets[i]:u.offsets[i] + u.sizes[i]] = p.grad.reshape(-1)
            p.grad = None
        elif not self.sync:
            return
        u.pending -= 1
        if u.pending == 0:
            if self.stage == 1:                  # the shard lands in its own place in grad_flat: no new array
                u.handle = comm.reduce_scatter_async(u.group, u.grad_flat, out=u.grad_flat[u.lo:u.hi])
            else:
                u.handle = comm.reduce_scatter_async(u.group, u.flat_grad)
            if self.stage == 3:
                self.release(u, after_backward=True)
        for other in self.units:                 # push every reduce-scatter in flight along
            if other.handle is not None:
                other.handle.test()

    def _drain(self):
        """Finish the reduce-scatters in flight; add each piece into the gradient shard."""
        for u in self.units:
            if u.handle is None:
                continue
            piece = u.handle.wait()                                      # (shard,)
            if self.stage == 1:
                u.grad_shard = piece                                     # a view of grad_flat
            elif u.received == 0:
                u.grad_shard[...] = piece
            else:
                u.grad_shard += piece
            u.received += 1
            u.handle, u.flat_grad, u.pending = None, None, len(u.params)

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

    # --- stage 3: gathering and releasing parameters ---------------------------------------
    def gather(self, u: Unit, again: bool = False):
        """All-gather the unit's parameters and point them at the result. again: backward's
        re-gather, into the buffer the forward's ops kept (see the module docstring)."""
        if not again or u.full is None:
            u.full = comm.all_gather(u.group, u.param_shard)          # (n_pad,)
        else:
            comm.all_gather(u.group, u.param_shard, out=u.full)
        u.point(u.full)

    def release(self, u: Unit, after_backward: bool = False):
        """Forward is done with the unit (poison the buffer, keep it for the re-gather when a
        graph holds it), or backward is (drop it)."""
        for p in u.params:
            p.data = _placeholder(p.shape, self.dtype)
        if u.full is None:
            return
        if after_backward or not is_grad_enabled():
            u.full = None
        else:
            u.full.fill(np.nan)

    def _wrap_forward(self):
        """Place the gathers around the model's pieces (embed, block i, head): the
        embedding-side units are gathered before embed and released after head."""
        m = self.model
        embed, block, head = m.embed, m.block, m.head
        blocks = {}                                  # block i -> its units (with experts: two)
        for u in self.units:
            if _BLOCK.match(u.names[0]):
                blocks.setdefault(int(_BLOCK.match(u.names[0]).group(1)), []).append(u)
        outer = [u for u in self.units if not _BLOCK.match(u.names[0])]

        def zero3_embed(idx):
            for u in outer:
                self.gather(u)
            return embed(idx)

        def zero3_block(i, x):
            for u in blocks[i]:
                self.gather(u)
            return Regather.apply(block(i, x), self, blocks[i])

        def zero3_head(x):
            return Regather.apply(head(x), self, outer)

        m.embed, m.block, m.head = zero3_embed, zero3_block, zero3_head

    # --- the optimizer -----------------------------------------------------------------------
    def grad_norm_sq(self, model=None) -> float:
        """Sum of squared gradients of the whole model, each parameter once: this rank's
        shards (each element of a unit is owned by one dp rank; the padding is zero), summed
        over dp, then over tp and pp as the model counts them (model.reduce_norm_sq)."""
        local = 0.0
        for u in self.units:
            for p, sh, _ in u.segments:
                if self.model.counts_in_norm(p.name):
                    local += sum_of_squares(u.grad_shard[sh])
        total = comm.all_reduce(self.dp_group, np.array([local]))[0] if self.N > 1 else local
        return self.model.reduce_norm_sq(float(total))

    def local_found_inf(self, model=None) -> bool:
        """Does this rank's gradient shard hold an inf or NaN? (model: data_parallel.GradSync's
        argument; the shards are this object's own.)"""
        return any(not np.isfinite(u.grad_shard).all() for u in self.units)

    def step(self, grad_scale: float = 1.0):
        """AdamW on this rank's shards, then (stages 1 and 2) the all-gather that rebuilds
        the full parameters. grad_scale: the clip factor (over the loss scale with mixed precision)."""
        self.step_count += 1
        for u in self.units:
            w_shard = u.param_shard if self.stage == 3 else u.param_flat[u.lo:u.hi]   # a view
            for p, sh, _ in u.segments:
                g = u.grad_shard[sh].astype(np.float32) if self.mixed else u.grad_shard[sh]
                wd = self.weight_decay if p.data.ndim >= 2 else 0.0
                target = u.master[sh] if self.mixed else w_shard[sh]
                adamw_update(target, g, u.m[sh], u.v[sh], self.step_count, self.lr, self.betas, self.eps, wd,
                             grad_scale=grad_scale)
                if self.mixed:
                    w_shard[sh] = target                                  # round into the model
            if self.stage != 3:
                comm.all_gather(u.group, w_shard.copy(), out=u.param_flat)

    # --- whole tensors again (checkpoints, --verify, the replica check) ---------------------
    def gather_local(self, kind: str) -> dict:
        """{name: this rank's (tp/pp-local) full array} of "params", "master", "m" or "v":
        each unit's shards all-gathered over dp (collective)."""
        out = {}
        for u in self.units:
            if kind == "params":
                shard = u.param_shard if self.stage == 3 else u.param_flat[u.lo:u.hi]
            elif kind == "master" and not self.mixed:
                shard = u.param_shard if self.stage == 3 else u.param_flat[u.lo:u.hi]
            else:
                shard = getattr(u, kind)
            flat = comm.all_gather(u.group, np.ascontiguousarray(shard))
            for n, a in zip(u.names, u.unflatten(flat)):
                out[n] = a.copy()
        return out
