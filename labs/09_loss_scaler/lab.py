"""Lab 09's seam and criteria (labs/framework.py says what a lab is).

Seam: minipar.precision.LossScaler and make_scaler build the student's LossScaler (a subclass
that counts update calls); make_scaler keeps minipar's rule (fp16: dynamic from --loss-scale,
default 2^16; bf16: a fixed scale of 1). The trainer's skip decision, inline in
minipar.train.train_step as `comm.all_reduce(world_group, flag, op="max")` on a one-element
int64 flag, is the only such all-reduce in minipar: comm.all_reduce is wrapped so that that
call becomes student.step_is_skipped(world_group, flag) (every other all-reduce, and the
student's own calls from inside step_is_skipped, go to minipar's).
Oracle: `oracle` below, GradScaler's rule written again in a few lines (not the student's,
not minipar's class); for the skip, the OR of the local flags every rank handed in, gathered
by minipar's own all_gather (the student's code is only behind the one all-reduce).
"""
import contextlib
import io
import json

import numpy as np
from mpi4py import MPI

from labs.framework import Criterion, collective_uses, first_difference
from minipar import comm, precision, train

TITLE = "the dynamic loss scaler and the all-rank skip"
SEAM = {"calls": 0, "inside": False, "flags": [], "scalers": [], "group": None}


def oracle(pattern, scale, growth_interval, growth_factor=2.0, backoff_factor=0.5, dynamic=True, good=0):
    """[(scale, good_steps) after each update] for found_inf flags `pattern` ("FFT..." or
    bools): an inf backs off and restarts the count; the growth_interval-th clean step in a
    row grows and restarts it; a fixed (non-dynamic) scaler never changes."""
    out = []
    for found_inf in pattern:
        if dynamic and found_inf in (True, "T"):
            scale, good = scale * backoff_factor, 0
        elif dynamic:
            good += 1
            if good == growth_interval:
                scale, good = scale * growth_factor, 0
        out.append((scale, good))
    return out


def trajectory(scaler, pattern):
    """(scales, good_steps) of the student's scaler after each update of `pattern`."""
    scales, goods = [], []
    for c in pattern:
        scaler.update(c == "T")
        scales.append(float(scaler.scale))
        goods.append(int(scaler.good_steps))
    return np.array(scales), np.array(goods, dtype=np.int64)


def expect_trajectory(scaler, pattern, want, what):
    """The student's scaler, run over `pattern`, against oracle's `want`: the first update
    where the scale or the clean-step count differs."""
    scales, goods = trajectory(scaler, pattern)
    for name, got, w in (("scale", scales, np.array([s for s, _ in want])),
                         ("good_steps", goods, np.array([g for _, g in want], dtype=np.int64))):
        diff = first_difference(got, w)
        if diff is not None:
            i = int(np.argmax(~np.isclose(got, w, rtol=1e-12, atol=0)))
            raise AssertionError(f"{what}: {name} after each update: {diff} (update {i}, found_inf pattern "
                                 f"{pattern[:i]}[{pattern[i]}]{pattern[i + 1:]})")


# --- the criteria ---------------------------------------------------------------------------

def check_static(student):
    """The student's file references no MPI collective (the scan minipar's own code passes)."""
    found = collective_uses(student)
    assert not found, "uses MPI's own collectives: " + "; ".join(found[:3])


RULE_CASES = [  # (name, LossScaler keyword arguments, found_inf pattern)
    ("minipar's test", dict(scale=8.0, growth_interval=3), "FFFFTFFF"),
    ("an inf in the middle of a count", dict(scale=2.0 ** 16, growth_interval=4), "FFFTFFFFFFFFTTFFF"),
    ("growth_interval 1", dict(scale=1.0, growth_interval=1), "FFTFTTFFF"),
    ("factors 4 and 1/4", dict(scale=2.0 ** 10, growth_factor=4.0, backoff_factor=0.25, growth_interval=2),
     "FFFTFFTTFFFFF"),
    ("backing off below 1", dict(scale=4.0, growth_interval=5), "TTTTTTFFFFFFFFFFT"),
    ("the default interval, 2000", dict(scale=2.0 ** 16), "F" * 1999 + "FTF" + "F" * 1998 + "FF"),
]


def check_rule(student):
    s = student.LossScaler()
    defaults = dict(scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, good_steps=0,
                    dynamic=True)
    for name, want in defaults.items():
        assert hasattr(s, name), f"LossScaler() has no attribute {name!r} (minipar's trainer and report read it)"
        assert getattr(s, name) == want, f"LossScaler().{name} = {getattr(s, name)!r}, want {want!r}"
    given = dict(scale=8.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=3, dynamic=False)
    s = student.LossScaler(**given)
    for name, want in given.items():
        assert getattr(s, name) == want, f"LossScaler(**{given}).{name} = {getattr(s, name)!r}, want {want!r}"
    rng = np.random.default_rng(9)
    cases = RULE_CASES + [("200 random steps, 1 in 5 an inf", dict(scale=2.0 ** 16, growth_interval=3),
                           "".join(rng.choice(["T", "F"], p=[0.2, 0.8], size=200)))]
    for name, kw, pattern in cases:
        want = oracle(pattern, kw["scale"], kw.get("growth_interval", 2000), kw.get("growth_factor", 2.0),
                      kw.get("backoff_factor", 0.5))
        expect_trajectory(student.LossScaler(**kw), pattern, want, f"case {name!r}, LossScaler(**{kw})")


def check_fixed(student):
    """dynamic=False never changes the scale nor counts; the trainer still skips the step."""
    for kw in (dict(scale=1.0, dynamic=False), dict(scale=1024.0, growth_interval=1, dynamic=False)):
        pattern = "TTFFFFTFT"
        want = oracle(pattern, kw["scale"], kw.get("growth_interval", 2000), dynamic=False)
        expect_trajectory(student.LossScaler(**kw), pattern, want, f"LossScaler(**{kw})")
    # bf16 in the trainer, one process: a NaN planted in one gradient skips the step
    install(student)
    args = train.build_parser().parse_args(["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size",
                                            "16", "--batch-size", "4", "--steps", "2", "--sample", "0",
                                            "--precision", "bf16"])
    spec = train.prepare(args, 1)
    model, opt = train.init_model(spec, args)
    assert SEAM["scalers"] and opt.scaler is SEAM["scalers"][0], "the optimizer did not get the student's scaler"
    poison = [True]
    model.params["h.0.mlp.c_fc.weight"].register_grad_hook(
        lambda p: p.grad.flat.__setitem__(0, np.nan) if poison[0] else None)
    sampler = train.data.Sampler(spec.tokens, spec.cfg.block_size, args.batch_size, args.seed)
    s = train.Session(args, model, opt, sampler, world_group=comm.Group(MPI.COMM_SELF))
    what = "bf16 trainer step, one process, a NaN planted in h.0.mlp.c_fc.weight's gradient"
    for step, planted in ((0, True), (1, False)):
        poison[0] = planted
        with train.quiet_overflow(True):
            row = train.train_step(s, step)
        case = what if planted else "the next bf16 step, no inf planted"
        assert row["skipped"] == planted, f"{case}: skipped={row['skipped']}, want {planted}"
        assert float(opt.scaler.scale) == 1.0 and opt.scaler.good_steps == 0, \
            f"step {step} (found_inf={planted}): scale {opt.scaler.scale!r}, good_steps {opt.scaler.good_steps!r}; " \
            "a fixed scaler stays at 1.0 and 0"
    assert opt.step_count == 1, f"{what}: {opt.step_count} optimizer steps in 2 (1 skipped), want 1"


def check_state_dict(student):
    """Stop anywhere, save (through JSON, as a checkpoint's meta.json), load into a fresh
    LossScaler(), and go on: the same scales as never stopping."""
    kw, pattern = dict(scale=2.0 ** 20, growth_interval=3), "FTFFFFTFFFFFFF"
    for cut in range(len(pattern) + 1):
        a = student.LossScaler(**kw)
        trajectory(a, pattern[:cut])
        try:
            state = json.loads(json.dumps(a.state_dict()))
        except TypeError as e:
            raise AssertionError(f"state_dict() is not JSON (a checkpoint's meta.json holds it): {e}") from None
        b = student.LossScaler()
        b.load_state_dict(state)
        before = oracle(pattern[:cut], kw["scale"], 3)
        scale0, good0 = before[-1] if before else (kw["scale"], 0)
        want = oracle(pattern[cut:], scale0, 3, good=good0)
        expect_trajectory(b, pattern[cut:], want,
                          f"LossScaler(**{kw}) after {pattern[:cut]!r}, state_dict() {state} loaded into "
                          f"LossScaler(), then {pattern[cut:]!r}")
    fixed = student.LossScaler()
    fixed.load_state_dict(json.loads(json.dumps(student.LossScaler(scale=1.0, dynamic=False).state_dict())))
    expect_trajectory(fixed, "TFT", oracle("TFT", 1.0, 2000, dynamic=False),
                      "LossScaler() loaded from LossScaler(scale=1.0, dynamic=False).state_dict()")
    # minipar's checkpoint format: the same keys both ways
    a = student.LossScaler(**kw)
    trajectory(a, "FF")
    want = {"scale": kw["scale"], "good_steps": 2, "growth_interval": 3, "dynamic": True}
    got = a.state_dict()
    missing = sorted(set(want) - set(got))
    assert not missing, f"state_dict() {got} lacks {missing}: minipar's checkpoints hold {sorted(want)}"
    bad = {k: got[k] for k in want if got[k] != want[k]}
    assert not bad, f"LossScaler(**{kw}) after 'FF': state_dict() has {bad}, want {want}"
    theirs = precision.LossScaler(scale=2.0 ** 5, growth_interval=3, good_steps=2).state_dict()
    b = student.LossScaler()
    b.load_state_dict(theirs)
    expect_trajectory(b, "FFFFT", oracle("FFFFT", 2.0 ** 5, 3, good=2),
                      f"LossScaler() loaded from minipar's state_dict {theirs}")


def groups():
    """(p, Group or None) for p = 1..4 of the world's ranks 0..p-1; the others sit it out."""
    world = MPI.COMM_WORLD
    yield 1, comm.Group(MPI.COMM_SELF) if world.Get_rank() == 0 else None
    for p in range(2, world.Get_size() + 1):
        sub = world.Split(0 if world.Get_rank() < p else MPI.UNDEFINED, world.Get_rank())
        yield p, (comm.Group(sub) if sub != MPI.COMM_NULL else None)


def check_agree(student):
    for p, g in groups():
        if g is None:
            continue
        plantings = [()] + [(r,) for r in range(p)] + [tuple(sorted({0, p - 1})), tuple(range(p))]
        for planted in dict.fromkeys(plantings):
            for kind in (bool, np.bool_):
                mine = kind(g.rank in planted)
                got = student.step_is_skipped(g, mine)
                what = (f"group of p={p} (world ranks 0..{p - 1}), inf planted on rank(s) {list(planted)}, "
                        f"local_found_inf a {kind.__name__}: rank {g.rank}")
                assert isinstance(got, (bool, np.bool_)), f"{what} got {got!r}, a {type(got).__name__}, not a bool"
                assert got == bool(planted), f"{what} got {got}, want {bool(planted)} " \
                                             f"({'any rank' if planted else 'no rank'} found an inf)"


TRAINER_STEPS, TRAINER_GROWTH, TRAINER_SCALE = 50, 4, 1e15     # 1e15 / 2^33 ~ 1e5 fits fp16
TRAINER = ["--dp", "2", "--tp", "2", "--precision", "fp16", "--loss-scale", "1e15", "--n-layer", "1",
           "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
           "--steps", str(TRAINER_STEPS), "--sample", "0", "--verify"]


def check_trainer(student):
    """The trainer with the student's scaler (growth_interval 4, so the run grows too) and
    skip: the skips are the OR of every rank's flag, each step's loss_scale (the log rows),
    the final scale and the summary's counts are the oracle's."""
    install(student, growth_interval=TRAINER_GROWTH)
    rows, step_fn = [], train.train_step

    def recorded(s, step):
        row = step_fn(s, step)
        if s.world_group is not None:                   # not the --verify twin's steps
            rows.append(row)
        return row

    train.train_step = recorded
    with contextlib.redirect_stdout(io.StringIO()):
        summary = train.run(train.build_parser().parse_args(TRAINER))
    what = f"--dp 2 --tp 2 fp16 --loss-scale 1e15 (growth_interval {TRAINER_GROWTH})"
    flags = SEAM["flags"]
    assert len(flags) == len(rows) == TRAINER_STEPS, \
        f"{what}: step_is_skipped ran {len(flags)} times in {len(rows)} steps, want once a step"
    # every rank's own flags, gathered by minipar's all_gather on the trainer's world group (it
    # polls politely while rank 0 runs the --verify twin; MPI's own Allgather would spin)
    local = np.array([f[0] for f in flags], dtype=np.int64)
    every = comm.all_gather(SEAM["group"], local).reshape(-1, local.size)
    want_skip = every.any(axis=0)
    got_skip = np.array([bool(r["skipped"]) for r in rows])
    bad = np.nonzero(got_skip != want_skip)[0]
    assert not bad.size, f"{what}: step {bad[0]} skipped={got_skip[bad[0]]}, but the ranks' own flags were " \
                         f"{every[:, bad[0]].tolist()}"
    pattern = "".join("T" if x else "F" for x in got_skip)
    assert pattern[0] == "T" and "F" in pattern, \
        f"{what}: skips {pattern}: 1e15 must overflow at first, and a backed-off scale must fit"
    want = oracle(pattern, TRAINER_SCALE, TRAINER_GROWTH)
    used = np.array([float(r["loss_scale"]) for r in rows])
    diff = first_difference(used, np.array([TRAINER_SCALE] + [sc for sc, _ in want[:-1]]))
    assert diff is None, f"{what}: the loss_scale of each step (log rows; skips {pattern}): {diff}"
    sc = SEAM["scalers"][0]
    final = (float(sc.scale), int(sc.good_steps))
    assert final == want[-1], f"{what}: after the run scale {final[0]!r}, good_steps {final[1]}, want {want[-1]}"
    p = summary["precision"]
    got = (p["skipped_steps"], p["optimizer_steps"], float(p["loss_scale_final"]))
    n = pattern.count("T")
    expected = (n, TRAINER_STEPS - n, want[-1][0])
    assert got == expected, f"{what}: the summary's skipped_steps, optimizer_steps, loss_scale_final = {got}, " \
                            f"want {expected}"
    if "verify" in summary:                             # rank 0
        assert summary["verify"]["ok"], f"{what}: --verify failed: {summary['verify']}"


def install(student, growth_interval=None):
    """precision.LossScaler and make_scaler build the student's scaler; the trainer's max
    all-reduce of its skip flag runs student.step_is_skipped. -> calls of either, here."""
    base = student.LossScaler

    class Counted(base):
        def update(self, found_inf):
            SEAM["calls"] += 1
            return base.update(self, found_inf)

    extra = {} if growth_interval is None else {"growth_interval": growth_interval}

    def make_scaler(mode, init_scale=None):             # minipar's rule, the student's class
        if mode == "fp16":
            scaler = Counted(scale=2.0 ** 16 if init_scale is None else float(init_scale), **extra)
        else:
            scaler = Counted(scale=1.0, dynamic=False)
        SEAM["scalers"].append(scaler)
        return scaler

    all_reduce = comm.all_reduce                        # minipar's own

    def seam_all_reduce(g, x, op="sum", *, out=None):
        flag = isinstance(x, np.ndarray) and op == "max" and x.dtype == np.int64 and x.size == 1
        if SEAM["inside"] or not flag:
            return all_reduce(g, x, op, out=out)
        SEAM["inside"] = True                           # the student may call comm.all_reduce
        try:
            local = bool(x.flat[0])
            skip = bool(student.step_is_skipped(g, local))
        finally:
            SEAM["inside"] = False
        SEAM["calls"] += 1
        SEAM["flags"].append((local, skip))
        SEAM["group"] = g
        y = np.array([int(skip)], dtype=np.int64)
        if out is None:
            return y
        out[...] = y
        return out

    precision.LossScaler, precision.make_scaler, comm.all_reduce = Counted, make_scaler, seam_all_reduce
    return lambda: SEAM["calls"]


CRITERIA = [
    Criterion("no MPI collective", check=check_static, timeout=30,
              hint="agree through minipar.comm.all_reduce (op=\"max\") or comm.all_gather, or by "
                   "sending and receiving; never through MPI's own allreduce"),
    Criterion("the scaler rule against the oracle", check=check_rule, timeout=30,
              hint="minipar.precision.LossScaler's docstring: an inf backs off and restarts the count; "
                   "the growth_interval-th clean step in a row grows and restarts it"),
    Criterion("fixed scale (bf16) never moves", check=check_fixed, timeout=30,
              hint="dynamic=False: update changes nothing, not even good_steps; the skip is "
                   "minipar.train.train_step's, whatever the scaler says"),
    Criterion("state_dict round trip", check=check_state_dict, timeout=30,
              hint="everything update reads and writes goes in the dict: scale, good_steps, "
                   "growth_interval, dynamic (minipar.checkpoint writes it into meta.json)"),
    Criterion("every rank agrees on a skip", ranks=4, check=check_agree, timeout=30,
              hint="a max over the group of each rank's 0/1 flag: minipar.comm.all_reduce(g, flag, op=\"max\")"),
    Criterion("trainer --dp 2 --tp 2 fp16 backoff", ranks=4, check=check_trainer, timeout=60,
              hint="the scale is a Python float, as --loss-scale gives it; minipar.train.train_step logs "
                   "the scale each step used before update()"),
]
