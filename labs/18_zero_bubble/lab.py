"""Lab 18's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): ops.Linear.backward calls the student's linear_backward with the mask
the autograd asks for (backward_split's B asks for dx only, its W for dW and db only), and
the "zb-h1" entry of schedules.SCHEDULES is the student's zb_h1, which PipelineEngine asks
for its stage's list. So `--pp P --schedule zb-h1` runs both halves of the student's code.

Oracles, all written here in plain NumPy and plain arithmetic, never the student's code nor
minipar's zero-bubble code: the Linear's gradients (dy W^T, x^T dy over every row, dy summed
over every leading dim); a two-layer net's gradients by hand for the autograd case; the
ZB-H1 order (zbh1_order); the makespan of ZB-H1 with unit op times (makespan_theory), from
which the bubble. minipar's simulator (schedules.check) runs the student's recorded lists for
the deadlock check and the simulated bubble.
"""
import math
import os

import numpy as np

from labs.framework import Criterion, first_difference, load_drive, trainer_flags
from labs.results import described, key
from labs.judging import fresh, scale_of, untouched
from labs.pipeline_lists import check_placed
from labs.scan import Allowed
from minipar.show import draw
from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.schedules import (Backward, Forward, RecvActivation, RecvGrad, ScheduleError,
                                                 SendActivation, SendGrad, WeightGrad)

TITLE = "the zero-bubble split: a Linear's backward in B and W, and ZB-H1's order"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
KINDS = drive.KINDS
SMALL = 4                    # up to p = m = SMALL a failure's line also holds the charts
INSTRUCTIONS = {"Forward", "Backward", "WeightGrad", "RecvActivation", "SendActivation", "RecvGrad", "SendGrad"}
ALLOWED = Allowed(
    modules={"minipar.parallel.pipeline.schedules": INSTRUCTIONS | {"ScheduleError", "bubble_theory",
                                                                   "one_f_one_b"},
             "minipar.parallel.pipeline.instructions": INSTRUCTIONS | {"ScheduleError"},
             "minipar.parallel.pipeline.zero_bubble": {"idle_theory", "bubble_from_times"}},
    refused={**{f"minipar.parallel.pipeline.zero_bubble.{n}": why for n, why in (
        ("zb_h1", "minipar's own ZB-H1: this lab grades yours"),
        ("zb_h2", "minipar's own ZB-H2: write ZB-H1 yourself"))},
        **{f"minipar.parallel.pipeline.schedules.{n}": why for n, why in (
            ("schedule", "minipar's schedules by name: this lab grades yours"),
            ("SCHEDULES", "minipar's schedules by name: this lab grades yours"),
            ("check", "minipar's simulator: run it beside your file, not in it"),
            ("programs", "minipar's simulator's lists: build yours yourself"))}})
TIMES = ((1.0, 1.0, 1.0), (1.0, 2.0, 1.0))     # (F, B, W): all equal, and B twice W
F32_TOL = 1e-5
ADDS_INTO = "the autograd adds into what you return"
NEVER_IN_PLACE = ("compute into new arrays, never in place (x.shape = ... or dy *= ... change the caller's "
                  "array; W still needs x and dy after B)")


# --- the Linear's gradients ---------------------------------------------------------------------

def close(got, want, what, dtype):
    """float64: 1e-12 relative and of the largest entry; float32: the dtype, then F32_TOL."""
    tol = 1e-12 if dtype == "float64" else F32_TOL
    if isinstance(got, np.ndarray) and got.dtype != np.dtype(dtype):
        raise AssertionError(f"{what}: dtype {got.dtype}, want {dtype} (the inputs' dtype)")
    diff = first_difference(got, np.asarray(want).astype(dtype), rtol=tol, atol=tol * scale_of(np.asarray(want)))
    assert diff is None, f"{what}: {diff}"


def want_dx(dy, w):
    return np.asarray(dy, dtype=np.float64) @ np.asarray(w, dtype=np.float64).T


def want_dw_db(dy, x):
    """x^T dy summed over every leading index, and dy summed over them: a loop-free einsum over
    the rows flattened."""
    dy64, x64 = np.asarray(dy, dtype=np.float64), np.asarray(x, dtype=np.float64)
    rows = int(np.prod(x64.shape[:-1]))
    xr, dr = x64.reshape(rows, x64.shape[-1]), dy64.reshape(rows, dy64.shape[-1])
    return np.einsum("ni,nj->ij", xr, dr), dr.sum(axis=0) if rows else np.zeros(dy64.shape[-1])


def one_array(res, k, what):
    got = res.get(0, k)
    assert isinstance(got, np.ndarray), f"{what}: returned {described(got)}, not an array"
    return got


def pair(res, k, what):
    got = res.get(0, k)
    assert isinstance(got, (tuple, list)) and len(got) == 2, f"{what}: returned {described(got)}, want (dw, db)"
    for name, part in zip(("dw", "db"), got):
        assert isinstance(part, np.ndarray), f"{what}: {name} is {described(part)}, not an array"
    return got


def judge_grad_input(res):
    """dx = dy W^T for every case: 2-D to 4-D, square and not, one row, no rows, x ~ 1e3,
    float32; dy and w untouched, dx a new array."""
    for i, (label, *_r, dtype) in enumerate(drive.CASES):
        dy, _, w = drive.case_arrays(i)
        what = f"grad_input(dy, w), {label}"
        k = key("gi", i)
        got = one_array(res, k, what)
        untouched(res, k, {"dy": dy, "w": w}, what, NEVER_IN_PLACE)
        fresh(res, k, ["dx"], what, ADDS_INTO)
        close(got, want_dx(dy, w), what + ", dx", dtype)


def judge_grad_weight(res):
    """dW = x^T dy over all rows (every leading dim), db = dy summed over every leading dim, for
    every case (no rows: zeros of the weight's and the bias's shapes); x and dy untouched."""
    for i, (label, *_r, dtype) in enumerate(drive.CASES):
        dy, x, _ = drive.case_arrays(i)
        what = f"grad_weight(dy, x), {label}"
        k = key("gw", i)
        dw, db = pair(res, k, what)
        untouched(res, k, {"dy": dy, "x": x}, what, NEVER_IN_PLACE)
        fresh(res, k, ["dw", "db"], what, ADDS_INTO)
        want_w, want_b = want_dw_db(dy, x)
        if db.shape != want_b.shape:
            raise AssertionError(f"{what}: db has shape {db.shape}, want {want_b.shape}: the bias gets one "
                                 f"number per output channel, dy summed over every leading dim")
        close(dw, want_w, what + ", dw", dtype)
        close(db, want_b, what + ", db", dtype)


def judge_linear_backward(res):
    """For each mask (need_x, need_w, need_b): the parts asked for, equal to the full backward's,
    None for the others; grad_input called once if dx is asked for, grad_weight once if dW or
    db is, never otherwise (B computes no weight gradient, W no input gradient)."""
    for i, (label, *_r, dtype) in enumerate(drive.CASES[:4]):
        for j, needs in enumerate(drive.NEEDS):
            dy, x, w = drive.case_arrays(i)
            what = f"linear_backward(dy, x, w, needs={needs}), {label}"
            k = key("lb", i, j)
            got = res.get(0, k)
            assert isinstance(got, (tuple, list)) and len(got) == 3, \
                f"{what}: returned {described(got)}, want (dx, dw, db)"
            untouched(res, k, {"dy": dy, "x": x, "w": w}, what, NEVER_IN_PLACE)
            fresh(res, k, ["dx", "dw", "db"], what, ADDS_INTO)
            want_w, want_b = want_dw_db(dy, x)
            for name, part, need, want in zip(("dx", "dw", "db"), got, needs, (want_dx(dy, w), want_w, want_b)):
                if not need:
                    assert part is None, (f"{what}: {name} is {described(part)}, want None: it was not asked "
                                          f"for ({'B' if name == 'dx' else 'W'} runs "
                                          f"{'earlier' if name != 'dx' else 'later'} or not at all)")
                    continue
                assert isinstance(part, np.ndarray), f"{what}: {name} is {described(part)}, not an array"
                close(part, want, f"{what}, {name}", dtype)
            calls = res.get(0, key(k, "calls"))
            want_calls = [int(needs[0]), int(needs[1] or needs[2])]
            if calls != want_calls:
                raise AssertionError(f"{what}: called grad_input {calls[0]} and grad_weight {calls[1]} time(s), "
                                     f"want {want_calls[0]} and {want_calls[1]}: compute only what is asked, "
                                     f"each part once (the split saves no work if B also computes W)")


GELU_K, GELU_A = math.sqrt(2.0 / math.pi), 0.044715


def graph_oracle():
    """The autograd case by hand: dx and every parameter's gradient of y = gelu(x w1 + b1) w2 + b2
    with the output gradient g."""
    x, w1, b1, w2, b2, g = drive.graph_arrays()
    h = x @ w1 + b1
    t = np.tanh(GELU_K * (h + GELU_A * h ** 3))
    a = 0.5 * h * (1.0 + t)
    da = g @ w2.T
    dh = da * (0.5 * (1.0 + t) + 0.5 * h * (1.0 - t ** 2) * GELU_K * (1.0 + 3.0 * GELU_A * h ** 2))
    rows = lambda z: z.reshape(-1, z.shape[-1])        # noqa: E731
    return dh @ w1.T, {"w1": rows(x).T @ rows(dh), "b1": rows(dh).sum(0), "w2": rows(a).T @ rows(g),
                       "b2": rows(g).sum(0)}


def judge_autograd(res):
    """minipar's backward_split with the student's linear_backward at the seam: after B the
    input's gradient is there and no parameter has one; after W every parameter's gradient
    equals the hand oracle's; B called grad_input only, W grad_weight only."""
    dx, grads = graph_oracle()
    what = "minipar's autograd with your linear_backward (x -> linear -> gelu -> linear)"
    got = res.get(0, "ag|x_after_b")
    if got is None:
        raise AssertionError(f"{what}: after B the input x has no gradient: B (needs=(True, False, False)) must "
                             f"return dx, which the previous stage waits for")
    close(got, dx, f"{what}: x.grad after B", "float64")
    after_b = res.get(0, "ag|params_after_b")
    touched = [n for n, v in after_b.items() if v is not None] if isinstance(after_b, dict) else ["?"]
    if touched:
        raise AssertionError(f"{what}: after B the parameter(s) {touched} already have a gradient: B computes dx "
                             f"only, dW and db wait for W")
    calls_b, calls_w = res.get(0, "ag|calls_b"), res.get(0, "ag|calls_w")
    if calls_b != [2, 0]:
        raise AssertionError(f"{what}: during B grad_input ran {calls_b[0]} and grad_weight {calls_b[1]} time(s), "
                             f"want 2 and 0 (one dx per Linear, no weight gradient)")
    if calls_w != [0, 2]:
        raise AssertionError(f"{what}: during W grad_input ran {calls_w[0]} and grad_weight {calls_w[1]} time(s), "
                             f"want 0 and 2 (one dW, db per Linear)")
    after_w = res.get(0, "ag|params_after_w")
    for name, want in grads.items():
        g = after_w.get(name) if isinstance(after_w, dict) else None
        if g is None:
            raise AssertionError(f"{what}: after W the parameter {name} has no gradient")
        close(g, want, f"{what}: {name}.grad after W", "float64")


# --- the lists, rebuilt -------------------------------------------------------------------------

class Other:
    """An item that is not one of the seven instructions (or has an odd micro-batch or chunk)."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return self.text

    __str__ = __repr__


def damaged(why: str):
    raise AssertionError(f"the record of zb_h1's lists is not what the child writes ({why}): "
                         f"the code under test tampered with it")


def plain(d) -> str:
    if not isinstance(d, dict) or not isinstance(d.get("type"), str):
        damaged("an odd value is not described")
    return f"{d['value']!r} (a {d['type']})" if "value" in d else f"a {d['type']}"


def recorded(res) -> dict:
    """{(p, m, stage): (problem or None, items, fresh)} from the child's arrays."""
    kinds, mbs, rows, fresh_ = (res.get(0, k) for k in ("kinds", "mbs", "rows", "fresh"))
    odd, containers = res.get(0, "odd"), res.get(0, "containers")
    calls = drive.stage_cases()
    for name, a, dtype, shape in (("kinds", kinds, np.int8, None), ("mbs", mbs, np.int64, None),
                                  ("rows", rows, np.int64, (len(calls), 4)), ("fresh", fresh_, np.bool_, (len(calls),))):
        if not isinstance(a, np.ndarray) or a.dtype != dtype or (shape and a.shape != shape) or \
                (not shape and a.ndim != 1):
            damaged(f"{name} is {type(a).__name__}")
    if mbs.shape != kinds.shape or not isinstance(odd, dict) or not isinstance(containers, dict):
        damaged("the items' arrays or side tables do not match")
    if kinds.size and (kinds.min() < 0 or kinds.max() > drive.OTHER):
        damaged("an item's kind is out of range")
    kl, ml = kinds.tolist(), mbs.tolist()
    out = {}
    for row, ((p, m, s), (start, n, length, code), again) in enumerate(zip(calls, rows.tolist(), fresh_.tolist())):
        if not (0 <= start and 0 <= n <= drive.items_kept(m) and start + n <= len(kl) and code in (0, 1)):
            damaged(f"row {row}")
        what = drive.describe_call(p, m, s)
        if code == 1:
            out[(p, m, s)] = (f"{what} returned {plain(containers.get(str(row)))}, not a list "
                              f"(PipelineEngine walks the list twice)", [], True)
            continue
        if length > n:
            out[(p, m, s)] = (f"{what} returned {length} items; a stage of m = {m} micro-batches holds at most "
                              f"7m = {7 * m} (each micro-batch's F, B, W and four messages)", [], True)
            continue
        items = []
        for i in range(start, start + n):
            if kl[i] == drive.OTHER:
                d = odd.get(str(i))
                if not isinstance(d, dict):
                    items.append(Other("<an odd item: not kept>"))
                elif "item" in d:
                    items.append(Other(plain(d["item"])))
                else:
                    kind = d.get("kind")
                    name = KINDS[kind].__name__ if isinstance(kind, int) and 0 <= kind < len(KINDS) else "?"
                    items.append(Other(f"{name} with micro-batch {plain(d.get('mb'))} and chunk "
                                       f"{plain(d.get('chunk'))}"))
            else:
                items.append(KINDS[kl[i]](ml[i]))
        out[(p, m, s)] = (None, items, bool(again))
    return out


class Recorded:
    """A schedule function for schedules.check that returns the recorded lists."""
    __name__ = "zb_h1"

    def __init__(self, table):
        self.table = table

    def __call__(self, s, p, m):
        problem, items, _ = self.table[(p, m, s)]
        if problem:
            raise AssertionError(problem)
        return list(items)


def show(prog, limit: int = 48) -> str:
    text = " ".join(map(str, prog[:limit]))
    return text + (f" ... ({len(prog)} in all)" if len(prog) > limit else "")


def chart(fn, p, m, f=1.0, b=1.0, w=1.0) -> str:
    if p > SMALL or m > SMALL:
        return ""
    try:
        r = schedules.check(p, m, fn, forward_time=f, backward_time=b + w, weight_time=w)
    except (ScheduleError, AssertionError):
        return ""
    return " ".join(f"[{row}]" for row in draw.ascii_gantt(r.timeline, p).splitlines())


# --- well-formed lists --------------------------------------------------------------------------

def no_such_stage(kind, s) -> str:
    return f"stage {s} has no {'previous' if kind in (RecvActivation, SendGrad) else 'next'} stage"


ORDER = [(RecvActivation, Forward, "a forward needs its input received first"),
         (Forward, SendActivation, "an output is sent after the forward that computes it"),
         (Forward, Backward, "B follows its forward"),
         (RecvGrad, Backward, "B needs its output's gradient received first"),
         (Backward, SendGrad, "the input's gradient is sent after the B that computes it"),
         (Backward, WeightGrad, "W uses the output gradient that B received: W comes after its B")]
BESIDE = {RecvActivation: (Forward, +1, "a Recv comes right before the op that needs it"),
          RecvGrad: (Backward, +1, "a Recv comes right before the op that needs it"),
          SendActivation: (Forward, -1, "a Send comes right after the op that made it"),
          SendGrad: (Backward, -1, "B's gradient is sent right after B: the previous stage waits for it, "
                                   "not for this stage's W")}


def well_formed(entry, p, m, s):
    problem, prog, is_fresh = entry
    what = drive.describe_call(p, m, s)
    if problem:
        raise AssertionError(problem)
    if not is_fresh:
        raise AssertionError(f"{what} returned the very list it returned for the same arguments before: "
                             f"return a new list on every call")
    context = f"; the list: {show(prog)}"
    at = {}
    for k, ins in enumerate(prog):
        if type(ins) not in KINDS:
            raise AssertionError(f"{what}: item {k} is {ins!r}, not one of Forward, Backward, WeightGrad, "
                                 f"RecvActivation, SendActivation, RecvGrad, SendGrad with an int micro-batch "
                                 f"in 0..{m - 1} and chunk 0{context}")
        if not 0 <= ins.mb < m:
            raise AssertionError(f"{what}: item {k} is {ins}: micro-batch {ins.mb} is not in 0..{m - 1}{context}")
        at.setdefault((type(ins), ins.mb), []).append(k)
    check_placed(prog, at, KINDS, ORDER, BESIDE, m, s, p, what, context, not_here=no_such_stage,
                 missing=lambda kind, s: ": every micro-batch's W must run once, or its weights get no "
                                         "gradient" if kind is WeightGrad else "")


def judge_well_formed(res):
    """Each stage's list on its own: a new list of the seven instructions, each micro-batch's
    F, B and W once and exactly the messages the stage needs, W after its B, each message right
    beside its op (SendGrad right after B)."""
    table = recorded(res)
    for p, m, s in drive.stage_cases():
        well_formed(table[(p, m, s)], p, m, s)


# --- the simulator ------------------------------------------------------------------------------

def judge_no_deadlock(res):
    """Every stage's list run together by schedules.check (sends eager, as the executor's): no
    stage waits forever, every receive gets the micro-batch it names, every W after its B."""
    table = recorded(res)
    run = Recorded(table)
    for p, m in drive.cases():
        try:
            schedules.check(p, m, run)
        except ScheduleError as e:
            lists = "; ".join(f"stage {s}: {show(run(s, p, m), 30)}" for s in range(p)) if p <= SMALL else ""
            raise AssertionError(f"zb_h1 p={p} m={m} ({'m < p' if m < p else 'm >= p'}): {e}"
                                 + (f"; your lists: {lists}" if lists else "")) from None


def in_flight(prog) -> tuple:
    """(most micro-batches between F and W, most between F and B, the item of each)."""
    to_w = to_b = peak_w = peak_b = 0
    at_w = at_b = None
    for k, ins in enumerate(prog):
        if isinstance(ins, Forward):
            to_w, to_b = to_w + 1, to_b + 1
            if to_w > peak_w:
                peak_w, at_w = to_w, k
            if to_b > peak_b:
                peak_b, at_b = to_b, k
        elif isinstance(ins, Backward):
            to_b -= 1
        elif isinstance(ins, WeightGrad):
            to_w -= 1
    return peak_w, at_w, peak_b, at_b


def judge_in_flight(res):
    """Along each stage's list: at most p micro-batches between their F and their W (what W needs
    is kept until then: ZB-H1 keeps 1F1B's peak, p on stage 0), and at most p - s between F and
    B (the B's climb the pipe at 1F1B's pace)."""
    table = recorded(res)
    for p, m, s in drive.stage_cases():
        problem, prog, _ = table[(p, m, s)]
        if problem:
            raise AssertionError(problem)
        peak_w, at_w, peak_b, at_b = in_flight(prog)
        what = drive.describe_call(p, m, s)
        if peak_w > p:
            raise AssertionError(f"{what}: {peak_w} micro-batches between their F and their W at item {at_w} "
                                 f"({prog[at_w]}); ZB-H1 holds at most p = {p} (1F1B's peak): a W left for "
                                 f"later keeps its micro-batch's inputs and gradients; the list: {show(prog)}")
        if peak_b > p - s:
            raise AssertionError(f"{what}: {peak_b} micro-batches forwarded and not yet through B at item {at_b} "
                                 f"({prog[at_b]}); at most p - s = {p - s} on stage {s} (1F1B's warm-up is "
                                 f"p - s - 1 forwards); the list: {show(prog)}")


def makespan_theory(p, m, f, b, w) -> float:
    """ZB-H1's step with op times f, b, w (w <= b), from a stage's point of view: its m(f + b + w)
    of work plus (p-1)(f + b - w) of waiting (Qi et al.'s ZB-H1 bubble: the fill's F and the B's
    climb, less the W's that fill the drain); but never before micro-batch 0 has gone down and
    its B up the whole pipe, p(f + b), after which stage 0 still runs m-1 pairs B, W and the
    last W. With m >= p the first term is the larger; with m < p the second."""
    return max(m * (f + b + w) + (p - 1) * (f + b - w), p * (f + b) + (m - 1) * (b + w) + w)


def bubble_theory(p, m, f, b, w) -> float:
    """idle / (p * makespan), every stage busy m(f + b + w): with f = b = w and m >= p this is
    (p-1)/(3m+p-1), an idle per stage (p-1)F against 1F1B's (p-1)(F+B+W)."""
    return 1.0 - m * (f + b + w) / makespan_theory(p, m, f, b, w)


def judge_bubble(res):
    """The simulated idle fraction (schedules.check's report, F = B = W = 1 and F = W = 1, B = 2)
    equals bubble_theory to 1e-12, m < p included."""
    table = recorded(res)
    run = Recorded(table)
    for p, m in drive.cases():
        for f, b, w in TIMES:
            try:
                r = schedules.check(p, m, run, forward_time=f, backward_time=b + w, weight_time=w)
            except ScheduleError as e:
                raise AssertionError(f"zb_h1 p={p} m={m} does not run in minipar's simulator ({e}): "
                                     f"see 'no deadlock'") from None
            want = bubble_theory(p, m, f, b, w)
            if abs(r.bubble - want) <= 1e-12:
                continue
            picture = chart(run, p, m, f, b, w)
            raise AssertionError(
                f"zb_h1 p={p} m={m}, F={f:g} B={b:g} W={w:g}: simulated bubble {r.bubble:.4f}, theory {want:.4f} "
                f"(difference {r.bubble - want:+.3g}); makespan {r.makespan:g}, theory "
                f"max(m(F+B+W) + (p-1)(F+B-W), p(F+B) + (m-1)(B+W) + W) = {makespan_theory(p, m, f, b, w):g}"
                + (f"; yours: {picture}" if picture else ""))


# --- the order ----------------------------------------------------------------------------------

def zbh1_order(p, m, s) -> list:
    """[(kind, mb, phase)] of stage s under ZB-H1, written from the paper's phases."""
    out = []
    warm = min(p - s - 1, m)
    out += [(Forward, mb, f"warm-up: min(p-s-1, m) = {warm} forwards") for mb in range(warm)]
    held = min(s, m - warm)
    for k in range(held):
        out += [(Forward, warm + k, f"then {held} pairs F, B with their W's held back"),
                (Backward, k, f"then {held} pairs F, B with their W's held back")]
    steady = m - warm - held
    for k in range(steady):
        out += [(Forward, warm + held + k, "then F, B, W while forwards remain"),
                (Backward, held + k, "then F, B, W while forwards remain"),
                (WeightGrad, k, "then F, B, W while forwards remain")]
    for k in range(held + steady, m):
        out += [(Backward, k, "then B, W for the backwards left"), (WeightGrad, k - held, "then B, W")]
    out += [(WeightGrad, k, "last, the W's held back") for k in range(m - held, m)]
    return out


def judge_order(res):
    """On every stage the F, B and W in ZB-H1's order: warm-up, F B pairs with W held back (s of
    them), F B W, B W, the held-back W's."""
    table = recorded(res)
    for p, m, s in drive.stage_cases():
        problem, prog, _ = table[(p, m, s)]
        if problem:
            raise AssertionError(problem)
        what = drive.describe_call(p, m, s)
        ops = [(k, ins) for k, ins in enumerate(prog) if type(ins) in (Forward, Backward, WeightGrad)]
        want = zbh1_order(p, m, s)
        got_line = " ".join(str(ins) for _, ins in ops)
        want_line = " ".join(str(kind(mb)) for kind, mb, _ in want)
        for i, (kind, mb, rule) in enumerate(want):
            if i >= len(ops) or type(ops[i][1]) is not kind or ops[i][1].mb != mb:
                here = f"{ops[i][1]} (item {ops[i][0]})" if i < len(ops) else "missing"
                raise AssertionError(f"{what}: op number {i} is {here}, ZB-H1 wants {kind(mb)} ({rule}); "
                                     f"yours: {got_line}; ZB-H1's: {want_line}")
        if len(ops) > len(want):
            raise AssertionError(f"{what}: {len(ops)} ops, ZB-H1 has 3m = {3 * m}; yours: {got_line}")


FUNCS = ("grad_input", "grad_weight", "linear_backward")
CRITERIA = [
    Criterion("grad_input: B = dy W^T", run="functions", judge=judge_grad_input, timeout=60, uses=FUNCS,
              hint="dx = dy @ w.T works on any leading dims; w is (Cin, Cout), dx has x's shape (..., Cin)"),
    Criterion("grad_weight: W = x^T dy, db", run="functions", judge=judge_grad_weight, timeout=60, uses=FUNCS,
              hint="flatten the leading dims of x and dy to rows (reshape(-1, C), a new view, never x.shape = ...), "
                   "then dW = rows_x.T @ rows_dy and db = rows_dy.sum(0)"),
    Criterion("linear_backward honours needs", run="functions", judge=judge_linear_backward, timeout=60,
              uses=FUNCS,
              hint="call grad_input only if needs[0], grad_weight only if needs[1] or needs[2], and return None "
                   "for each part not asked for (minipar.autograd.backward_split masks needs_input_grad)"),
    Criterion("B then W in minipar's autograd", run="functions", judge=judge_autograd, timeout=60, uses=FUNCS,
              hint="minipar.autograd.backward_split.backward_b asks each Linear for dx only, "
                   "PendingW.run for dW and db only; your linear_backward is minipar.autograd.ops.Linear's backward"),
    Criterion("well-formed lists", run="lists", judge=judge_well_formed, timeout=60, uses=("zb_h1",),
              hint="wrap each Forward in RecvActivation/SendActivation and each Backward in RecvGrad/SendGrad (none "
                   "past the first or the last stage); a WeightGrad(mb) stands alone, after its Backward"),
    Criterion("no deadlock (schedules.check)", run="lists", judge=judge_no_deadlock, timeout=60, uses=("zb_h1",),
              hint="run minipar.parallel.pipeline.schedules.check(p, m, zb_h1) beside your file for the failing "
                   "p and m; with m < p the warm-up is min(p - s - 1, m)"),
    Criterion("in flight: p to W, p - s to B", run="lists", judge=judge_in_flight, timeout=60,
              uses=("zb_h1",),
              hint="stage s holds back only its first s W's; after those, each F, B comes with the oldest W "
                   "(the report of minipar.parallel.pipeline.schedules.check counts them in peak_in_flight, F to W)"),
    Criterion("bubble (p-1)/(3m+p-1)", run="lists", judge=judge_bubble, timeout=60, uses=("zb_h1",),
              hint="the W's fill the drain: a stage that runs each W right after its B waits like 1F1B, "
                   "(p-1)/(m+p-1); minipar.parallel.pipeline.schedules.bubble_theory has the formulas"),
    Criterion("order of F, B and W", run="lists", judge=judge_order, timeout=60, uses=("zb_h1",),
              hint="stage s: min(p-s-1, m) forwards; s pairs F B (W held back); F B W while forwards remain; "
                   "B W; then the held-back W's, oldest first"),
    Criterion("trainer --pp 4 zb-h1", ranks=4, timeout=120,
              trainer=trainer_flags("--pp", "4", "--micro-batches", "4", "--schedule", "zb-h1", n_layer=4),
              uses=("zb_h1", "linear_backward"),
              hint="each rank's minipar.parallel.pipeline.stage.PipelineEngine walks your list; every Backward runs "
                   "B and every WeightGrad W through your linear_backward; the grader compares the run with its "
                   "own single-process twin"),
    Criterion("trainer --pp 3 zb-h1, m < p", ranks=3, timeout=120,
              trainer=trainer_flags("--pp", "3", "--micro-batches", "2", "--schedule", "zb-h1", n_layer=3),
              uses=("zb_h1", "linear_backward"),
              hint="with 2 micro-batches on 3 stages stage 0 runs every forward in its warm-up; the engine "
                   "checks your lists with minipar.parallel.pipeline.schedules.check before it runs them"),
]
