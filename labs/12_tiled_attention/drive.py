"""Lab 12, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's tiled forward and backward, and the seam. Nothing here judges; lab.py does,
in the grader, against the plain attention it writes out itself.

Every input is drawn from a seed (case_inputs), so the grader rebuilds each one without being
told. For every call the child records what it returned and each input as it is afterwards;
for the memory criterion, the peak of the allocations during the call (tracemalloc, which
NumPy reports its arrays' memory to), started after the inputs were made.
"""
import math
import os
import tracemalloc

import numpy as np

from labs.framework import extra_cases
from labs.results import key
from minipar.autograd import tiled_attention

HERE = os.path.dirname(os.path.abspath(__file__))
TEACHER_SEED = int(extra_cases(HERE).get("seed", 0))
# minipar's own tiled attention and the plain attentions beside it: reached from the student's
# file, each raises (labs/child.py). The seam (install) puts the student's functions where
# tiled_attention.TiledAttention calls tiled_forward and tiled_backward.
OWN = ["minipar.autograd.tiled_attention:tiled_forward", "minipar.autograd.tiled_attention:tiled_backward",
       "minipar.autograd.tiled_attention:TiledAttention.forward",
       "minipar.autograd.tiled_attention:TiledAttention.backward",
       "minipar.autograd.attention:CausalSelfAttentionReference.forward",
       "minipar.autograd.attention:CausalSelfAttentionReference.backward",
       "minipar.autograd.attention:CausalSelfAttention.forward",
       "minipar.autograd.attention:CausalSelfAttention.backward"]


def rng_for(*k):
    """The generator of a case; a teacher's "seed" ($MINIPAR_LAB_EXTRA/12_tiled_attention/cases.json)
    draws other inputs."""
    return np.random.default_rng([12, *k] + ([TEACHER_SEED] if TEACHER_SEED else []))


# (label, shape (..., T, d), block_q, block_k, scale or None, q's size): each case runs causal
# and not. "q x 100": queries 100 times larger, scores of some hundreds (exp overflows
# float64 past 709 without the running maximum).
CASES = [
    ("T=16 d=4, blocks 4 x 4 (they divide T)", (16, 4), 4, 4, None, 1.0),
    ("T=13 d=4, blocks 4 x 4 (a ragged last block of 1)", (13, 4), 4, 4, None, 1.0),
    ("T=13 d=4, blocks 5 x 3 (the diagonal crosses blocks off their corners)", (13, 4), 5, 3, None, 1.0),
    ("T=11 d=3, blocks 3 x 5 (more queries than keys per block: the other way round)", (11, 3), 3, 5, None, 1.0),
    ("T=5 d=4, blocks 8 x 8 (T smaller than a block)", (5, 4), 8, 8, None, 1.0),
    ("T=1 d=4, blocks 4 x 4 (one token)", (1, 4), 4, 4, None, 1.0),
    ("T=9 d=2, blocks 1 x 1", (9, 2), 1, 1, None, 1.0),
    ("B=2 H=3 T=10 d=4, blocks 4 x 3 (leading batch and head axes)", (2, 3, 10, 4), 4, 3, None, 1.0),
    ("T=14 d=4, blocks 4 x 6, scale=0.3 given (not 1/sqrt(d))", (14, 4), 4, 6, 0.3, 1.0),
    ("T=12 d=4, blocks 3 x 4, q x 100 (scores of hundreds: the running max matters)", (12, 4), 3, 4, None, 100.0),
]
CAUSAL = (False, True)
# float32 inputs: a few of the same shapes (what training hands the functions in float32,
# fp16 and bf16 runs)
CASES_32 = [CASES[2], CASES[7], CASES[8]]

# the memory criterion: T large enough that one T x T array of float64 (18 MB) dwarfs every
# block; blocks that do not divide T
MEMORY = ("T=1500 d=4, blocks 64 x 48", (1500, 4), 64, 48)


FAMILIES = {"f64": 0, "f32": 1, "mem": 2}          # each family of cases draws from its own seeds


def case_inputs(i, shape, qsize, dtype="float64", family="f64"):
    """(q, k, v, do) of case i of `family`, in `dtype`: standard normal, q scaled by qsize."""
    r = rng_for(FAMILIES[family], i, *shape)
    q, k, v, do = (r.standard_normal(shape) for _ in range(4))
    return tuple(a.astype(dtype) for a in (q * qsize, k, v, do))


def plain_forward(q, k, v, causal, scale=None):
    """(o, lse) of the plain attention, the whole T x T at once: what the backward cases are
    handed as the forward's results (computed in float64, then rounded to q's dtype)."""
    T, d = q.shape[-2:]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    s = (q64 @ np.swapaxes(k64, -1, -2)) * scale
    if causal:
        s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    return (e / total @ v64).astype(q.dtype), (m + np.log(total))[..., 0].astype(q.dtype)


def scale_args(scale):
    """The call's extra arguments: scale=... when the case gives one, else nothing (the default)."""
    return {} if scale is None else {"scale": scale}


# --- what the child runs ----------------------------------------------------------------------

def record_inputs(out, k, inputs: dict):
    for name, a in inputs.items():
        out.put(key(k, "after", name), a)


def run_forward(student, out, family, cases, dtype):
    for i, (label, shape, bq, bk, scale, qsize) in enumerate(cases):
        q, k, v, _ = case_inputs(i, shape, qsize, dtype, family)
        for causal in CAUSAL:
            out.case(f"forward, {label}, causal={causal}, {dtype}")
            kf = key(family, "fwd", i, causal)
            out.put(kf, student.forward(q, k, v, causal, bq, bk, **scale_args(scale)))
            record_inputs(out, kf, {"q": q, "k": k, "v": v})


def run_backward(student, out, family, cases, dtype):
    for i, (label, shape, bq, bk, scale, qsize) in enumerate(cases):
        q, k, v, do = case_inputs(i, shape, qsize, dtype, family)
        for causal in CAUSAL:
            out.case(f"backward, {label}, causal={causal}, {dtype}")
            o, lse = plain_forward(q, k, v, causal, scale)
            kb = key(family, "bwd", i, causal)
            out.put(kb, student.backward(q, k, v, o, lse, do, causal, bq, bk, **scale_args(scale)))
            record_inputs(out, kb, {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do})


def forward(student, out):
    run_forward(student, out, "f64", CASES, "float64")


def backward(student, out):
    run_backward(student, out, "f64", CASES, "float64")


def float32(student, out):
    run_forward(student, out, "f32", CASES_32, "float32")
    run_backward(student, out, "f32", CASES_32, "float32")


def peak_of(fn, *args):
    """(what fn returned, the peak bytes allocated while it ran above what was held before)."""
    tracemalloc.start()
    try:
        result = fn(*args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return result, int(peak)


def memory(student, out):
    """The peak of the forward's and the backward's allocations on MEMORY's case."""
    label, shape, bq, bk = MEMORY
    q, k, v, do = case_inputs(0, shape, 1.0, "float64", "mem")
    for causal in CAUSAL:
        out.case(f"forward, {label}, causal={causal}, under tracemalloc")
        got, peak = peak_of(student.forward, q, k, v, causal, bq, bk)
        out.put(key("mem", "fwd", causal, "peak"), peak)
        out.put(key("mem", "fwd", causal), got)
        out.case(f"backward, {label}, causal={causal}, under tracemalloc")
        o, lse = plain_forward(q, k, v, causal)
        got, peak = peak_of(student.backward, q, k, v, o, lse, do, causal, bq, bk)
        out.put(key("mem", "bwd", causal, "peak"), peak)
        out.put(key("mem", "bwd", causal), got)


# --- the seam ---------------------------------------------------------------------------------

def install(student):
    """tiled_attention.TiledAttention (the model's attention with --attention tiled) computes
    with the student's forward and backward, on this process. -> calls()."""
    calls = [0]

    def tiled_forward(q, k, v, causal, block_q, block_k, scale=None):
        calls[0] += 1
        return student.forward(q, k, v, causal, block_q, block_k, **scale_args(scale))

    def tiled_backward(q, k, v, o, lse, do, causal, block_q, block_k, scale=None):
        calls[0] += 1
        return student.backward(q, k, v, o, lse, do, causal, block_q, block_k, **scale_args(scale))

    tiled_attention.tiled_forward, tiled_attention.tiled_backward = tiled_forward, tiled_backward
    return lambda: calls[0]
