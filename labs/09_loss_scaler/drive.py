"""Lab 09, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's LossScaler and step_is_skipped, and the seam. Nothing here judges; lab.py
does, in the grader, with its own few-line oracle of GradScaler's rule.

Cases: found_inf patterns ("FFT..."), each with the keyword arguments of LossScaler, run one
update at a time; after each update the child records the scale and good_steps (as numbers,
and their types' names). The bf16 step runs minipar's trainer in this process with a NaN
planted in one gradient. step_is_skipped runs on groups of p = 1..4 ranks cut from 4, with
an inf planted on each rank in turn. Every pattern is written here or drawn from a fixed
seed, so the grader rebuilds it without being told.
"""
import json

import numpy as np
from mpi4py import MPI

from labs.results import key
from minipar import comm
from minipar.optim import mixed_precision

# minipar's own scaler: reached from the student's file, each of these raises (labs/child.py)
OWN = [f"minipar.optim.mixed_precision:LossScaler.{m}" for m in ("__init__", "update", "state_dict", "load_state_dict")] + \
      ["minipar.optim.mixed_precision:make_scaler"]
MINIPAR_SCALER = mixed_precision.LossScaler               # before any seam: minipar's own class
ATTRIBUTES = ("scale", "growth_factor", "backoff_factor", "growth_interval", "good_steps", "dynamic")
GIVEN = dict(scale=1e15, growth_factor=3.0, backoff_factor=0.25, growth_interval=3, dynamic=False)


def random_pattern(seed: int, n: int, p_inf: float) -> str:
    rng = np.random.default_rng(seed)
    return "".join(rng.choice(["T", "F"], p=[p_inf, 1 - p_inf], size=n))


RULE_CASES = [  # (name, LossScaler keyword arguments, found_inf pattern)
    ("minipar's test", dict(scale=8.0, growth_interval=3), "FFFFTFFF"),
    ("an inf in the middle of a count", dict(scale=2.0 ** 16, growth_interval=4), "FFFTFFFFFFFFTTFFF"),
    ("growth_interval 1", dict(scale=1.0, growth_interval=1), "FFTFTTFFF"),
    ("factors 4 and 1/4", dict(scale=2.0 ** 10, growth_factor=4.0, backoff_factor=0.25, growth_interval=2),
     "FFFTFFTTFFFFF"),
    ("backing off below 1", dict(scale=4.0, growth_interval=5), "TTTTTTFFFFFFFFFFT"),
    ("the default interval, 2000", dict(scale=2.0 ** 16), "F" * 1999 + "FTF" + "F" * 1998 + "FF"),
    ("200 random steps, 1 in 5 an inf", dict(scale=2.0 ** 16, growth_interval=3), random_pattern(9, 200, 0.2)),
    # factors that are not each other's reciprocal: growing by 1/backoff or backing off by
    # 1/growth shows here, not with 2 and 1/2
    ("growth 3, backoff 1/4", dict(scale=2.0 ** 10, growth_factor=3.0, backoff_factor=0.25, growth_interval=2),
     "FFFFTFFTTFFFFFFT"),
    ("growth 1.5, backoff 0.6, from 1000", dict(scale=1000.0, growth_factor=1.5, backoff_factor=0.6,
                                                 growth_interval=3), "FFFTFFFFFFTTFFFFFFT"),
    ("growth 2.5, backoff 0.5", dict(scale=8.0, growth_factor=2.5, growth_interval=2), "FFFFTFFFT"),
    # the growth_interval-th clean step exactly, then an inf exactly where it would grow
    ("growth_interval exactly hit, and an inf on the step that would grow",
     dict(scale=64.0, growth_interval=3), "FFFFFFFFTFFTFFFTFFF"),
    # a scale that is not a power of two: the products of the factors, in a Python float
    ("--loss-scale 1e15", dict(scale=1e15, growth_interval=2), "TTTFFFFTFFTTTTFFFF"),
    # far below any floor (fp16's smallest subnormal is 2^-24), and back up
    ("backing off to 2^-120 and growing back", dict(scale=1.0, growth_interval=2), "T" * 120 + "FFFFFF"),
]
FIXED_CASES = [  # dynamic=False: nothing moves
    (dict(scale=1.0, dynamic=False), "TTFFFFTFT"),
    (dict(scale=1024.0, growth_interval=1, dynamic=False), "TTFFFFTFT"),
    (dict(scale=3.0, growth_factor=3.0, backoff_factor=0.25, growth_interval=1, dynamic=False), "FTFTTFFF"),
]
STATE_KW, STATE_PATTERN = dict(scale=2.0 ** 20, growth_interval=3), "FTFFFFTFFFFFFF"
KEYS_KW = dict(scale=1000.0, growth_factor=1.5, backoff_factor=0.6, growth_interval=3)
FACTORS = dict(growth_factor=3.0, backoff_factor=0.25)     # a fresh scaler with these loads a state
MINIPAR_STATE_KW = dict(scale=2.0 ** 5, growth_interval=3, good_steps=2)
BF16_FLAGS = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
              "--steps", "2", "--sample", "0", "--precision", "bf16"]
NAN_IN = "h.0.mlp.c_fc.weight"
KINDS = {"bool": bool, "np.bool_": np.bool_}              # local_found_inf's types


def minipar_state() -> dict:
    """A state_dict of minipar's own scaler (what its checkpoints hold), in this process."""
    return MINIPAR_SCALER(**MINIPAR_STATE_KW).state_dict()


def plantings(p: int) -> list:
    """The ranks an inf is planted on, for a group of p: none, each in turn, first and last, all."""
    return list(dict.fromkeys([()] + [(r,) for r in range(p)] + [tuple(sorted({0, p - 1})), tuple(range(p))]))


# --- measuring ----------------------------------------------------------------------------------

def type_name(x) -> str:
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def run_pattern(out, k: str, scaler, pattern: str):
    """Update `scaler` once per flag of `pattern`; record the scale and good_steps after each
    (as float64 / int64 arrays) and the names of the types they had."""
    scales, goods, types = [], [], set()
    for c in pattern:
        scaler.update(c == "T")
        s, g = scaler.scale, scaler.good_steps
        types.add(("scale", type_name(s)))
        types.add(("good_steps", type_name(g)))
        scales.append(float(s))
        goods.append(int(g))
    out.put(key(k, "scale"), np.array(scales, dtype=np.float64))
    out.put(key(k, "good_steps"), np.array(goods, dtype=np.int64))
    out.put(key(k, "types"), sorted(f"{a}: {b}" for a, b in types))


def record_attributes(out, k: str, scaler):
    for name in ATTRIBUTES:
        out.put(key(k, "has", name), hasattr(scaler, name))
        if hasattr(scaler, name):
            out.put(key(k, "attr", name), getattr(scaler, name))


def record_state(out, k: str, state):
    """state_dict() as returned, and whether json.dumps takes it (minipar's checkpoint writes it
    into meta.json); -> the state as it comes back from JSON (None if it does not)."""
    out.put(key(k, "state"), state)
    try:
        back = json.loads(json.dumps(state))
    except (TypeError, ValueError) as e:
        out.put(key(k, "json"), f"{type(e).__name__}: {e}")
        return None
    out.put(key(k, "json"), "")
    return back


# --- what the child runs ----------------------------------------------------------------------

def rule(student, out):
    out.case("LossScaler() with no arguments: its attributes")
    record_attributes(out, "default", student.LossScaler())
    out.case(f"LossScaler(**{GIVEN}): its attributes")
    record_attributes(out, "given", student.LossScaler(**GIVEN))
    for i, (name, kw, pattern) in enumerate(RULE_CASES):
        out.case(f"case {name!r}: LossScaler(**{kw}), {len(pattern)} updates")
        run_pattern(out, key("rule", i), student.LossScaler(**kw), pattern)


def fixed(student, out):
    for i, (kw, pattern) in enumerate(FIXED_CASES):
        out.case(f"LossScaler(**{kw}), found_inf {pattern}")
        run_pattern(out, key("fixed", i), student.LossScaler(**kw), pattern)
    # bf16 in the trainer, one process: a NaN planted in one gradient skips the step
    from minipar.train import trainer as train                   # noqa: PLC0415
    out.case("a bf16 trainer step, one process, a NaN planted in one gradient")
    seam = install(student)
    args = train.build_parser().parse_args(BF16_FLAGS)
    spec = train.prepare(args, 1)
    model, opt = train.init_model(spec, args)
    out.put("bf16|scalers built", len(seam.scalers))
    out.put("bf16|the optimizer's is the student's", bool(seam.scalers) and opt.scaler is seam.scalers[0])
    poison = [True]
    model.params[NAN_IN].register_grad_hook(lambda p: p.grad.flat.__setitem__(0, np.nan) if poison[0] else None)
    sampler = train.data.Sampler(spec.tokens, spec.cfg.block_size, args.batch_size, args.seed)
    s = train.Session(args, model, opt, sampler, world_group=comm.Group(MPI.COMM_SELF))
    for step, planted in ((0, True), (1, False)):
        out.case(f"bf16 trainer step {step}, one process, " + (f"a NaN planted in {NAN_IN}'s gradient" if planted
                                                               else "no NaN planted"))
        poison[0] = planted
        with train.quiet_overflow():
            row = train.train_step(s, step)
        out.put(key("bf16", step, "skipped"), row["skipped"])
        out.put(key("bf16", step, "scale"), opt.scaler.scale)
        out.put(key("bf16", step, "good_steps"), opt.scaler.good_steps)
    out.put("bf16|optimizer steps", opt.step_count)
    out.put("bf16|flags", list(seam.flags))


def state_dict(student, out):
    """Stop after every prefix of a pattern, save, load into a fresh LossScaler(), go on."""
    kw, pattern = STATE_KW, STATE_PATTERN
    for cut in range(len(pattern) + 1):
        out.case(f"LossScaler(**{kw}) after {pattern[:cut]!r}: state_dict(), through JSON, into LossScaler()")
        a = student.LossScaler(**kw)
        for c in pattern[:cut]:
            a.update(c == "T")
        state = record_state(out, key("cut", cut), a.state_dict())
        if state is None:
            continue
        b = student.LossScaler()
        b.load_state_dict(state)
        run_pattern(out, key("cut", cut), b, pattern[cut:])
    out.case("LossScaler() loaded from LossScaler(scale=1.0, dynamic=False).state_dict()")
    state = record_state(out, "fixed", student.LossScaler(scale=1.0, dynamic=False).state_dict())
    if state is not None:
        b = student.LossScaler()
        b.load_state_dict(state)
        run_pattern(out, "fixed", b, "TFT")
    out.case(f"LossScaler(**{KEYS_KW}) after 'FFFFT': state_dict()'s keys and values")
    a = student.LossScaler(**KEYS_KW)
    for c in "FFFFT":
        a.update(c == "T")
    record_state(out, "keys", a.state_dict())
    theirs = minipar_state()
    out.case(f"LossScaler() loaded from minipar's own state_dict {theirs}")
    b = student.LossScaler()
    b.load_state_dict(dict(theirs))
    run_pattern(out, "minipar", b, "FFFFT")
    out.case(f"LossScaler(**{FACTORS}) loaded from minipar's own state_dict {theirs}: the factors stay")
    b = student.LossScaler(**FACTORS)
    b.load_state_dict(dict(theirs))
    record_attributes(out, "factors", b)
    run_pattern(out, "factors", b, "FFFFTFFF")


def groups():
    """(p, Group or None) for p = 1..4 of the world's ranks 0..p-1; the others sit it out."""
    world = MPI.COMM_WORLD
    yield 1, comm.Group(MPI.COMM_SELF) if world.Get_rank() == 0 else None
    for p in range(2, world.Get_size() + 1):
        sub = world.Split(0 if world.Get_rank() < p else MPI.UNDEFINED, world.Get_rank())
        yield p, (comm.Group(sub) if sub != MPI.COMM_NULL else None)


def agree(student, out):
    for p, g in groups():
        if g is None:
            continue
        for planted in plantings(p):
            for name, kind in KINDS.items():
                out.case(f"step_is_skipped: group of p={p} (world ranks 0..{p - 1}), inf planted on rank(s) "
                         f"{list(planted)}, local_found_inf a {name}: rank {g.rank}")
                out.put(key("agree", p, planted, name, g.rank),
                        student.step_is_skipped(g, kind(g.rank in planted)))


# --- the seam ---------------------------------------------------------------------------------

class Seam:
    """What install() returns: calling it gives how many times the student's code ran here;
    record(out) hands back each step's (local flag, step_is_skipped's answer) and every
    scaler's (found_inf, scale, good_steps) after each update."""

    def __init__(self):
        self.calls = 0
        self.inside = False
        self.flags: list = []
        self.scalers: list = []
        self.updates: dict = {}

    def __call__(self) -> int:
        return self.calls

    def record(self, out):
        out.put("flags", list(self.flags))
        out.put("scalers built", len(self.scalers))
        for i, sc in enumerate(self.scalers):
            out.put(key("updates", i), self.updates.get(id(sc), []))


def install(student):
    """mixed_precision.LossScaler and make_scaler build the student's scaler (minipar's rule: fp16
    dynamic from --loss-scale, default 2^16, growing after --loss-scale-window clean steps,
    default 2000; bf16 scale=1.0, dynamic=False); the trainer's one
    max all-reduce of its int64 skip flag runs student.step_is_skipped (every other
    all-reduce, and the student's own calls from inside step_is_skipped, are minipar's)."""
    seam = Seam()
    base = student.LossScaler

    class Counted(base):
        def update(self, found_inf):
            seam.calls += 1
            result = base.update(self, found_inf)
            seam.updates.setdefault(id(self), []).append((bool(found_inf), self.scale, self.good_steps))
            return result

    def make_scaler(mode, init_scale=None, growth_interval=None):   # minipar's rule, the student's class
        if mode == "fp16":
            scaler = Counted(scale=2.0 ** 16 if init_scale is None else float(init_scale),
                             growth_interval=2000 if growth_interval is None else int(growth_interval))
        else:
            scaler = Counted(scale=1.0, dynamic=False)
        seam.scalers.append(scaler)
        return scaler

    all_reduce = comm.all_reduce                        # minipar's own

    def seam_all_reduce(g, x, op="sum", *, out=None):
        flag = isinstance(x, np.ndarray) and op == "max" and x.dtype == np.int64 and x.size == 1
        if seam.inside or not flag:
            return all_reduce(g, x, op, out=out)
        seam.inside = True                              # the student may call comm.all_reduce
        try:
            local = bool(x.flat[0])
            skip = bool(student.step_is_skipped(g, local))
        finally:
            seam.inside = False
        seam.calls += 1
        seam.flags.append((local, skip))
        y = np.array([int(skip)], dtype=np.int64)
        if out is None:
            return y
        out[...] = y
        return out

    mixed_precision.LossScaler, mixed_precision.make_scaler, comm.all_reduce = Counted, make_scaler, seam_all_reduce
    return seam
