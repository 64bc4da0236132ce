"""Lab 07, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's gpipe and one_f_one_b, and the seam. Nothing here judges; lab.py does, in the
grader, on the lists recorded here.

Cases: p = 1..8 stages and m = 1..16 micro-batches (and a teacher's "n_stages" and "n_micro"),
every stage of each, both functions. Each returned value is recorded type-faithfully and
compactly (Table.add): what the container is (a list, a tuple, another iterable, or not
iterable at all) and whether a second call with the same arguments returned the very same
object; for each item, its instruction class by exact type (KINDS, or "other") and its
micro-batch as returned (an int or a NumPy integer in an int64 array beside its type's code;
anything else, or a chunk other than 0, in a side table), so the grader can rebuild real
instruction objects and say "micro-batch 1.0 is not an int" or "item 3 is not an instruction".
No code of the student's runs here beyond their two functions and, for an iterable that is not
a list or a tuple, its iteration: no repr, no __eq__.
"""
import itertools
import os

import numpy as np

from labs.framework import extra_cases
from labs.results import key
from minipar.parallel.pipeline import interleaved, schedules, zero_bubble
from minipar.parallel.pipeline.schedules import (Backward, Forward, RecvActivation, RecvGrad, SendActivation,
                                                 SendGrad)

HERE = os.path.dirname(os.path.abspath(__file__))
FUNCTIONS = ("gpipe", "one_f_one_b")
NAMES = {"gpipe": "gpipe", "1f1b": "one_f_one_b"}      # --schedule name -> the student's function
KINDS = (Forward, Backward, RecvActivation, SendActivation, RecvGrad, SendGrad)   # code = index
OTHER = len(KINDS)                  # an item of none of the six types (described() of it kept)
KIND_CODE = {k: i for i, k in enumerate(KINDS)}
UNKEPT = OTHER + 1                  # an odd item past the ODD_KEPT first (nothing kept of it)
ODD_KEPT = 10_000                   # odd items described in full per function (the judge names the first)
# a micro-batch's type: 0 a plain int, else 1 + its index here (NumPy's own integer scalars)
NP_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
NP_CODE = {np.dtype(n).type: 1 + i for i, n in enumerate(NP_INTS)}
CONTAINERS = ("list", "tuple", "iterable", "not iterable")
# minipar's own schedules, its schedule() and its simulator, in every form: reached from the
# student's file, each raises (labs/child.py)
OWN = [f"minipar.parallel.pipeline.schedules:{n}" for n in ("gpipe", "one_f_one_b", "naive", "schedule", "check",
                                                   "programs", "_forward", "_backward")] + \
      [f"minipar.parallel.pipeline.instructions:{n}" for n in ("_forward", "_backward")] + \
      [f"minipar.parallel.pipeline.check:{n}" for n in ("check", "programs")] + \
      ["minipar.parallel.pipeline.interleaved:interleaved", "minipar.parallel.pipeline.zero_bubble:zb_h1",
       "minipar.parallel.pipeline.zero_bubble:zb_h2"]


def cases() -> list:
    """(p, m) for p = 1..8 stages and m = 1..16 micro-batches, the smallest p first; and a
    teacher's extra "n_stages" and "n_micro" ($MINIPAR_LAB_EXTRA/07_schedules/cases.json)."""
    extra = extra_cases(HERE)
    ps = sorted({*range(1, 9), *map(int, extra.get("n_stages", []))})
    ms = sorted({*range(1, 17), *map(int, extra.get("n_micro", []))})
    return [(p, m) for p in ps for m in ms]


def stage_cases() -> list:
    """(p, m, stage) in the order the child calls and records them."""
    return [(p, m, s) for p, m in cases() for s in range(p)]


def items_kept(m: int) -> int:
    """The items of one returned list that are recorded: a stage has at most 6m instructions
    (a Forward, a Backward and four messages per micro-batch), so more only says "too many"."""
    return 6 * m + 16


def describe_call(fn: str, p: int, m: int, s: int) -> str:
    return f"{fn}(stage={s}, n_stages={p}, n_micro={m})"


# --- what the child runs ----------------------------------------------------------------------

def guard_registry():
    """schedules.SCHEDULES holds minipar's own functions, not the module's names the child's
    guards replaced: point it at those names again (guards, unless graded as trusted)."""
    schedules.SCHEDULES.update({"naive": schedules.naive, "gpipe": schedules.gpipe, "1f1b": schedules.one_f_one_b,
                                "interleaved": interleaved.interleaved, "zb-h1": zero_bubble.zb_h1,
                                "zb-h2": zero_bubble.zb_h2})


PLAIN = (int, float, bool, str, type(None))


def described(v) -> dict:
    """{"type": its type's name, "value": v} for a plain value (a number, a short string, None),
    else {"type": its type's name} alone: no code of the student's runs (no repr, no __eq__)."""
    t = type(v)
    plain = t in PLAIN or (t.__module__ == "numpy" and isinstance(v, np.generic)
                           and np.asarray(v).dtype.kind in "biufc")
    if t is str and len(v) > 200:
        return {"type": "str", "value": v[:200] + "..."}
    return {"type": t.__name__[:200], "value": v} if plain else {"type": t.__name__[:200]}


class Table:
    """One function's lists, in compact arrays: every item's kind code and micro-batch, one
    row per call (start, items kept, length, container code), whether each call's result was
    new, and the odd items and containers in side tables."""

    def __init__(self):
        self.kinds, self.mbs, self.mbtypes, self.rows, self.fresh = [], [], [], [], []
        self.odd: dict = {}                # str(item's global index) -> described() of it or of its fields
        self.containers: dict = {}         # str(row) -> described() of what is not a list or a tuple

    def add(self, got, again, limit: int):
        """One call's result `got` (at most `limit` items kept) and the same call's second result."""
        row = len(self.rows)
        start = len(self.kinds)
        code = 0 if type(got) is list else 1 if type(got) is tuple else None
        if code != 0:
            self.containers[str(row)] = described(got)
        if code is None:
            try:
                iter(got)
                code = 2
            except TypeError:
                code = 3
        if code < 2:                       # a list or a tuple: its true length, its first items
            items, length = got[:limit], len(got)
        elif code == 2:                    # read one item past the limit: enough to say "too many"
            items = list(itertools.islice(got, limit + 1))
            length = len(items)
            items = items[:limit]
        else:
            items, length = [], 0
        for x in items:
            kind, mb, mbtype = KIND_CODE.get(type(x)), 0, 0
            if kind is None:
                kind = self.odd_item(described(x))
            else:
                m, c = x.mb, x.chunk
                mbtype = 0 if type(m) is int else NP_CODE.get(type(m))
                if mbtype is not None and -2 ** 63 <= int(m) < 2 ** 63 and type(c) is int and c == 0:
                    mb = int(m)
                else:
                    kind, mbtype = self.odd_item({"mb": described(m), "chunk": described(c)}, kind), 0
            self.kinds.append(kind)
            self.mbs.append(mb)
            self.mbtypes.append(mbtype)
        self.rows.append((start, len(items), length, code))
        self.fresh.append(again is not got)

    def odd_item(self, description: dict, kind: int = OTHER) -> int:
        """Keep an odd item's description (the first ODD_KEPT of the function's); its kind code."""
        if len(self.odd) >= ODD_KEPT:
            return UNKEPT
        self.odd[str(len(self.kinds))] = description
        return kind

    def put(self, out, fn: str):
        out.put(key("kinds", fn), np.array(self.kinds, dtype=np.int8))
        out.put(key("mbs", fn), np.array(self.mbs, dtype=np.int64))
        out.put(key("mbtypes", fn), np.array(self.mbtypes, dtype=np.int8))
        out.put(key("rows", fn), np.array(self.rows, dtype=np.int64).reshape(-1, 4))
        out.put(key("fresh", fn), np.array(self.fresh, dtype=bool))
        out.put(key("odd", fn), self.odd)
        out.put(key("containers", fn), self.containers)


def lists(student, out):
    """Every case of both functions: the returned value, and whether a second call with the
    same arguments returned the same object (the contract asks for a new list each time)."""
    guard_registry()
    for fn in FUNCTIONS:
        f = getattr(student, fn)
        table = Table()
        for p, m, s in stage_cases():
            out.case(describe_call(fn, p, m, s))
            got = f(s, p, m)
            out.case(describe_call(fn, p, m, s) + ", called a second time")
            again = f(s, p, m)
            out.case(describe_call(fn, p, m, s) + ", reading what it returned")
            table.add(got, again, items_kept(m))
        table.put(out, fn)


# --- the seam ---------------------------------------------------------------------------------

def install(student):
    """schedule("gpipe" | "1f1b", ...) builds the student's lists (PipelineEngine asks it once
    per rank); counter() is how many lists were built here."""
    guard_registry()
    calls = [0]

    def seam(fn):
        def build(stage, n_stages, n_micro):
            calls[0] += 1
            return fn(stage, n_stages, n_micro)
        build.__name__ = fn.__name__
        return build

    for name, attr in NAMES.items():
        schedules.SCHEDULES[name] = seam(getattr(student, attr))
    return lambda: calls[0]
