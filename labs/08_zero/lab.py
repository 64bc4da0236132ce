"""Lab 08's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): minipar.parallel.zero.build.build, which the trainer calls for --zero 1|2|3,
replaced by one that builds drive.LabZero, a subclass of stage3.Stage3 and optimizer.ShardedAdamW
that keeps minipar's bookkeeping (the units of units.unit_names, the gradient hooks that say
when a unit's gradient is complete, stage 3's Regather around each block, the global norm, the checkpoints) and hands the per-unit work to
the student: where a rank's shard lies (shard_bounds), what a unit's finished gradient
becomes (reduce_gradient), the AdamW step on the shard and the all-gather after it (update),
and stage 3's gather and release of a unit's parameters. The student's collectives are
minipar's own (comm.reduce_scatter, comm.all_gather), blocking: every rank completes its
units in the same order, so they pair up.

Oracles, computed here: np.array_split's pieces of the padded unit for shard_bounds;
formulas.formula of units.padded units for the bytes a rank holds, in the parameters' dtype;
formulas.traffic_theory and formulas.collectives_per_step for what minipar's ledger counts; the
single-process twin (drive.steps with no group: minipar's own code only) for the losses,
gradient norms and parameters; labs/twin.py's twin for the trainer runs, whose summary's
memory and ZeRO bytes are held to the same formulas. The child hands back only what the
student's code returned, what LabZero saw, and what the ledger and held() measured.
"""
import os

import numpy as np

from labs.framework import Criterion, first_difference, load_drive, trainer_flags
from labs.results import key, typename
from labs.scan import Allowed
from minipar.model.gpt import GPT
from minipar.parallel.zero import formulas, units as zero_units
from minipar.optim.mixed_precision import optimizer_bytes_per_param
from minipar.train.verify import judged

TITLE = "ZeRO stages 1, 2 and 3: one unit's shard, reduce-scatter, AdamW, all-gather"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
OWN_ZERO = "minipar's own ZeRO: this lab grades yours"
ALLOWED = Allowed(
    modules={"minipar.comm": {"reduce_scatter", "all_gather", "traffic"},
             "minipar.parallel.zero.units": {"padded"}},
    refused={"minipar.parallel.zero.units.Unit": OWN_ZERO, "minipar.parallel.zero.stage1.Stage1": OWN_ZERO,
             "minipar.parallel.zero.stage2.Stage2": OWN_ZERO, "minipar.parallel.zero.stage3.Stage3": OWN_ZERO,
             "minipar.parallel.zero.stage3.Regather": OWN_ZERO,
             "minipar.parallel.zero.optimizer.ShardedAdamW": OWN_ZERO, "minipar.parallel.zero.build.build": OWN_ZERO})
# float32: the ranks sum their rows' gradients in another order than one process does; the
# solution stays within about 6e-8 (losses, norms) and 9e-6 of a tensor's largest entry
F32 = {"loss": 1e-6, "param": 1e-4}
KINDS = ("params", "grads", "optimizer")
_twins: dict = {}


def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


# --- shard_bounds ---------------------------------------------------------------------------

def judge_bounds(res):
    for n, N in drive.bounds_cases():
        n_pad = n + (-n) % N                               # the next multiple of N
        pieces = np.array_split(np.arange(n_pad), N)       # what comm.reduce_scatter hands out
        got_all = res.get(0, key("bounds", n, N))
        assert isinstance(got_all, list) and len(got_all) == N, \
            f"n={n} N={N}: the child handed back {typename(got_all)} for the {N} ranks (tampered with?)"
        for r, got in enumerate(got_all):
            want = (int(pieces[r][0]), int(pieces[r][-1]) + 1)
            what = f"n={n} N={N} rank {r}: shard_bounds returned {got!r}"
            assert isinstance(got, tuple) and len(got) == 2, f"{what}, want the tuple {want}"
            assert all(is_int(b) for b in got), \
                f"{what} ({typename(got[0])}, {typename(got[1])}), want two ints {want}: the bounds slice arrays"
            assert tuple(int(b) for b in got) == want, \
                f"{what}, want {want} (n padded to {n_pad}, {n_pad // N} per rank)"


# --- memory -----------------------------------------------------------------------------------

def listing(items, most=4) -> str:
    if not items:
        return "nothing"
    big = sorted(items, key=lambda wbd: -wbd[1])
    more = f", ... ({len(items)} arrays)" if len(items) > most else ""
    return ", ".join(f"{w} {b:,} B {d}" for w, b, d in big[:most]) + more


def held_lists(got, what) -> dict:
    """held()'s record, checked for shape: {kind: [(where, bytes, dtype name)]}."""
    ok = isinstance(got, dict) and all(
        isinstance(got.get(k), list) and all(isinstance(x, tuple) and len(x) == 3 and isinstance(x[0], str)
                                             and is_int(x[1]) and isinstance(x[2], str) for x in got[k])
        for k in (*KINDS, "other"))
    assert ok, f"{what}: the child handed back {typename(got)} for the arrays held (tampered with?)"
    return got


def formula_for(stage, size, dtype) -> tuple[dict, int, int]:
    """formulas.formula for this lab's model on a group of `size` ranks -> (formula, P, P_pad)."""
    units = drive.unit_sizes()
    s = np.dtype(dtype).itemsize
    P, P_pad = sum(units), sum(zero_units.padded(n, size) for n in units)
    return formulas.formula(stage, P, P_pad, size, s, optimizer_bytes_per_param(False, s)), P, P_pad


def judge_memory(res):
    """After each step (the update included): every array held is in the parameters' dtype,
    the bytes of parameters, gradients and optimizer state equal formulas.formula, nothing else is
    held; and after each call LabZero saw no transient buffer kept and no gathered buffer that
    is the shard itself."""
    for stage, N, M, dtype, batch in drive.MEMORY:
        k = drive.run_key("memory", stage, N, M, dtype, batch)
        for w in range(drive.WORLD_SIZE):
            size, _ = drive.group_of(w, N)
            f, P, P_pad = formula_for(stage, size, dtype)
            for step in range(drive.STEPS):
                what = f"{drive.where(stage, N, M, dtype, batch, w)}, after step {step}"
                got = held_lists(res.get(w, key(k, "held", step)), what)
                for kind in (*KINDS, "other"):
                    wrong = [x for x in got[kind] if x[2] != dtype]
                    assert not wrong, f"{what}: {listing(wrong)} held, the parameters are {dtype}: every " \
                                      f"buffer keeps the parameters' dtype (np.zeros(n) is float64: give it a dtype)"
                for kind, term in zip(KINDS, f["text"].split(" + ")):
                    total = sum(b for _, b, _ in got[kind])
                    assert total == f[kind], \
                        f"{what}: {kind} held {total:,} B, formulas.formula's {term} = {f[kind]:,} B (P = {P:,}, " \
                        f"padded {P_pad:,}, N = {size}); held: {listing(got[kind])}"
                assert not got["other"], f"{what}: arrays held beyond the contract's fields: {listing(got['other'])}"
                faults = res.get(w, key(k, "faults", step))          # LabZero's, up to this step
                assert isinstance(faults, list), f"{what}: the child handed back {typename(faults)} for the faults"
                assert not faults, f"{drive.where(stage, N, M, dtype, batch, w)}, by the end of step {step}: " \
                                   f"{faults[0]}" + (f" (and {len(faults) - 1} more)" if len(faults) > 1 else "")


# --- bytes --------------------------------------------------------------------------------------

def judge_bytes(res):
    """Each step's bytes on the "zero" axis of minipar's ledger equal formulas.traffic_theory of
    the padded units, and its reduce-scatters and all-gathers formulas.collectives_per_step."""
    units = drive.unit_sizes()
    for stage, N, M, dtype, batch in drive.BYTES:
        k = drive.run_key("bytes", stage, N, M, dtype, batch)
        s = np.dtype(dtype).itemsize
        for w in range(drive.WORLD_SIZE):
            size, _ = drive.group_of(w, N)
            if size == 1:                                  # a group of one sends nothing: not run
                continue
            theory = sum(formulas.traffic_theory(stage, zero_units.padded(n, size), size, s, M) for n in units)
            rs, ag = (c * len(units) for c in formulas.collectives_per_step(stage, M))
            for step in range(drive.STEPS):
                what = f"{drive.where(stage, N, M, dtype, batch, w)}, step {step}"
                got = res.get(w, key(k, step))
                ok = isinstance(got, dict) and all(isinstance(got.get(f), (int, float)) for f in
                                                   ("zero_bytes", "reduce_scatter", "all_gather", "zero_calls"))
                assert ok, f"{what}: the child handed back {typename(got)} for the ledger (tampered with?)"
                sent, rs_got, ag_got = got["zero_bytes"], got["reduce_scatter"], got["all_gather"]
                others = got["zero_calls"] - rs_got - ag_got
                assert (rs_got, ag_got, others) == (rs, ag, 0) and sent == theory, \
                    f"{what}: sent {sent:,.0f} B with {rs_got} reduce-scatter(s), {ag_got} all-gather(s)" + \
                    (f" and {others} other call(s)" if others else "") + \
                    f"; theory {theory:,.0f} B with {rs} and {ag} ({len(units)} units, " \
                    f"formulas.collectives_per_step({stage}, {M}) = {formulas.collectives_per_step(stage, M)} each)"


# --- the twin -------------------------------------------------------------------------------------

def twin(M, dtype, batch):
    """The single-process run of these flags (minipar's own code, here): (rows, params)."""
    k = (M, dtype, batch)
    if k not in _twins:
        rows, params, _ = drive.steps(drive.flags(M, dtype, batch))
        _twins[k] = ([r["loss"] for r in rows], [r["grad_norm"] for r in rows], params)
    return _twins[k]


def owner(name, got, want, size, atol) -> str:
    """Which dp rank's shard holds the first bad element of parameter `name`."""
    for names, n in zip(drive.unit_names(), drive.unit_sizes()):
        if name in names:
            sizes = [p.size for nm, p in GPT(drive.CFG).named_parameters() if nm in names]
            offset = int(np.sum(sizes[:names.index(name)]))
            bad = ~np.isclose(got.astype(np.float64), want, rtol=0, atol=atol)
            at = offset + int(np.argmax(bad.ravel()))
            per_rank = zero_units.padded(n, size) // size
            label = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
            return f" (element {at} of unit {label}: in dp rank {at // per_rank}'s shard of {per_rank})"
    return ""


def judge_twin(res):
    """Losses and gradient norms of every step (float64: 1e-12 relative; float32: F32), every
    parameter after the steps at 1e-12 (F32) of its tensor's largest entry, the key biases'
    rounding noise aside (verify.judged), against the single-process twin."""
    for stage, N, M, dtype, batch in drive.TWIN:
        k = drive.run_key("twin", stage, N, M, dtype, batch)
        losses, norms, params = twin(M, dtype, batch)
        f32 = dtype == "float32"
        rtol = F32["loss"] if f32 else 1e-12
        ptol = F32["param"] if f32 else 1e-12
        for w in range(drive.WORLD_SIZE):
            size, _ = drive.group_of(w, N)
            what = drive.where(stage, N, M, dtype, batch, w)
            for name, want in (("loss", losses), ("grad_norm", norms)):
                got = res.get(w, key(k, name))
                assert isinstance(got, list) and len(got) == len(want), \
                    f"{what}: {len(got) if isinstance(got, list) else typename(got)} {name} values, want " \
                    f"{len(want)}, one per step"
                for step, (a, b) in enumerate(zip(got, want)):        # in the order they happen
                    assert isinstance(a, float) and first_difference(a, b, rtol=rtol) is None, \
                        f"{what}: {name} of step {step}: got {a!r}, want {b!r}" + \
                        (f" (relative difference {abs(a - b) / abs(b):.3g})" if isinstance(a, float) else "")
            got_params = res.get(w, key(k, "params"))
            assert isinstance(got_params, dict), f"{what}: the parameters came back as {typename(got_params)}"
            for name, want in params.items():
                got = got_params.get(name)
                if not (isinstance(got, np.ndarray) and got.shape == want.shape and got.dtype == want.dtype):
                    diff = first_difference(got, want)                      # what it is instead
                else:
                    atol = ptol * max(float(np.abs(want).max()), 1e-30)
                    diff = first_difference(judged(name, got), judged(name, want), rtol=0, atol=atol)
                    if diff is not None:
                        diff += owner(name, got, want, size, atol)
                assert diff is None, f"{what}: {name} after {drive.STEPS} steps: {diff}"


# --- the trainer -----------------------------------------------------------------------------

def trainer_judge(ranks):
    """Beyond the twin: the summary's bytes held on every rank equal formulas.formula for the run's
    model (the grader's own), and the ZeRO bytes sent each step formulas.traffic_theory."""
    def judge(run):
        from minipar.train import trainer as train                   # noqa: PLC0415
        from minipar.train.setup import prepare          # noqa: PLC0415
        args = train.build_parser().parse_args(list(run.flags))
        spec = prepare(args, ranks)
        shapes = {n: p.size for n, p in GPT(spec.cfg).named_parameters()}
        units = [sum(shapes[n] for n in u) for u in zero_units.unit_names(list(shapes))]
        N, stage, M = args.dp, args.zero, args.micro_batches
        s = np.dtype(args.dtype).itemsize
        P, P_pad = sum(units), sum(zero_units.padded(n, N) for n in units)
        f = formulas.formula(stage, P, P_pad, N, s, optimizer_bytes_per_param(False, s))
        what = f"--dp {N} --zero {stage} {args.dtype}"
        per_rank = run.summary.get("memory_per_rank")
        assert isinstance(per_rank, list) and len(per_rank) == ranks, \
            f"{what}: the run's summary holds no memory per rank ({typename(per_rank)})"
        for r, row in enumerate(per_rank):
            got = {kind: row.get(kind) if isinstance(row, dict) else None for kind in KINDS}
            want = {kind: f[kind] for kind in KINDS}
            assert got == want, f"{what}: rank {r} holds {got} B after the run, formulas.formula {f['text']} = " \
                                f"{want} (P = {P:,}, padded {P_pad:,})"
        theory = sum(formulas.traffic_theory(stage, zero_units.padded(n, N), N, s, M) for n in units)
        for row in run.rows:
            sent = row.get("zero_bytes")
            shown = f"{sent:,.0f}" if isinstance(sent, (int, float)) else repr(sent)
            assert sent == theory, f"{what}: step {row.get('step')} sent {shown} B on the zero axis, " \
                                   f"formulas.traffic_theory {theory:,.0f} B"
    return judge


TINY = dict(n_embd=24, batch_size=12, micro_batches=2)      # trainer_flags: the float64 model, no padding


def trainer(stage, **change):
    return Criterion(f"trainer --dp 2 --zero {stage}" + (f" {change['dtype']}" if "dtype" in change else ""),
                     ranks=2, trainer=trainer_flags("--dp", "2", "--zero", str(stage), **{**TINY, **change}),
                     judge=trainer_judge(2), timeout=60, uses=("shard_bounds", "reduce_gradient", "update"),
                     hint={1: "the real trainer with your ZeRO-1 on 2 ranks; the grader compares it with one process",
                           2: "the real trainer with your ZeRO-2 on 2 ranks; the grader compares it with one process",
                           3: "stage 3 gathers each block before its forward and again before its backward "
                              "(parallel.zero.stage3.Regather), and releases it after each"}[stage])


CRITERIA = [
    Criterion("shard_bounds for many (n, N)", run="bounds", judge=judge_bounds, timeout=30, uses=("shard_bounds",),
              hint="pad first: minipar.parallel.zero.units.padded(n, N) is the next multiple of N; then every "
                   "rank's shard has the same n_pad / N elements; return two ints"),
    Criterion("memory against formulas.formula", ranks=4, run="memory", judge=judge_memory, timeout=90,
              uses=("shard_bounds", "reduce_gradient", "update", "gather", "release"),
              hint="keep what the contract's table lists, in the parameters' dtype, and set the rest to None "
                   "as soon as you are done: stage 1 param_flat + grad_flat, stage 2 param_flat + grad_shard, "
                   "stage 3 param_shard + grad_shard"),
    Criterion("bytes against formulas.traffic_theory", ranks=4, run="ledger", judge=judge_bytes, timeout=90,
              uses=("shard_bounds", "reduce_gradient", "update", "gather", "release"),
              hint="stage 1 reduce-scatters only when last is True; a reduce-scatter sends (N-1)/N of the "
                   "unit, an all-reduce twice that; stage 3's update gathers nothing; comm.traffic() shows the calls"),
    Criterion("stages 1-3 against one process", ranks=4, run="twin", judge=judge_twin, timeout=120,
              uses=("shard_bounds", "reduce_gradient", "update", "gather", "release"),
              hint="update the shard first, then all-gather it; in stages 2 and 3 add every micro-batch's piece "
                   "into grad_shard (first=True sets it); comm.reduce_scatter hands rank r the piece [lo, hi)"),
    trainer(1),
    trainer(2),
    trainer(3),
    trainer(3, dtype="float32"),
]
