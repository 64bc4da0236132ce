"""Lab 09's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): minipar.optim.mixed_precision.LossScaler and make_scaler build the student's
LossScaler (a subclass that counts and records its updates); make_scaler keeps minipar's
rule (fp16: dynamic from --loss-scale, default 2^16; bf16: a fixed scale of 1). The
trainer's skip decision, inline in minipar.train.trainer.train_step as `comm.all_reduce(world_group,
flag, op="max")` on a one-element int64 flag, is the only such all-reduce in minipar:
comm.all_reduce is wrapped so that that call becomes student.step_is_skipped(world_group,
flag) (every other all-reduce, and the student's own calls from inside step_is_skipped, go
to minipar's).
Oracle: `oracle` below, GradScaler's rule written again in a few lines (not the student's,
not minipar's class); for the skip, the OR of the local flags every rank recorded; for the
trainer, the grader's own single-process twin (labs/twin.py: the losses, at fp16's
tolerance) and, per step, the oracle's scale and the OR of the ranks' flags.
"""
import numbers
import os

import numpy as np

from labs.framework import Criterion, first_difference, load_drive, trainer_flags
from labs.results import key
from labs.scan import ANY, Allowed

TITLE = "the dynamic loss scaler and the all-rank skip"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = Allowed(
    modules={"minipar.comm": ANY, "minipar.optim.mixed_precision": set()},
    refused={"minipar.optim.mixed_precision.LossScaler": "minipar's own loss scaler: this lab grades yours",
             "minipar.optim.mixed_precision.make_scaler": "builds minipar's own loss scaler: this lab grades yours"})
DEFAULTS = dict(scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, good_steps=0,
                dynamic=True)
STATE_KEYS = ("scale", "good_steps", "growth_interval", "dynamic")
# what each attribute and state_dict() value must be (the trainer, its log and meta.json read them)
KINDS = {"scale": (float,), "growth_factor": (float, int), "backoff_factor": (float, int),
         "growth_interval": (int,), "good_steps": (int,), "dynamic": (bool,)}


def oracle(pattern, scale, growth_interval=2000, growth_factor=2.0, backoff_factor=0.5, dynamic=True, good=0):
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


def oracle_of(kw: dict, pattern: str, **state):
    """The oracle for LossScaler(**kw) (then `state` loaded) over `pattern`."""
    args = {**{k: DEFAULTS[k] for k in ("scale", "growth_interval", "growth_factor", "backoff_factor", "dynamic")},
            **{k: v for k, v in kw.items() if k != "good_steps"}, **state}
    return oracle(pattern, args["scale"], args["growth_interval"], args["growth_factor"], args["backoff_factor"],
                  args["dynamic"], args.get("good_steps", kw.get("good_steps", 0)))


def of_kind(v, kinds) -> bool:
    if bool in kinds:
        return type(v) is bool
    if int in kinds and float not in kinds:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, (float, int) if int in kinds else float) and not isinstance(v, bool)


def marked(pattern: str, i: int) -> str:
    return f"{pattern[:i]}[{pattern[i]}]{pattern[i + 1:]}" if len(pattern) <= 80 else \
        f"...{pattern[max(0, i - 30):i]}[{pattern[i]}]{pattern[i + 1:i + 30]}... (update {i} of {len(pattern)})"


def expect_trajectory(res, rank: int, k: str, pattern: str, want: list, what: str):
    """The scale and good_steps the child recorded after each update against the oracle's:
    the first update where either differs, with the pattern marked there; and their types."""
    for name, w, dtype in (("scale", [s for s, _ in want], np.float64), ("good_steps", [g for _, g in want], np.int64)):
        got = res.get(rank, key(k, name))
        w = np.array(w, dtype=dtype)
        diff = first_difference(got, w)
        if diff is None:
            continue
        if isinstance(got, np.ndarray) and got.shape == w.shape and got.size:
            i = int(np.argmax(~np.isclose(got.astype(np.float64), w, rtol=1e-12, atol=0)))
            raise AssertionError(f"{what}: {name} after update {i}: {got[i].item()!r}, want {w[i].item()!r} (found_inf "
                                 f"{marked(pattern, i)}); {diff}")
        raise AssertionError(f"{what}: {name} after each update: {diff}")
    types = res.get(rank, key(k, "types"))
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise AssertionError(f"{what}: the child recorded no types of scale and good_steps")
    bad = [t for t in types if t not in ("scale: float", "scale: numpy.float64", "good_steps: int")]
    assert not bad, f"{what}: after an update {', '.join(bad)}; scale must stay a Python float (exactly what " \
                    f"--loss-scale gave and the factors made of it) and good_steps a Python int"


def expect_attributes(res, k: str, want: dict, what: str):
    for name, w in want.items():
        assert res.get(0, key(k, "has", name)) is True, \
            f"{what} has no attribute {name!r} (minipar's trainer, its report and checkpoints read it)"
        got = res.get(0, key(k, "attr", name))
        assert of_kind(got, KINDS[name]), \
            f"{what}.{name} is {got!r}, a {type(got).__name__}; it must be a Python " \
            f"{' or '.join(t.__name__ for t in KINDS[name])}"
        assert got == w, f"{what}.{name} = {got!r}, want {w!r}"


def judge_rule(res):
    expect_attributes(res, "default", DEFAULTS, "LossScaler()")
    expect_attributes(res, "given", {**drive.GIVEN, "good_steps": 0}, f"LossScaler(**{drive.GIVEN})")
    for i, (name, kw, pattern) in enumerate(drive.RULE_CASES):
        expect_trajectory(res, 0, key("rule", i), pattern, oracle_of(kw, pattern),
                          f"case {name!r}, LossScaler(**{kw})")


def judge_fixed(res):
    for i, (kw, pattern) in enumerate(drive.FIXED_CASES):
        expect_trajectory(res, 0, key("fixed", i), pattern, oracle_of(kw, pattern), f"LossScaler(**{kw})")
    what = f"a bf16 trainer step, one process, a NaN planted in {drive.NAN_IN}'s gradient"
    built = res.get(0, "bf16|scalers built")
    assert built == 1 and res.get(0, "bf16|the optimizer's is the student's") is True, \
        f"{what}: the seam built {built!r} scaler(s) and the optimizer did not get the student's"
    for step, planted in ((0, True), (1, False)):
        case = what if planted else "the next bf16 step, no NaN planted"
        skipped = res.get(0, key("bf16", step, "skipped"))
        assert skipped is planted, f"{case}: the step's log row has skipped={skipped!r}, want {planted}"
        scale, good = res.get(0, key("bf16", step, "scale")), res.get(0, key("bf16", step, "good_steps"))
        assert isinstance(scale, float) and scale == 1.0 and type(good) is int and good == 0, \
            f"{case}: after update({planted}) scale {scale!r}, good_steps {good!r}; a fixed scaler (bf16: " \
            f"scale=1.0, dynamic=False) stays at 1.0 and 0"
    flags = res.get(0, "bf16|flags")
    want = [(True, True), (False, False)]
    assert flags == want, f"{what}: (local flag, step_is_skipped) of the two steps {flags!r}, want {want} " \
                          f"(a group of one rank: its own flag)"
    steps = res.get(0, "bf16|optimizer steps")
    assert steps == 1, f"{what}: {steps!r} optimizer steps in 2 (1 skipped), want 1"


def expect_state(res, k: str, want: dict, what: str):
    """state_dict() as returned: a dict of minipar's four keys, plain Python values equal to
    want's; and json.dumps took it."""
    got = res.get(0, key(k, "state"))
    assert isinstance(got, dict), f"{what}: state_dict() returned {got!r}, a {type(got).__name__}, not a dict"
    missing = [n for n in STATE_KEYS if n not in got]
    assert not missing, f"{what}: state_dict() {got} lacks {missing}: minipar's checkpoints hold {list(STATE_KEYS)}"
    why = res.get(0, key(k, "json"))
    assert why == "", f"{what}: json.dumps(state_dict()) fails ({why}): a checkpoint's meta.json holds it; " \
                      f"state_dict() {got}"
    for n in STATE_KEYS:
        assert of_kind(got[n], KINDS[n]), f"{what}: state_dict()[{n!r}] is {got[n]!r}, a " \
                                          f"{type(got[n]).__name__}, not a Python {KINDS[n][0].__name__}"
    bad = {n: got[n] for n in STATE_KEYS
           if not (got[n] == want[n] or (n == "scale" and np.isclose(got[n], want[n], rtol=1e-12, atol=0)))}
    assert not bad, f"{what}: state_dict() has {bad}, want {({n: want[n] for n in bad})}"


def judge_state_dict(res):
    kw, pattern = drive.STATE_KW, drive.STATE_PATTERN
    for cut in range(len(pattern) + 1):
        what = f"LossScaler(**{kw}) after {pattern[:cut]!r}"
        before = oracle_of(kw, pattern[:cut])
        scale, good = before[-1] if before else (kw["scale"], 0)
        expect_state(res, key("cut", cut), {"scale": scale, "good_steps": good, "growth_interval": 3,
                                            "dynamic": True}, what)
        state = res.get(0, key("cut", cut, "state"))
        expect_trajectory(res, 0, key("cut", cut), pattern[cut:], oracle_of(kw, pattern[cut:], good_steps=good,
                                                                             scale=scale),
                          f"{what}: state_dict() {state} loaded into LossScaler(), then {pattern[cut:]!r}")
    expect_state(res, "fixed", {"scale": 1.0, "good_steps": 0, "growth_interval": 2000, "dynamic": False},
                 "LossScaler(scale=1.0, dynamic=False)")
    expect_trajectory(res, 0, "fixed", "TFT", oracle("TFT", 1.0, dynamic=False),
                      "LossScaler() loaded from LossScaler(scale=1.0, dynamic=False).state_dict()")
    scale, good = oracle_of(drive.KEYS_KW, "FFFFT")[-1]
    expect_state(res, "keys", {"scale": scale, "good_steps": good, "growth_interval": 3, "dynamic": True},
                 f"LossScaler(**{drive.KEYS_KW}) after 'FFFFT'")
    theirs = drive.minipar_state()
    expect_trajectory(res, 0, "minipar", "FFFFT", oracle_of({}, "FFFFT", **theirs),
                      f"LossScaler() loaded from minipar's own state_dict {theirs}")
    what = f"LossScaler(**{drive.FACTORS}) loaded from minipar's own state_dict {theirs} (the factors are not state)"
    expect_attributes(res, "factors", {**drive.FACTORS, **{n: theirs[n] for n in STATE_KEYS}}, what)
    expect_trajectory(res, 0, "factors", "FFFFTFFF", oracle_of(drive.FACTORS, "FFFFTFFF", **theirs), what)


def judge_agree(res):
    for p in range(1, 5):
        for planted in drive.plantings(p):
            for kind in drive.KINDS:
                for r in range(p):
                    what = (f"group of p={p} (world ranks 0..{p - 1}), inf planted on rank(s) {list(planted)}, "
                            f"local_found_inf a {kind}: rank {r}")
                    got = res.get(r, key("agree", p, planted, kind, r))
                    assert isinstance(got, (bool, np.bool_)), \
                        f"{what} got {got!r}, a {type(got).__name__}, not a bool"
                    who = f"rank(s) {list(planted)}" if planted else "no rank"
                    assert bool(got) == bool(planted), f"{what} got {got}, want {bool(planted)} ({who} found an inf)"


TRAINER_STEPS, TRAINER_SCALE, TRAINER_WINDOW = 50, 1e15, 4     # 1e15 / 2^33 ~ 1e5 fits fp16
TRAINER = trainer_flags("--dp", "2", "--tp", "2", "--precision", "fp16", "--loss-scale", "1e15",
                        "--loss-scale-window", str(TRAINER_WINDOW), n_layer=1, n_embd=16, steps=TRAINER_STEPS,
                        dtype=None)
RANKS = 4


def judge_trainer(run):
    """Beyond the twin's losses: every rank's step_is_skipped answered the OR of the four ranks'
    own flags, the log's skipped and loss_scale of every step, every rank's scaler after every
    update and the summary's counts are the oracle's."""
    res = run.results
    what = "--dp 2 --tp 2 fp16 --loss-scale 1e15"
    flags = []
    for r in range(RANKS):
        f = res.get(r, "flags")
        ok = isinstance(f, list) and len(f) == TRAINER_STEPS and all(
            isinstance(x, tuple) and len(x) == 2 and all(type(b) is bool for b in x) for x in f)
        assert ok, f"{what}: rank {r}'s step_is_skipped ran {len(f) if isinstance(f, list) else f!r} times in " \
                   f"{TRAINER_STEPS} steps, want once a step"
        flags.append(f)
    local = np.array([[x[0] for x in f] for f in flags])            # (rank, step)
    want_skip = local.any(axis=0)
    for r in range(RANKS):
        said = np.array([x[1] for x in flags[r]])
        bad = np.nonzero(said != want_skip)[0]
        assert not bad.size, f"{what}: step {bad[0]}: rank {r}'s step_is_skipped returned {bool(said[bad[0]])}, " \
                             f"but the ranks' own flags were {local[:, bad[0]].tolist()}"
    got_skip = np.array([r.get("skipped") is True for r in run.rows])
    bad = np.nonzero(got_skip != want_skip)[0]
    assert not bad.size, f"{what}: step {bad[0]}: the log says skipped={run.rows[bad[0]].get('skipped')!r}, but the " \
                         f"ranks' own flags were {local[:, bad[0]].tolist()}"
    pattern = "".join("T" if x else "F" for x in want_skip)
    assert pattern[0] == "T" and "F" in pattern, \
        f"{what}: skips {pattern}: 1e15 must overflow at first, and a backed-off scale must fit"
    want = oracle(pattern, TRAINER_SCALE, TRAINER_WINDOW)
    used = np.array([float(r["loss_scale"]) if isinstance(r.get("loss_scale"), numbers.Real) else np.nan
                     for r in run.rows])
    diff = first_difference(used, np.array([TRAINER_SCALE] + [sc for sc, _ in want[:-1]]))
    if diff is not None:
        i = int(np.argmax(~np.isclose(used, [TRAINER_SCALE] + [sc for sc, _ in want[:-1]], rtol=1e-12, atol=0)))
        raise AssertionError(f"{what}: the loss_scale of step {i} (log rows; skips {marked(pattern, i)}): {diff}")
    for r in range(RANKS):
        built = res.get(r, "scalers built")
        assert built == 1, f"{what}: rank {r} built {built!r} scalers, want 1"
        updates = res.get(r, key("updates", 0))
        assert isinstance(updates, list) and len(updates) == TRAINER_STEPS, \
            f"{what}: rank {r}'s scaler was updated {len(updates) if isinstance(updates, list) else updates!r} " \
            f"times in {TRAINER_STEPS} steps, want once a step"
        for i, (u, (ws, wg)) in enumerate(zip(updates, want)):
            ok = isinstance(u, tuple) and len(u) == 3 and u[0] is want_skip[i].item() and isinstance(u[1], float) \
                and np.isclose(u[1], ws, rtol=1e-12, atol=0) and type(u[2]) is int and u[2] == wg
            assert ok, f"{what}: rank {r}'s scaler after update {i} (found_inf, scale, good_steps) = {u!r}, " \
                       f"want ({bool(want_skip[i])}, {ws!r}, {wg}) (skips {marked(pattern, i)})"
    prec = run.summary.get("precision") if isinstance(run.summary, dict) else None
    assert isinstance(prec, dict), f"{what}: the run's summary has no precision section"
    got = (prec.get("skipped_steps"), prec.get("optimizer_steps"), prec.get("loss_scale_final"))
    n = pattern.count("T")
    expected = (n, TRAINER_STEPS - n, want[-1][0])
    ok = got[:2] == expected[:2] and isinstance(got[2], numbers.Real) and np.isclose(got[2], expected[2], rtol=1e-12)
    assert ok, f"{what}: the summary's skipped_steps, optimizer_steps, loss_scale_final = {got}, want {expected}"


CRITERIA = [
    Criterion("the scaler rule against the oracle", run="rule", judge=judge_rule, timeout=30, uses=("LossScaler",),
              hint="minipar.optim.mixed_precision.LossScaler's docstring: an inf backs off and restarts the count; "
                   "the growth_interval-th clean step in a row grows and restarts it; keep scale a Python float"),
    Criterion("fixed scale (bf16) never moves", run="fixed", judge=judge_fixed, timeout=30,
              uses=("LossScaler", "step_is_skipped"),
              hint="dynamic=False: update changes nothing, not even good_steps; the skip is "
                   "minipar.train.trainer.train_step's, whatever the scaler says"),
    Criterion("state_dict round trip", run="state_dict", judge=judge_state_dict, timeout=30, uses=("LossScaler",),
              hint="everything update reads and writes goes in the dict: scale, good_steps, "
                   "growth_interval, dynamic (minipar.train.checkpoint writes it into meta.json); the factors are not state"),
    Criterion("every rank agrees on a skip", ranks=4, run="agree", judge=judge_agree, timeout=30,
              uses=("step_is_skipped",),
              hint="a max over the group of each rank's 0/1 flag: minipar.comm.all_reduce(g, flag, op=\"max\")"),
    Criterion("trainer --dp 2 --tp 2 fp16 backoff", ranks=RANKS, trainer=TRAINER, judge=judge_trainer, timeout=90,
              uses=("LossScaler", "step_is_skipped"),
              hint="the scale is a Python float, as --loss-scale gives it; minipar.train.trainer.train_step logs "
                   "the scale each step used before update(); the grader compares the run with one process"),
]
