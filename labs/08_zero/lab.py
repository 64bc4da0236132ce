"""Lab 08's seam and criteria (labs/framework.py says what a lab is).

Seam: minipar.parallel.zero.Zero, the object the trainer builds for --zero 1|2|3, replaced by
LabZero (install), a subclass that keeps minipar's bookkeeping (the units of zero.unit_names,
the gradient hooks that say when a unit's gradient is complete, stage 3's Regather around
each block, the global norm, the checkpoints) and hands the per-unit work to the student:
where a rank's shard lies (shard_bounds), what a unit's finished gradient becomes
(reduce_gradient), the AdamW step on the shard and the all-gather after it (update), and
stage 3's gather and release of a unit's parameters. The student's collectives are
minipar's own (comm.reduce_scatter, comm.all_gather), blocking: every rank completes its
units in the same order, so they pair up.

Oracles: the single-process twin (every rank computes it alone, no messages), zero.formula
for the bytes a rank holds (its padding from zero.padded, not from the student), and
zero.traffic_theory / zero.collectives_per_step for what minipar's ledger counts. Groups of
N = 2, 3, 4 ranks are cut from 4; with N = 3 every unit but one is padded, and the fourth
rank runs ZeRO over a group of one.
"""
import os

import numpy as np
from mpi4py import MPI

from labs.framework import Criterion, collective_uses, extra_cases, first_difference, trainer_flags
from minipar import checkpoint, comm, data, train
from minipar.model import GPT, GPTConfig
from minipar.optim import adamw_update
from minipar.parallel import zero
from minipar.parallel.grid import ProcessGrid
from minipar.precision import MixedPrecisionAdamW, optimizer_bytes_per_param
from minipar.tensor import is_grad_enabled
from minipar.verify import judged

TITLE = "ZeRO stages 1, 2 and 3: one unit's shard, reduce-scatter, AdamW, all-gather"
HERE = os.path.dirname(os.path.abspath(__file__))
UNIT_FIELDS = ("param_flat", "param_shard", "grad_flat", "grad_shard", "m", "v")


# --- the seam: minipar's Zero, its per-unit work done by the student's functions ------------

class LabUnit(zero.Unit):
    """zero.Unit laid out by the student's shard_bounds, with the fields student.py's
    docstring lists (param_flat, param_shard, grad_flat, grad_shard: None when not held)."""

    def __init__(self, names, params, N: int, rank: int, bounds):
        self.names, self.params = names, params
        self.sizes = [p.size for p in params]
        self.offsets = np.cumsum([0] + self.sizes)[:-1].tolist()
        self.n = sum(self.sizes)
        lo, hi = (int(b) for b in bounds(self.n, N, rank))
        self.lo, self.hi, self.shard, self.n_pad = lo, hi, hi - lo, N * (hi - lo)
        if self.n_pad < self.n or lo != rank * self.shard:
            raise ValueError(f"shard_bounds({self.n}, {N}, {rank}) = ({lo}, {hi}): rank r's shard must start at "
                             f"r * (hi - lo), and N shards must cover the unit's {self.n} elements")
        self.segments = []
        for p, off, size in zip(params, self.offsets, self.sizes):
            a, b = max(off, lo), min(off + size, hi)
            if a < b:
                self.segments.append((p, slice(a - lo, b - lo), slice(a - off, b - off)))
        self.param_flat = self.param_shard = self.grad_flat = self.grad_shard = None
        self.pending, self.reduced = len(params), 0
        self.kept = None            # stage 3: the released buffer a forward's ops still hold

    @property
    def label(self) -> str:
        return self.names[0] if len(self.names) == 1 else f"{self.names[0]}..{self.names[-1]}"


def placeholder(shape, dtype):
    """A released parameter (as zero.Zero.release): its shape, no memory, NaN if read."""
    return np.broadcast_to(np.array(np.nan, dtype=dtype), shape)


class LabZero(zero.Zero):
    """zero.Zero with the student's functions at its per-unit steps. A subclass made by
    lab_zero(student) sets `student` (the module) and `calls` (a one-element counter)."""

    student = None
    calls = [0]

    def _run(self, name, *args):
        self.calls[0] += 1
        return getattr(self.student, name)(*args)

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
        named = dict(model.named_parameters())
        ms, vs = dict(zip(named, opt.m)), dict(zip(named, opt.v))
        bounds = lambda n, N, rank: self._run("shard_bounds", n, N, rank)     # noqa: E731
        self.units, self.unit_of = [], {}
        for names in zero.unit_names(named):
            u = LabUnit(names, [named[n] for n in names], self.N, self.rank, bounds)
            u.group, u.N = self.group, self.N       # the ranks zero.Zero's calls spread this unit over
            self.units.append(u)
            own = slice(u.lo, u.hi)
            u.m = u.flatten([ms[n] for n in names])[own].copy()             # (hi-lo,)
            u.v = u.flatten([vs[n] for n in names])[own].copy()
            flat = u.flatten([p.data for p in u.params])                    # (n_pad,)
            if stage == 3:
                u.param_shard = flat[own].copy()
                for p in u.params:
                    p.data = placeholder(p.shape, self.dtype)
            else:
                u.param_flat = flat
                u.point(flat)
            for p in u.params:
                self.unit_of[id(p)] = u
                p.register_grad_hook(self._on_grad_ready)
        del opt.m, opt.v
        self.sync, self.fresh, self.exposed_seconds = True, True, 0.0
        self.first, self.last, self.backwards = True, True, 0
        if stage == 3:
            self._wrap_forward()                # zero.Zero's: gather / Regather around each block

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
            if self.stage == 3:
                self.release(u, after_backward=True)

    def finish(self):
        for u in self.units:
            if u.reduced != self.backwards:
                raise RuntimeError(f"unit {u.label}: its gradient was complete in {u.reduced} of "
                                   f"{self.backwards} backward(s)")
            if u.grad_shard is None or np.shape(u.grad_shard) != (u.shard,):
                raise ValueError(f"after the last backward unit {u.label} holds grad_shard "
                                 f"{describe(u.grad_shard)}; want its summed shard, shape ({u.shard},)")
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
            if np.shape(w) != (u.shard,) or np.shape(grad) != (u.shard,):
                raise ValueError(f"adamw(w, grad) on unit {u.label}: shapes {np.shape(w)}, {np.shape(grad)}; "
                                 f"want this rank's shard, ({u.shard},) each")
            for p, sh, _ in u.segments:         # zero.Zero.step's loop: weight decay per parameter
                wd = self.weight_decay if len(p.shape) >= 2 else 0.0
                adamw_update(w[sh], grad[sh], u.m[sh], u.v[sh], self.step_count, self.lr, self.betas,
                             self.eps, wd, grad_scale=grad_scale)
        return adamw

    # --- stage 3 ------------------------------------------------------------------------------
    def gather(self, u, again: bool = False):
        self._run("gather", self.group, u)
        if np.shape(u.param_flat) != (u.n_pad,):
            raise ValueError(f"after gather unit {u.label} holds param_flat {describe(u.param_flat)}; "
                             f"want the full parameters, shape ({u.n_pad},)")
        if again and u.kept is not None:        # into the buffer the forward's ops saved
            u.kept[...] = u.param_flat
            u.param_flat = u.kept
        u.point(u.param_flat)

    def release(self, u, after_backward: bool = False):
        """The student's release, then zero.Zero.release's NumPy rule: a buffer the forward's
        graph still holds is poisoned with NaN and refilled by backward's re-gather."""
        buf = u.param_flat
        self._run("release", u)
        if u.param_flat is not None:            # not released: the memory criterion counts it
            return
        for p in u.params:
            p.data = placeholder(p.shape, self.dtype)
        if buf is not None and not after_backward and is_grad_enabled():
            buf.fill(np.nan)
            u.kept = buf
        else:
            u.kept = None

    def memory_report(self) -> dict:
        """What this rank really holds (held()), beside zero.formula, for the summary."""
        got = held(self)
        s = self.dtype.itemsize
        f = zero.formula(self.stage, self.P, self.P_pad, self.N, s, optimizer_bytes_per_param(False, s))
        f["text"] = f"{f['text']} (P = {self.P:,} on this rank, N = {self.N}, padded to {self.P_pad:,})"
        return {**{k: sum(b for _, b in got[k]) for k in ("params", "grads", "optimizer")}, "formula": f,
                "zero": {"stage": self.stage, "N": self.N, "P": self.P, "P_padded": self.P_pad,
                         "padding": self.padding, "units": len(self.units)}}


def lab_zero(student, calls=None):
    """LabZero running `student`'s functions; calls: the counter they add to."""
    return type("StudentZero", (LabZero,), {"student": student, "calls": calls if calls is not None else [0]})


def install(student):
    """The trainer's --zero builds the student's ZeRO (train.set_up calls zero.Zero)."""
    calls = [0]
    zero.Zero = lab_zero(student, calls)
    return lambda: calls[0]


def describe(a) -> str:
    return "None" if a is None else f"of shape {np.shape(a)}"


def held(z) -> dict:
    """{"params" | "grads" | "optimizer" | "other": [(where, bytes)]}: every array this
    rank keeps, in its units' fields and the model's .data and .grad, each buffer counted
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
        out[category].append((where, root.nbytes))

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


# --- running a few steps -------------------------------------------------------------------

CFG = GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16)
WORLD = MPI.COMM_WORLD


def flags(steps, micro_batches):
    return train.build_parser().parse_args(
        ["--batch-size", "24", "--steps", str(steps), "--micro-batches", str(micro_batches), "--warmup", "1",
         "--lr", "1e-2", "--grad-clip", "0", "--dtype", "float64", "--seed", "0"])


def steps(student, args, sub=None, stage=0, each=None):
    """args.steps steps. sub None: the single-process twin; else the student's ZeRO `stage`
    on the ranks of sub. each(row, z) after every step. -> (rows, canonical params, z)."""
    B = args.batch_size
    sampler = data.Sampler(data.load_tokens(None, CFG.block_size), CFG.block_size, B, args.seed)
    model = GPT(CFG, seed=args.seed, dtype=np.float64)
    opt = train.build_optimizer(model, args)
    if sub is None:
        s = train.Session(args, model, opt, sampler)
    else:
        grid = ProcessGrid(sub, dp=sub.Get_size())
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


def groups(sizes):
    """A sub-communicator for each N: the world cut into blocks of N ranks in order (the last
    block smaller when N does not divide 4: this rank's group has sub.Get_size() ranks)."""
    for N in sizes:
        sub = WORLD.Split(color=WORLD.Get_rank() // N, key=WORLD.Get_rank())
        yield sub
        sub.Free()


def case(stage, sub, M):
    return f"stage {stage}, N={sub.Get_size()} (dp rank {sub.Get_rank()}), micro-batches {M}"


# --- the criteria -------------------------------------------------------------------------

def check_static(student):
    """The student's file calls none of MPI's collectives (its collectives are minipar's)."""
    found = collective_uses(student)
    assert not found, "MPI's own collectives: " + "; ".join(found[:3]) + \
        " (use comm.reduce_scatter(g, x) and comm.all_gather(g, piece))"


def bounds_cases():
    """(n, N): every n up to 40 for N = 1..8, unit sizes of this lab's model and of the
    default one, and a teacher's extra "bounds" ($MINIPAR_LAB_EXTRA/08_zero/cases.json)."""
    extra = [tuple(map(int, c)) for c in extra_cases(HERE).get("bounds", [])]
    return [(n, N) for N in range(1, 9) for n in (*range(1, 41), 4096, 3280, 288, 65536, 197_376, 65_537)] + extra


def check_bounds(student):
    for n, N in bounds_cases():
        n_pad = n + (-n) % N                               # the next multiple of N
        pieces = np.array_split(np.arange(n_pad), N)       # what comm.reduce_scatter hands out
        for r in range(N):
            want = (int(pieces[r][0]), int(pieces[r][-1]) + 1)
            got = student.shard_bounds(n, N, r)
            ok = isinstance(got, tuple) and len(got) == 2 and tuple(int(b) for b in got) == want
            assert ok, f"n={n} N={N} rank {r}: shard_bounds returned {got!r}, want {want} " \
                       f"(n padded to {n_pad}, {n_pad // N} per rank)"


def check_twin(student):
    """Losses and clipping's gradient norms at 1e-12 relative, every parameter after the
    steps at 1e-12 of its tensor's largest entry (the key biases' rounding noise aside, as
    --verify), against the twin; N = 2 and 3 (the rank left over runs ZeRO alone)."""
    args = flags(2, 2)
    ref_rows, ref_params, _ = steps(student, args)
    for stage in (1, 2, 3):
        for sub in groups((2, 3)):
            rows, params, z = steps(student, args, sub, stage)
            what = case(stage, sub, 2)
            for step, (row, ref) in enumerate(zip(rows, ref_rows)):     # in the order they happen
                for key in ("loss", "grad_norm"):
                    a, b = row[key], ref[key]
                    assert first_difference(a, b) is None, f"{what}: {key} of step {step}: got {a!r}, " \
                                                           f"want {b!r} (relative difference {abs(a - b) / abs(b):.3g})"
            for name, want in ref_params.items():
                scale = max(float(np.abs(want).max()), 1e-30)
                diff = first_difference(judged(name, params[name]), judged(name, want), rtol=0, atol=1e-12 * scale)
                assert diff is None, f"{what}: {name} after {args.steps} steps: {diff}{owner(z, name, params, want)}"


def owner(z, name, got, want) -> str:
    """Which dp rank's shard holds the first bad element of parameter `name`."""
    for u in z.units:
        if name in u.names:
            bad = ~np.isclose(got[name], want, rtol=0, atol=1e-12 * max(float(np.abs(want).max()), 1e-30))
            at = u.offsets[u.names.index(name)] + int(np.argmax(bad.ravel()))
            per_rank = zero.padded(u.n, z.N) // z.N
            return f" (element {at} of unit {u.label}: in dp rank {at // per_rank}'s shard of {per_rank})"
    return ""


def unit_sizes() -> list:
    """Elements of each unit (zero.unit_names) of this lab's model, before padding."""
    shapes = {n: p.size for n, p in GPT(CFG).named_parameters()}
    return [sum(shapes[n] for n in u) for u in zero.unit_names(list(shapes))]


def check_memory(student):
    """After each step (the update included): the bytes of parameters, gradients and
    optimizer state the rank holds (held()) equal zero.formula, and nothing else is held."""
    for stage in (1, 2, 3):
        for sub in groups((2, 3)):
            N = sub.Get_size()
            P, P_pad = sum(unit_sizes()), sum(zero.padded(n, N) for n in unit_sizes())
            f = zero.formula(stage, P, P_pad, N, 8, optimizer_bytes_per_param(False, 8))
            what = case(stage, sub, 2)

            def each(row, z):
                got = held(z)
                for key, term in zip(("params", "grads", "optimizer"), f["text"].split(" + ")):
                    total = sum(b for _, b in got[key])
                    assert total == f[key], \
                        f"{what}, after step {row['step']}: {key} held {total:,} B, zero.formula's {term} = " \
                        f"{f[key]:,} B (P = {P:,}, padded {P_pad:,}); held: {listing(got[key])}"
                assert not got["other"], f"{what}: arrays held beyond the contract's fields: {listing(got['other'])}"
            steps(student, flags(2, 2), sub, stage, each)


def listing(items, most=4) -> str:
    if not items:
        return "nothing"
    big = sorted(items, key=lambda wb: -wb[1])
    more = f", ... ({len(items)} arrays)" if len(items) > most else ""
    return ", ".join(f"{w} {b:,} B" for w, b in big[:most]) + more


def check_bytes(student):
    """Each step's bytes on the "zero" axis of minipar's ledger equal zero.traffic_theory of
    the padded units, and its reduce-scatters and all-gathers zero.collectives_per_step."""
    M = 2
    for stage in (1, 2, 3):
        for sub in groups((3, 4)):
            N = sub.Get_size()
            if N == 1:                                     # a group of one sends nothing
                continue
            units = unit_sizes()
            theory = sum(zero.traffic_theory(stage, zero.padded(n, N), N, 8, M) for n in units)
            rs, ag = (k * len(units) for k in zero.collectives_per_step(stage, M))
            what = case(stage, sub, M)
            before = [comm.traffic(), comm.traffic_by_axis()]

            def each(row, z):
                ops, axes = comm.traffic(), comm.traffic_by_axis()
                rs_got, ag_got, zero_calls = (
                    now.get(key, {}).get("calls", 0) - then.get(key, {}).get("calls", 0)
                    for now, then, key in ((ops, before[0], "reduce_scatter"), (ops, before[0], "all_gather"),
                                           (axes, before[1], "zero")))
                before[:] = ops, axes
                others = zero_calls - rs_got - ag_got
                assert (rs_got, ag_got, others) == (rs, ag, 0) and row["zero_bytes"] == theory, \
                    f"{what}, step {row['step']}: sent {row['zero_bytes']:,.0f} B with {rs_got} reduce-scatter(s), " \
                    f"{ag_got} all-gather(s)" + (f" and {others} other call(s)" if others else "") + \
                    f"; theory {theory:,.0f} B with {rs} and {ag} ({len(units)} units, " \
                    f"zero.collectives_per_step({stage}, {M}) = {zero.collectives_per_step(stage, M)} each)"
            steps(student, flags(2, M), sub, stage, each)



TINY = dict(n_embd=24, batch_size=12, micro_batches=2)      # trainer_flags: the float64 model, no padding

CRITERIA = [
    Criterion("no MPI collective", check=check_static, timeout=30,
              hint="communicate with comm.reduce_scatter(g, x) and comm.all_gather(g, piece) only"),
    Criterion("shard_bounds for many (n, N)", check=check_bounds, timeout=30,
              hint="pad first: minipar.parallel.zero.padded(n, N) is the next multiple of N; then every "
                   "rank's shard has the same n_pad / N elements"),
    Criterion("memory against zero.formula", ranks=4, check=check_memory, timeout=60,
              hint="keep what the contract's table lists and set the rest to None: stage 1 param_flat + "
                   "grad_flat, stage 2 param_flat + grad_shard, stage 3 param_shard + grad_shard"),
    Criterion("bytes against zero.traffic_theory", ranks=4, check=check_bytes, timeout=60,
              hint="stage 1 reduce-scatters only when last is True; a reduce-scatter sends (N-1)/N of the "
                   "unit, an all-reduce twice that; comm.traffic() shows the calls"),
    Criterion("stages 1-3 against one process", ranks=4, check=check_twin, timeout=60,
              hint="update the shard first, then all-gather it; in stage 2 add every micro-batch's piece "
                   "into grad_shard (first=True sets it); comm.reduce_scatter hands rank r the piece [lo, hi)"),
    Criterion("trainer --dp 2 --zero 1 --verify", ranks=2, trainer=trainer_flags("--dp", "2", "--zero", "1", **TINY),
              timeout=60, hint="the real trainer with your ZeRO-1 on 2 ranks, against one process in float64"),
    Criterion("trainer --dp 2 --zero 2 --verify", ranks=2, trainer=trainer_flags("--dp", "2", "--zero", "2", **TINY),
              timeout=60, hint="the real trainer with your ZeRO-2 on 2 ranks, against one process in float64"),
    Criterion("trainer --dp 2 --zero 3 --verify", ranks=2, trainer=trainer_flags("--dp", "2", "--zero", "3", **TINY),
              timeout=60, hint="stage 3 gathers each block before its forward and again before its "
                               "backward (parallel.zero.Regather), and releases it after each"),
]
