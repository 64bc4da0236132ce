"""Lab 18, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's grad_input, grad_weight, linear_backward and zb_h1, and the seam. Nothing
here judges; lab.py does, in the grader, against its own plain NumPy and its own formulas.

Every array is drawn from a seed (case_arrays), so the grader rebuilds each input without
being told. For each call the child records what it returned, each input as it is afterwards,
and which inputs a returned array shares memory with. For zb_h1 it records each stage's list
compactly (Table): each item's instruction class by exact type (KINDS, or "other") and its
micro-batch, for p = 1..8 stages and m = 1..12 micro-batches (and a teacher's "n_stages"
and "n_micro"); the grader rebuilds the instructions and runs minipar's simulator on them.
No code of the student's runs here beyond their functions: no repr, no __eq__.
"""
import os

import numpy as np

from labs.framework import extra_cases
from labs.results import key
from minipar.autograd import backward_split, ops
from minipar.autograd.dtypes import compute, store
from minipar.autograd.tensor import Tensor
from minipar.parallel.pipeline import interleaved, schedules, zero_bubble
from minipar.parallel.pipeline.schedules import (Backward, Forward, RecvActivation, RecvGrad, SendActivation,
                                                 SendGrad, WeightGrad)

HERE = os.path.dirname(os.path.abspath(__file__))
TEACHER = extra_cases(HERE)
TEACHER_SEED = int(TEACHER.get("seed", 0))
FUNCTIONS = ("grad_input", "grad_weight", "linear_backward")
# minipar's own zero-bubble orders, its simulator and its Linear backwards: reached from the
# student's file, each raises (labs/child.py). The seam (install) replaces ops.Linear.backward
# by a call to the student's linear_backward.
OWN = ["minipar.parallel.pipeline.zero_bubble:zb_h1", "minipar.parallel.pipeline.zero_bubble:zb_h2",
       "minipar.parallel.pipeline.zero_bubble:_h2_orders", "minipar.parallel.pipeline.zero_bubble:_instructions",
       "minipar.parallel.pipeline.schedules:schedule", "minipar.parallel.pipeline.schedules:check",
       "minipar.parallel.pipeline.schedules:programs", "minipar.parallel.pipeline.check:check",
       "minipar.parallel.pipeline.check:programs", "minipar.parallel.pipeline.interleaved:interleaved",
       "minipar.autograd.ops:Linear.backward", "minipar.autograd.ops:LinearReference.backward",
       "minipar.autograd.ops:MatMul.backward", "minipar.autograd.backward_split:backward_b",
       "minipar.autograd.backward_split:PendingW.run"]


def rng_for(*k):
    """The generator of a case; a teacher's "seed" ($MINIPAR_LAB_EXTRA/18_zero_bubble/cases.json)
    draws other inputs."""
    return np.random.default_rng([18, *k] + ([TEACHER_SEED] if TEACHER_SEED else []))


# --- the functions' cases ---------------------------------------------------------------------
# (label, leading dims of x and dy, Cin, Cout, scale of x, dtype)
CASES = [
    ("2-D x (5, 3), w (3, 4)", (5,), 3, 4, 1.0, "float64"),
    ("3-D x (2, 3, 6), w (6, 4)", (2, 3), 6, 4, 1.0, "float64"),
    ("4-D x (2, 2, 3, 5), w (5, 7)", (2, 2, 3), 5, 7, 1.0, "float64"),
    ("3-D x (2, 4, 6), square w (6, 6)", (2, 4), 6, 6, 1.0, "float64"),
    ("2-D x (1, 8): one row, w (8, 2)", (1,), 8, 2, 1.0, "float64"),
    ("2-D x (0, 4): no rows (an empty piece), w (4, 3)", (0,), 4, 3, 1.0, "float64"),
    ("3-D x (3, 0, 5): no rows in 3-D, w (5, 2)", (3, 0), 5, 2, 1.0, "float64"),
    ("3-D x (3, 5, 16) ~ 1e3, w (16, 48)", (3, 5), 16, 48, 1e3, "float64"),
    ("3-D x (2, 5, 8), w (8, 12), float32", (2, 5), 8, 12, 1.0, "float32"),
]
# linear_backward's masks: (need_x, need_w, need_b), as the autograd asks in one pass, in B, in W
NEEDS = [(True, True, True), (True, False, False), (False, True, True), (False, True, False),
         (False, False, True), (True, True, False), (False, False, False)]


def case_arrays(i: int):
    """(dy, x, w) of CASES[i]: x (..., Cin), w (Cin, Cout), dy (..., Cout)."""
    _, lead, c_in, c_out, scale, dtype = CASES[i]
    r = rng_for(i, c_in, c_out)
    x = scale * r.standard_normal((*lead, c_in))
    w = r.standard_normal((c_in, c_out))
    dy = r.standard_normal((*lead, c_out))
    return dy.astype(dtype), x.astype(dtype), w.astype(dtype)


def call_and_record(out, k, fn, args, inputs: dict):
    """fn(*args): record what it returned, each of `inputs` as it is afterwards (shape too),
    and for each returned array the names of the inputs it shares memory with."""
    got = fn(*args)
    out.put(k, got)
    for name, a in inputs.items():
        out.put(key(k, "after", name), a)
    parts = list(got[:8]) if isinstance(got, (tuple, list)) else [got]
    out.put(key(k, "shares"), [[name for name, a in inputs.items()
                                if isinstance(p, np.ndarray) and np.may_share_memory(p, a)] for p in parts])


# the graph of the autograd case: x (B, T, C) -> linear(w1, b1) -> gelu -> linear(w2, b2) -> y
GRAPH = dict(B=2, T=3, C=4, H=6, O=5)


def graph_arrays():
    """(x, w1, b1, w2, b2, g) of the autograd case, float64."""
    d = GRAPH
    r = rng_for(99)
    return (r.standard_normal((d["B"], d["T"], d["C"])), r.standard_normal((d["C"], d["H"])),
            r.standard_normal(d["H"]), r.standard_normal((d["H"], d["O"])), r.standard_normal(d["O"]),
            r.standard_normal((d["B"], d["T"], d["O"])))


class Counting:
    """Counts the calls of the student's grad_input and grad_weight (the module's names, which
    their linear_backward calls), by phase."""

    def __init__(self, student):
        self.student, self.n = student, {"grad_input": 0, "grad_weight": 0}
        self.originals = {name: getattr(student, name) for name in self.n}
        for name, fn in self.originals.items():
            setattr(student, name, self.wrap(name, fn))

    def wrap(self, name, fn):
        def counted(*args):
            self.n[name] += 1
            return fn(*args)
        return counted

    def take(self) -> list:
        got = [self.n["grad_input"], self.n["grad_weight"]]
        self.n = {"grad_input": 0, "grad_weight": 0}
        return got

    def restore(self):
        for name, fn in self.originals.items():
            setattr(self.student, name, fn)


def functions(student, out):
    """grad_input and grad_weight on every case; linear_backward on every case and mask, with
    how many times it called grad_input and grad_weight; then minipar's autograd with the
    student's linear_backward at the seam: B (backward_split.backward_b) then W (PendingW.run)."""
    for i, (label, *_rest) in enumerate(CASES):         # each function's cases in turn: an error in
        dy, _, w = case_arrays(i)                           # one leaves the ones before it judged
        out.case(f"grad_input(dy, w), {label}")
        call_and_record(out, key("gi", i), student.grad_input, (dy, w), {"dy": dy, "w": w})
    for i, (label, *_rest) in enumerate(CASES):
        dy, x, _ = case_arrays(i)
        out.case(f"grad_weight(dy, x), {label}")
        call_and_record(out, key("gw", i), student.grad_weight, (dy, x), {"dy": dy, "x": x})
    count = Counting(student)
    try:
        for i, (label, *_rest) in enumerate(CASES[:4]):
            for j, needs in enumerate(NEEDS):
                dy, x, w = case_arrays(i)
                out.case(f"linear_backward(dy, x, w, needs={needs}), {label}")
                call_and_record(out, key("lb", i, j), student.linear_backward, (dy, x, w, needs),
                                {"dy": dy, "x": x, "w": w})
                out.put(key("lb", i, j, "calls"), count.take())
    finally:
        count.restore()
    autograd_split(student, out)


def autograd_split(student, out):
    """x -> linear -> gelu -> linear, B then W through minipar's backward_split with the
    student's linear_backward at the seam: x.grad after B, every parameter's .grad after B
    (None wanted) and after W, and the calls of grad_input / grad_weight in each pass."""
    install_linear(student, [0])
    count = Counting(student)
    try:
        out.case("minipar's autograd with your linear_backward: x (2, 3, 4) -> linear -> gelu -> linear, "
                 "B (backward_split.backward_b)")
        x0, w1, b1, w2, b2, g = graph_arrays()
        x = Tensor(x0.copy(), requires_grad=True)
        params = {name: Tensor(a.copy(), requires_grad=True) for name, a in
                  (("w1", w1), ("b1", b1), ("w2", w2), ("b2", b2))}
        y = ops.linear(ops.gelu(ops.linear(x, params["w1"], params["b1"])), params["w2"], params["b2"])
        pending = backward_split.backward_b(y, g, inputs=[x])
        out.put("ag|x_after_b", x.grad)
        out.put("ag|params_after_b", {n: p.grad for n, p in params.items()})
        out.put("ag|calls_b", count.take())
        out.case("minipar's autograd with your linear_backward: W (PendingW.run)")
        pending.run()
        out.put("ag|params_after_w", {n: p.grad for n, p in params.items()})
        out.put("ag|calls_w", count.take())
    finally:
        count.restore()


# --- the lists --------------------------------------------------------------------------------

KINDS = (Forward, Backward, WeightGrad, RecvActivation, SendActivation, RecvGrad, SendGrad)   # code = index
OTHER = len(KINDS)              # an item of none of the seven types, or with an odd micro-batch or chunk
KIND_CODE = {k: i for i, k in enumerate(KINDS)}
ODD_KEPT = 2000                 # odd items described per call list (the judge names the first)


def cases() -> list:
    """(p, m) for p = 1..8 stages and m = 1..12 micro-batches (m < p among them), and a
    teacher's extra "n_stages" and "n_micro"."""
    ps = sorted({*range(1, 9), *map(int, TEACHER.get("n_stages", []))})
    ms = sorted({*range(1, 13), *map(int, TEACHER.get("n_micro", []))})
    return [(p, m) for p in ps for m in ms]


def stage_cases() -> list:
    return [(p, m, s) for p, m in cases() for s in range(p)]


def items_kept(m: int) -> int:
    """A stage has at most 7m instructions (F, B, W and four messages per micro-batch)."""
    return 7 * m + 16


def describe_call(p: int, m: int, s: int) -> str:
    return f"zb_h1(stage={s}, n_stages={p}, n_micro={m})"


def described(v) -> dict:
    """{"type": its type's name, "value": v} for a plain number or short string, else the type
    alone: no code of the student's runs."""
    t = type(v)
    if t in (int, float, bool, type(None)) or (t.__module__ == "numpy" and isinstance(v, np.generic)
                                               and np.asarray(v).dtype.kind in "biuf"):
        return {"type": t.__name__, "value": v.item() if isinstance(v, np.generic) else v}
    if t is str:
        return {"type": "str", "value": v[:200]}
    return {"type": t.__name__[:200]}


def lists(student, out):
    """zb_h1 of every stage of every case: each list's items (kind code, micro-batch), what the
    container is, and whether a second call returned the very same object."""
    kinds, mbs, rows, fresh, odd, containers = [], [], [], [], {}, {}
    for p, m, s in stage_cases():
        what = describe_call(p, m, s)
        out.case(what)
        got = student.zb_h1(s, p, m)
        out.case(what + ", called a second time")
        again = student.zb_h1(s, p, m)
        out.case(what + ", reading what it returned")
        row, start = len(rows), len(kinds)
        if type(got) is list:
            code, items, length = 0, got[:items_kept(m)], len(got)
        else:
            containers[str(row)] = described(got)
            code, items, length = 1, [], 0
        for x in items:
            kind = KIND_CODE.get(type(x))
            mb = 0
            if kind is not None and type(x.mb) is int and type(x.chunk) is int and x.chunk == 0 \
                    and -2 ** 62 < x.mb < 2 ** 62:
                mb = x.mb
            else:
                if len(odd) < ODD_KEPT:
                    odd[str(len(kinds))] = ({"kind": kind, "mb": described(x.mb), "chunk": described(x.chunk)}
                                            if kind is not None else {"item": described(x)})
                kind = OTHER
            kinds.append(kind)
            mbs.append(mb)
        rows.append((start, len(items), length, code))
        fresh.append(again is not got)
    out.put("kinds", np.array(kinds, dtype=np.int8))
    out.put("mbs", np.array(mbs, dtype=np.int64))
    out.put("rows", np.array(rows, dtype=np.int64).reshape(-1, 4))
    out.put("fresh", np.array(fresh, dtype=bool))
    out.put("odd", odd)
    out.put("containers", containers)


# --- the seam ---------------------------------------------------------------------------------

def install_linear(student, calls):
    """ops.Linear.backward calls the student's linear_backward on (..., Cout) / (..., Cin)
    arrays with the mask the autograd asks for (needs_input_grad: all in one pass, dx only in
    backward_split's B, dW and db only in its W); minipar's forward stays."""
    def backward(self, g):
        calls[0] += 1
        x2, w, *pieces = self.saved
        dtype, need = x2.dtype, tuple(bool(n) for n in self.needs_input_grad)
        w_all = np.concatenate([w, *pieces], axis=1) if pieces else w
        g_c, x_c, w_c = compute(g, x2, w_all)
        x_c = x_c.reshape(*g.shape[:-1], x_c.shape[-1])                  # (..., Cin), as dy is (..., Cout)
        has_bias = len(need) > 2
        needs = (need[0], need[1] or any(need[3:]), has_bias and need[2])
        dx, dw, db = student.linear_backward(g_c, x_c, w_c, needs)
        dx = store(dx, dtype) if needs[0] else None
        dws = [None] * (1 + len(pieces))
        if needs[1]:
            cuts = np.cumsum([w.shape[1]] + [q.shape[1] for q in pieces])[:-1]
            dws = [store(d, dtype) for d in np.split(dw, cuts, axis=1)]
        if not has_bias:
            return dx, dws[0]
        return (dx, dws[0], store(db, dtype) if needs[2] else None, *dws[1:])

    ops.Linear.backward = backward


def install(student):
    """--schedule zb-h1 builds the student's lists (schedules.SCHEDULES["zb-h1"], asked once
    per rank by PipelineEngine), and every Linear's backward, B and W, is the student's
    linear_backward; counter() is how many lists and Linear backwards ran here."""
    calls = [0]
    schedules.SCHEDULES.update({"naive": schedules.naive, "gpipe": schedules.gpipe, "1f1b": schedules.one_f_one_b,
                                "interleaved": interleaved.interleaved, "zb-h2": zero_bubble.zb_h2})

    def build(stage, n_stages, n_micro):
        calls[0] += 1
        return student.zb_h1(stage, n_stages, n_micro)

    build.__name__ = "zb_h1"
    schedules.SCHEDULES["zb-h1"] = build
    install_linear(student, calls)
    return lambda: calls[0]
