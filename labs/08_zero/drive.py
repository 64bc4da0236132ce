"""Lab 08, the student's side (labs/framework.py says what a lab is): the seam (LabZero, minipar's
ZeRO stages with the per-unit work handed to the student's functions) and the short training runs
the child makes with it. Nothing here judges; lab.py does, in the grader, with formulas.formula,
units.padded, formulas.traffic_theory and the single-process twin it computes itself.

Every run trains the same 2-layer GPT (CFG: units of 4,096, 3,280, 3,280 and 288 elements) on
the same data and seed, in float64 or float32, for 2 steps of M micro-batches; the grader
rebuilds every case from RUNS below. The dp groups are cut from the world's 4 ranks in blocks
of N (N = 2: ranks 0-1 and 2-3, no unit padded; N = 3: ranks 0-2, every unit but one padded,
and rank 3 runs ZeRO over a group of one; N = 4: the world). For each run the child records
what the student's code left: the bytes every rank holds after each step (held(), each array
with its dtype), what LabZero saw after each of the student's calls (faults: a transient
buffer kept, a gathered buffer that is the shard itself), the ledger's bytes and calls per
step, and the losses, gradient norms and parameters after the steps.
"""
import os

import numpy as np
from mpi4py import MPI

from labs.framework import extra_cases
from labs.results import key
from minipar.train import checkpoint, data, trainer as train
from minipar import comm
from minipar.model.gpt import GPT, GPTConfig
from minipar.optim.adamw import adamw_update
from minipar.parallel.zero import build as zero_build, optimizer as zero_optimizer, stage3, units as zero_units
from minipar.parallel.zero.formulas import formula
from minipar.parallel.grid import ProcessGrid
from minipar.parallel.parallelize import parts
from minipar.parallel.layout import Layout
from minipar.optim.mixed_precision import MixedPrecisionAdamW, optimizer_bytes_per_param
from minipar.autograd.tensor import is_grad_enabled

HERE = os.path.dirname(os.path.abspath(__file__))
UNIT_FIELDS = ("param_flat", "param_shard", "grad_flat", "grad_shard", "m", "v")
# minipar's own per-unit ZeRO (what reference.py takes its lines from): reached from the
# student's file, each raises (labs/child.py). LabZero and LabUnit override every one of them
# that their own calls would reach.
OWN = ["minipar.parallel.zero.build:build", "minipar.parallel.zero.units:Unit.__init__"] + \
      [f"minipar.parallel.zero.stage1:Stage1.{m}" for m in ("__init__", "_on_grad_ready", "_unit_ready", "_drain",
                                                           "_receive", "finish", "after_update")] + \
      [f"minipar.parallel.zero.stage2:Stage2.{m}" for m in ("_count", "_unit_ready", "_receive")] + \
      [f"minipar.parallel.zero.stage3:Stage3.{m}" for m in ("_unit_ready", "gather", "release")] + \
      [f"minipar.parallel.zero.optimizer:ShardedAdamW.{m}" for m in ("__init__", "step")]
MAX_FAULTS = 20


# --- the seam: minipar's ZeRO, its per-unit work done by the student's functions ------------

class LabUnit(zero_units.Unit):
    """units.Unit laid out by the student's shard_bounds, with the fields student.py's
    docstring lists (param_flat, param_shard, grad_flat, grad_shard: None when not held;
    grad_flat is the lab's one name for stage 1's grad_full and stages 2/3's grad_staging)."""

    replicas, R = None, 1           # flat ZeRO: no replicas of a shard (hybrid.py is not the lab's)

    def __init__(self, names, params, N: int, rank: int, group, bounds, *, m, v, params_sharded: bool):
        """group: the ranks minipar's calls spread this unit over; m, v: the full optimizer's
        per-parameter arrays; params_sharded: stage 3 keeps the shard of the parameters only."""
        self.names, self.params = names, params
        self.group, self.N = group, N
        self.sizes = [p.size for p in params]
        self.offsets = np.cumsum([0] + self.sizes)[:-1].tolist()
        self.n = sum(self.sizes)
        lo, hi = (int(b) for b in bounds(self.n, N, rank))
        self.lo, self.hi, self.shard_size, self.n_pad = lo, hi, hi - lo, N * (hi - lo)
        if self.n_pad < self.n or lo != rank * self.shard_size:
            raise ValueError(f"shard_bounds({self.n}, {N}, {rank}) = ({lo}, {hi}): rank r's shard must start at "
                             f"r * (hi - lo), and N shards must cover the unit's {self.n} elements")
        self.segments = []
        for p, off, size in zip(params, self.offsets, self.sizes):
            a, b = max(off, lo), min(off + size, hi)
            if a < b:
                self.segments.append((p, slice(a - lo, b - lo), slice(a - off, b - off)))
        own = slice(lo, hi)
        self.m = self.flatten(m)[own].copy()                                # (hi-lo,)
        self.v = self.flatten(v)[own].copy()
        flat = self.flatten([p.data for p in params])                       # (n_pad,)
        self.param_flat = None if params_sharded else flat
        self.param_shard = flat[own].copy() if params_sharded else None
        self.grad_flat = self.grad_shard = None
        self.pending, self.reduced = len(params), 0
        self.kept = None            # stage 3: the released buffer a forward's ops still hold

    @property
    def label(self) -> str:
        return self.names[0] if len(self.names) == 1 else f"{self.names[0]}..{self.names[-1]}"


def placeholder(shape, dtype):
    """A released parameter (as stage3.Stage3.release): its shape, no memory, NaN if read."""
    return np.broadcast_to(np.array(np.nan, dtype=dtype), shape)


class LabZero(stage3.Stage3, zero_optimizer.ShardedAdamW):
    """minipar's ZeRO with the student's functions at its per-unit steps: one object, both the
    gradient synchroniser and the sharded optimizer, for the stage it is given (the student's
    functions take the stage). From Stage3 (and the Stage1 below it) it keeps the bookkeeping
    it does not override: the forward wrapped with gathers and Regather (stage 3 only), the
    global norm, the sizes; from ShardedAdamW gather_local (checkpoints, the twin's compare).
    A subclass made by lab_zero(student) sets `student` (the module) and `calls` (a
    one-element counter). faults: what it saw after the student's calls that the contract
    rules out (a transient buffer still held, a gathered buffer that is the shard itself),
    the first MAX_FAULTS."""

    student = None
    calls = [0]
    tracks_gathers = False          # Stage3's prefetch and its gathered-peak count are not the lab's
    R = 1                           # flat ZeRO: one replica of each shard (hybrid.py is not the lab's)

    def _run(self, name, *args):
        self.calls[0] += 1
        return getattr(self.student, name)(*args)

    def fault(self, text: str):
        if len(self.faults) < MAX_FAULTS:
            self.faults.append(text)

    def __init__(self, model, opt, group: comm.Group, stage: int):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        if isinstance(opt, MixedPrecisionAdamW):
            raise ValueError("lab 08 runs float32 or float64 parameters (no --precision fp16/bf16)")
        self.model, self.group, self.stage = model, group.with_axis("zero"), stage
        self.dp_group, self.N, self.rank = group, group.size, group.rank
        self.lr, self.betas, self.eps, self.weight_decay = opt.lr, opt.betas, opt.eps, opt.weight_decay
        self.step_count, self.mixed, self.scaler = opt.step_count, False, None
        self.dtype = np.dtype(model.dtype)
        self.layout = self                      # ShardedAdamW.gather_local asks it for own_params
        self.faults = []
        named = dict(model.named_parameters())
        ms, vs = dict(zip(named, opt.m)), dict(zip(named, opt.v))
        bounds = lambda n, N, rank: self._run("shard_bounds", n, N, rank)     # noqa: E731
        self.units, self.unit_of = [], {}
        for names in zero_units.unit_names(named):
            u = LabUnit(names, [named[n] for n in names], self.N, self.rank, self.group, bounds,
                        m=[ms[n] for n in names], v=[vs[n] for n in names], params_sharded=stage == 3)
            self.units.append(u)
            if stage == 3:
                for p in u.params:
                    p.data = placeholder(p.shape, self.dtype)
            else:
                u.point(u.param_flat)
            for p in u.params:
                self.unit_of[id(p)] = u
                p.register_grad_hook(self._on_grad_ready)
        del opt.m, opt.v
        self.talk_now, self.exposed_seconds = True, 0.0
        self.first, self.last, self.backwards = True, True, 0
        if stage == 3:
            model.parts.gathers.bind(self)      # Stage3's: gather / Regather around each block

    def own_params(self, u) -> np.ndarray:
        """This rank's shard of the unit's parameters (gather_local reads it)."""
        return u.param_shard if self.stage == 3 else u.param_flat[u.lo:u.hi]

    # --- a step's backwards --------------------------------------------------------------
    def zero_grad(self):
        for u in self.units:
            if self.stage == 1:                 # the model's .grad: views of the unit's buffer
                if u.grad_flat is None:
                    u.grad_flat = np.zeros(u.n_pad, dtype=self.dtype)
                for p, view in zip(u.params, u.unflatten(u.grad_flat)):
                    p.set_grad_buffer(view)
            else:
                for p in u.params:
                    p.grad = None

    def start_step(self):
        self.backwards = 0
        for u in self.units:
            u.pending, u.reduced = len(u.params), 0

    def sync_now(self, on: bool):
        self.first, self.last = self.backwards == 0, on
        self.backwards += 1

    def _on_grad_ready(self, p):
        u = self.unit_of[id(p)]
        if self.stage >= 2:                     # this micro-batch's gradient, in a full buffer
            if u.grad_flat is None:
                u.grad_flat = np.zeros(u.n_pad, dtype=self.dtype)
            i = u.params.index(p)
            u.grad_flat[u.offsets[i]:u.offsets[i] + u.sizes[i]] = p.grad.reshape(-1)
            p.grad = None
        u.pending -= 1
        if u.pending == 0:
            u.pending = len(u.params)
            u.reduced += 1
            self._run("reduce_gradient", self.group, self.stage, u, self.first, self.last)
            if self.stage >= 2 and u.grad_flat is not None:
                self.fault(f"after reduce_gradient (stage {self.stage}, micro-batch {self.backwards - 1} of the "
                           f"step) unit {u.label} still holds grad_flat {describe(u.grad_flat)}: stages 2 and 3 "
                           f"drop the full gradient at once (None), in every micro-batch")
            if self.stage == 3:
                self.release(u, after_backward=True)

    def finish(self):
        for u in self.units:
            if u.reduced != self.backwards:
                raise RuntimeError(f"unit {u.label}: its gradient was complete in {u.reduced} of "
                                   f"{self.backwards} backward(s)")
            if u.grad_shard is None or np.shape(u.grad_shard) != (u.shard_size,):
                raise ValueError(f"after the last backward unit {u.label} holds grad_shard "
                                 f"{describe(u.grad_shard)}; want its summed shard, shape ({u.shard_size},)")
        self.exposed_seconds = 0.0

    # --- the optimizer ---------------------------------------------------------------------
    def step(self, grad_scale: float = 1.0):
        self.step_count += 1
        for u in self.units:
            self._run("update", self.group, self.stage, u, self._adamw(u, grad_scale))
            if self.stage != 3:
                if np.shape(u.param_flat) != (u.n_pad,):
                    raise ValueError(f"after update unit {u.label} holds param_flat {describe(u.param_flat)}; "
                                     f"want the full parameters, shape ({u.n_pad},)")
                u.point(u.param_flat)           # the model's parameters: views of it

    def _adamw(self, u, grad_scale):
        def adamw(w, grad):
            """One AdamW step in place on w, the (hi-lo,) shard, from its summed gradient."""
            if np.shape(w) != (u.shard_size,) or np.shape(grad) != (u.shard_size,):
                raise ValueError(f"adamw(w, grad) on unit {u.label}: shapes {np.shape(w)}, {np.shape(grad)}; "
                                 f"want this rank's shard, ({u.shard_size},) each")
            for p, sh, _ in u.segments:         # ShardedAdamW.step's loop: weight decay per parameter
                wd = self.weight_decay if len(p.shape) >= 2 else 0.0
                adamw_update(w[sh], grad[sh], u.m[sh], u.v[sh], self.step_count, self.lr, self.betas,
                             self.eps, wd, grad_scale=grad_scale)
        return adamw

    # --- stage 3 ------------------------------------------------------------------------------
    def gather(self, u, again: bool = False, phase: str = "forward"):
        self._run("gather", self.group, u)
        if np.shape(u.param_flat) != (u.n_pad,):
            raise ValueError(f"after gather unit {u.label} holds param_flat {describe(u.param_flat)}; "
                             f"want the full parameters, shape ({u.n_pad},)")
        if isinstance(u.param_shard, np.ndarray) and np.shares_memory(u.param_flat, u.param_shard):
            self.fault(f"after gather unit {u.label}'s param_flat shares memory with its param_shard: "
                       f"release drops (frees) the gathered buffer, and the shard with it; gather into a "
                       f"new array, on a group of one too")
        if again and u.kept is not None:        # into the buffer the forward's ops saved
            u.kept[...] = u.param_flat
            u.param_flat = u.kept
        u.point(u.param_flat)

    def poll(self):
        """Stage3's prefetch is not the lab's: every gather is the student's, blocking."""

    def release(self, u, after_backward: bool = False):
        """The student's release, then Stage3.release's NumPy rule: a buffer the forward's
        graph still holds is poisoned with NaN and refilled by backward's re-gather."""
        buf = u.param_flat
        self._run("release", u)
        if u.param_flat is not None:            # not released: the memory criterion counts it
            self.fault(f"after release ({'after its backward' if after_backward else 'after its forward'}) "
                       f"unit {u.label} still holds param_flat {describe(u.param_flat)}: release drops it (None)")
            return
        for p in u.params:
            p.data = placeholder(p.shape, self.dtype)
        if buf is not None and not after_backward and is_grad_enabled():
            buf.fill(np.nan)
            u.kept = buf
        else:
            u.kept = None

    def memory_report(self) -> dict:
        """What this rank really holds (held()), beside formulas.formula, for the summary."""
        got = held(self)
        s = self.dtype.itemsize
        f = formula(self.stage, self.P, self.P_pad, self.N, s, optimizer_bytes_per_param(False, s))
        f["text"] = f"{f['text']} (P = {self.P:,} on this rank, N = {self.N}, padded to {self.P_pad:,})"
        return {**{k: sum(b for _, b, _ in got[k]) for k in ("params", "grads", "optimizer")}, "formula": f,
                "zero": {"stage": self.stage, "N": self.N, "P": self.P, "P_padded": self.P_pad,
                         "padding": self.padding, "units": len(self.units)}}


def lab_zero(student, calls=None):
    """LabZero running `student`'s functions; calls: the counter they add to."""
    return type("StudentZero", (LabZero,), {"student": student, "calls": calls if calls is not None else [0]})


def install(student):
    """The trainer's --zero builds the student's ZeRO (train.set_up calls build.build): one
    LabZero, both the synchroniser and the optimizer."""
    calls = [0]
    cls = lab_zero(student, calls)

    def build(model, opt, group, stage, **layout):
        """zero.build's place: flat ZeRO with plain gathers (the trainer passes the defaults of
        --shard-group, --prefetch, --reshard-after-forward and ZeRO++ only when they are set)."""
        if layout:
            raise ValueError(f"lab 08 builds flat ZeRO with plain gathers; drop {', '.join(sorted(layout))}")
        z = cls(model, opt, group, stage)
        return z, z
    zero_build.build = build
    return lambda: calls[0]


def describe(a) -> str:
    return "None" if a is None else f"of shape {np.shape(a)}"


def held(z) -> dict:
    """{"params" | "grads" | "optimizer" | "other": [(where, bytes, dtype name)]}: every array
    this rank keeps, in its units' fields and the model's .data and .grad, each buffer counted
    once (a view counts as the array it views; a released parameter's placeholder as 0)."""
    kind = {"param_flat": "params", "param_shard": "params", "kept": "params", "grad_flat": "grads",
            "grad_shard": "grads", "m": "optimizer", "v": "optimizer"}
    seen, out = set(), {"params": [], "grads": [], "optimizer": [], "other": []}

    def count(a, category, where):
        if not isinstance(a, np.ndarray):
            return
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        if root.ndim == 0 or id(root) in seen:
            return
        seen.add(id(root))
        out[category].append((where, int(root.nbytes), a.dtype.name))

    for u in z.units:
        for field in (*UNIT_FIELDS, "kept"):
            count(getattr(u, field, None), kind[field], f"unit {u.label}: {field}")
        for field, a in vars(u).items():                  # anything else the student left on it
            if field not in kind and isinstance(a, np.ndarray):
                count(a, "other", f"unit {u.label}: {field}")
        for p in u.params:
            count(p.data, "params", f"{p.name}.data")
            count(p.grad, "grads", f"{p.name}.grad")
    return out


# --- the runs ---------------------------------------------------------------------------------

CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
WORLD = MPI.COMM_WORLD
WORLD_SIZE = 4
STEPS = 2
# (stage, N, micro-batches, dtype, batch) of each criterion's runs. N cuts the world in blocks
# of N ranks (a smaller last block: N = 3 leaves rank 3 alone); the batch is cut into N * M.
MEMORY = [(s, N, 2, d, 24) for d in ("float64", "float32") for s in (1, 2, 3) for N in (2, 3)]
BYTES = [(s, N, 2, "float64", 24) for s in (1, 2, 3) for N in (3, 4)] + \
        [(s, 4, 3, "float32", 24) for s in (1, 2, 3)]
TWIN = [(s, N, 2, "float64", 24) for s in (1, 2, 3) for N in (2, 3)] + \
       [(s, 3, 2, "float32", 24) for s in (1, 2, 3)] + \
       [(s, 3, 3, "float64", 36) for s in (1, 2, 3)] + \
       [(s, 2, 1, "float64", 24) for s in (1, 2, 3)]


def flags(micro_batches, dtype="float64", batch=24, steps=STEPS):
    return train.build_parser().parse_args(
        ["--batch-size", str(batch), "--steps", str(steps), "--micro-batches", str(micro_batches), "--warmup", "1",
         "--lr", "1e-2", "--grad-clip", "0", "--dtype", dtype, "--seed", "0"])


def group_of(world_rank: int, N: int) -> tuple[int, int]:
    """(the size of world rank's dp group when the world is cut in blocks of N, its dp rank)."""
    first = world_rank // N * N
    return min(N, WORLD_SIZE - first), world_rank - first


def where(stage, N, M, dtype, batch, world_rank) -> str:
    """The case, as the grader's messages and the timeouts name it."""
    size, r = group_of(world_rank, N)
    alone = " (a group of one)" if size == 1 else ""
    return f"stage {stage}, {dtype}, N={size}{alone}, dp rank {r} (world rank {world_rank}), micro-batches {M}, " \
           f"batch {batch}"


def run_key(name, stage, N, M, dtype, batch):
    return key(name, stage, N, M, dtype, batch)


def steps(args, sub=None, stage=0, student=None, each=None):
    """args.steps steps of the model in args.dtype. sub None: the single-process twin (minipar's
    own code only: what the grader runs); else the student's ZeRO `stage` on the ranks of sub.
    each(row, z) after every step. -> (rows, canonical params, z)."""
    B = args.batch_size
    sampler = data.Sampler(data.load_tokens(None, CFG.block_size), CFG.block_size, B, args.seed)
    gathers = stage3.Gathers() if sub is not None and stage == 3 else None    # as parallelize builds them
    model = GPT(CFG, seed=args.seed, dtype=np.dtype(args.dtype), parts=parts(gathers=gathers))
    opt = train.build_optimizer(model, args)
    if sub is None:
        s = train.Session(args, model, opt, sampler)
    else:
        grid = ProcessGrid(sub, Layout(dp=sub.Get_size()))
        opt = lab_zero(student)(model, opt, grid.dp_group, stage)
        N, r = grid.dp_size, grid.dp_rank
        s = train.Session(args, model, opt, sampler, sync=opt, rows=(r * B // N, (r + 1) * B // N),
                          dp_group=grid.dp_group if N > 1 else None)
    rows = []
    for row in train.train_steps(s, 0, args.steps):
        rows.append(row)
        if each is not None:
            each(row, opt)
    return rows, checkpoint.canonical_state(model, opt), (opt if sub is not None else None)


def each_run(cases, out, name):
    """For each case: this rank's sub-communicator (the world cut in blocks of N), the case
    named in out.case, its key; the sub-communicator is freed after."""
    for stage, N, M, dtype, batch in cases:
        sub = WORLD.Split(color=WORLD.Get_rank() // N, key=WORLD.Get_rank())
        out.case(f"{name}: " + where(stage, N, M, dtype, batch, WORLD.Get_rank()))
        yield stage, sub, flags(M, dtype, batch), run_key(name, stage, N, M, dtype, batch)
        sub.Free()


# --- what the child runs ----------------------------------------------------------------------

def bounds_cases():
    """(n, N): every n up to 40 for N = 1..8 (n divisible by N and not), unit sizes of this lab's
    model and of the default one, sizes one past a multiple, and a teacher's extra "bounds"
    ($MINIPAR_LAB_EXTRA/08_zero/cases.json)."""
    extra = [tuple(map(int, c)) for c in extra_cases(HERE).get("bounds", [])]
    return [(n, N) for N in range(1, 9) for n in (*range(1, 41), 4096, 3280, 288, 65536, 197_376, 65_537)] + extra


def bounds(student, out):
    for n, N in bounds_cases():
        got = []
        for r in range(N):
            out.case(f"shard_bounds(n={n}, N={N}, rank={r})")
            got.append(student.shard_bounds(n, N, r))
        out.put(key("bounds", n, N), got)


def memory(student, out):
    """After each step: every array the rank holds (held()), and LabZero's faults."""
    for stage, sub, args, k in each_run(MEMORY, out, "memory"):
        def each(row, z, k=k):
            out.put(key(k, "held", row["step"]), held(z))
            out.put(key(k, "faults", row["step"]), list(z.faults))
        steps(args, sub, stage, student, each)


def ledger(student, out):
    """Each step: the bytes on the "zero" axis, and the reduce-scatters, all-gathers and all
    calls the ledger counted there. A rank alone in its group sits the run out."""
    for stage, sub, args, k in each_run(BYTES, out, "bytes"):
        if sub.Get_size() == 1:
            continue
        before = [comm.traffic(), comm.traffic_by_axis()]

        def each(row, z, k=k, before=before):
            ops, axes = comm.traffic(), comm.traffic_by_axis()
            rs, ag, calls = (now.get(name, {}).get("calls", 0) - then.get(name, {}).get("calls", 0)
                             for now, then, name in ((ops, before[0], "reduce_scatter"),
                                                     (ops, before[0], "all_gather"), (axes, before[1], "zero")))
            before[:] = ops, axes
            out.put(key(k, row["step"]), {"zero_bytes": row["zero_bytes"], "reduce_scatter": int(rs),
                                          "all_gather": int(ag), "zero_calls": int(calls)})
        steps(args, sub, stage, student, each)


def twin(student, out):
    """The losses and gradient norms of every step, and every parameter after the steps."""
    for stage, sub, args, k in each_run(TWIN, out, "twin"):
        rows, params, _ = steps(args, sub, stage, student)
        out.put(key(k, "loss"), [row["loss"] for row in rows])
        out.put(key(k, "grad_norm"), [row["grad_norm"] for row in rows])
        out.put(key(k, "params"), params)


def unit_sizes() -> list:
    """Elements of each unit (units.unit_names) of this lab's model, before padding."""
    shapes = {n: p.size for n, p in GPT(CFG).named_parameters()}
    return [sum(shapes[n] for n in u) for u in zero_units.unit_names(list(shapes))]


def unit_names() -> list:
    return zero_units.unit_names([n for n, _ in GPT(CFG).named_parameters()])
