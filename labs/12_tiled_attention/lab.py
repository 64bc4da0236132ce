"""Lab 12's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): tiled_attention.tiled_forward and tiled_backward, which
tiled_attention.TiledAttention (the model's attention with `--attention tiled`) calls: the
trainer then attends with the student's code.
Oracle: the plain attention, written out below on the inputs the grader rebuilds from the
cases' seeds (drive.case_inputs): S = q k^T * scale with the causal mask, P = softmax(S),
o = P v, lse = log sum exp S, and the backward from P, all T x T at once, in float64. The
child only hands back what the student's functions returned, the inputs as they were
afterwards, and (memory) the peak that tracemalloc measured during each call.
"""
import math
import os

import numpy as np

from labs.framework import Criterion, first_difference, load_drive, trainer_flags
from labs.results import described, key
from labs.judging import returned, scale_of, untouched
from labs.scan import Allowed

TITLE = "tiled attention: FlashAttention-2's forward and backward"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
# Plain NumPy: the handout gives no minipar name, so every minipar import (above all
# minipar.autograd.tiled_attention, the answer, and attention.py's plain attention) is refused.
ALLOWED = Allowed()
NEW_ARRAYS = "compute into new arrays (q * scale, not q *= scale)"
F32_TOL = 1e-4                  # float32 results: relative, and of the largest entry absolute


# --- the oracle: the plain attention, T x T at once -------------------------------------------

def scores(q, k, causal, scale):
    T, d = q.shape[-2:]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if causal:
        above = np.triu(np.ones((T, T), dtype=bool), k=1)         # key j after query i
        s = np.where(above, -np.inf, s)
    return s, scale


def plain_forward(q, k, v, causal, scale):
    """(o, lse, P) in float64: o = softmax(S) v, lse = log sum_j exp S_ij."""
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    s, _ = scores(q, k, causal, scale)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    p = e / total
    return p @ v, (m + np.log(total))[..., 0], p


def plain_backward(q, k, v, do, causal, scale):
    """(dq, dk, dv) in float64, from the whole P: dv = P^T do, dP = do v^T,
    dS = P * (dP - rowsum(dP * P)), dq = dS k * scale, dk = dS^T q * scale."""
    q, k, v, do = (a.astype(np.float64) for a in (q, k, v, do))
    _, _, p = plain_forward(q, k, v, causal, scale)
    _, scale = scores(q, k, causal, scale)
    dv = np.swapaxes(p, -1, -2) @ do
    dp = do @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    return (ds @ k) * scale, (np.swapaxes(ds, -1, -2) @ q) * scale, dv


# --- comparing --------------------------------------------------------------------------------

def close64(got, want, what):
    """float64 against the plain attention: 1e-12 relative, and 1e-12 of the largest entry
    absolute (the same sums in another order)."""
    diff = first_difference(got, want, rtol=1e-12, atol=1e-12 * scale_of(want))
    assert diff is None, f"{what}: {diff}"


def close32(got, want, what):
    """float32 results of float32 inputs against the plain attention in float64 on the same
    inputs: float32 itself, within F32_TOL."""
    if isinstance(got, np.ndarray) and got.dtype != np.float32:
        raise AssertionError(f"{what}: dtype {got.dtype}, want float32 (the inputs' dtype: an array made "
                             f"without dtype= is float64)")
    diff = first_difference(got, want.astype(np.float32), rtol=F32_TOL, atol=F32_TOL * scale_of(want))
    assert diff is None, f"{what}: {diff}"


# --- the judges -------------------------------------------------------------------------------

def judge_forward_family(res, family, cases, dtype, close):
    for i, (label, shape, bq, bk, scale, qsize) in enumerate(cases):
        q, k, v, _ = drive.case_inputs(i, shape, qsize, dtype, family)
        for causal in drive.CAUSAL:
            what = f"forward, {label}, causal={causal}, {dtype}"
            kf = key(family, "fwd", i, causal)
            o, lse = returned(res, kf, ("o", "lse"), what)
            untouched(res, kf, {"q": q, "k": k, "v": v}, what, NEW_ARRAYS)
            want_o, want_lse, _ = plain_forward(q, k, v, causal, scale)
            close(o, want_o, f"{what}: o")
            close(lse, want_lse, f"{what}: lse (log sum_j exp S_ij per row, shape {want_lse.shape})")


def judge_backward_family(res, family, cases, dtype, close):
    for i, (label, shape, bq, bk, scale, qsize) in enumerate(cases):
        q, k, v, do = drive.case_inputs(i, shape, qsize, dtype, family)
        for causal in drive.CAUSAL:
            what = f"backward, {label}, causal={causal}, {dtype}"
            kb = key(family, "bwd", i, causal)
            got = returned(res, kb, ("dq", "dk", "dv"), what)
            o, lse = drive.plain_forward(q, k, v, causal, scale)
            untouched(res, kb, {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do}, what, NEW_ARRAYS)
            want = plain_backward(q, k, v, do, causal, scale)
            for name, g, w in reversed(list(zip(("dq", "dk", "dv"), got, want))):   # dv first: the simplest
                close(g, w, f"{what}: {name}")


def judge_forward(res):
    judge_forward_family(res, "f64", drive.CASES, "float64", close64)


def judge_backward(res):
    judge_backward_family(res, "f64", drive.CASES, "float64", close64)


def judge_float32(res):
    judge_forward_family(res, "f32", drive.CASES_32, "float32", close32)
    judge_backward_family(res, "f32", drive.CASES_32, "float32", close32)


def memory_bound(T, d, bq, bk) -> int:
    """The most bytes a tiled call may hold at once, for float64 (T, d) inputs: 8 arrays of
    (T, d) (the results, a scaled copy ...), 4 vectors of T (lse, D, m, l) and 8 tiles of
    block_q x block_k, 8 bytes each, and 64 KiB for NumPy's and Python's small change. One
    T x T array is 8 T^2 bytes; one strip of block_q x T scores, 8 block_q T, is over it
    by itself on drive.MEMORY's case."""
    return 8 * (8 * T * d + 4 * T + 8 * bq * bk) + (64 << 10)


def judge_memory(res):
    label, (T, d), bq, bk = drive.MEMORY
    bound = memory_bound(T, d, bq, bk)
    q, k, v, do = drive.case_inputs(0, (T, d), 1.0, "float64", "mem")
    for causal in drive.CAUSAL:
        want_o, want_lse, _ = plain_forward(q, k, v, causal, None)
        want_grads = plain_backward(q, k, v, do, causal, None)
        for part, names, want in (("fwd", ("o", "lse"), (want_o, want_lse)), ("bwd", ("dq", "dk", "dv"), want_grads)):
            call = "forward" if part == "fwd" else "backward"
            what = f"{call}, {label}, causal={causal}"
            peak = res.get(0, key("mem", part, causal, "peak"))
            assert isinstance(peak, int), f"{what}: the peak came back as {described(peak)} (a lab bug?)"
            assert peak <= bound, (
                f"{what}: {peak:,} bytes held at the peak (tracemalloc), over the bound of {bound:,} "
                f"= 8 x (8 T d + 4 T + 8 block_q block_k) + 64 KiB; one T x T array is {8 * T * T:,} bytes and "
                f"one block_q x T strip of scores {8 * bq * T:,}: make the scores one tile at a time")
            for name, g, w in zip(names, returned(res, key("mem", part, causal), names, what), want):
                close64(g, w, f"{what}: {name}")


CRITERIA = [
    Criterion("forward against the plain attention", run="forward", judge=judge_forward, timeout=30,
              uses=("forward",),
              hint="per query block: m = max so far, l = sum of exp(S - m), acc = sum of exp(S - m) v; a new key "
                   "block moves m to m' and multiplies l and acc by exp(m - m') first; o = acc / l and lse = "
                   "m + log l at the end; the causal mask compares global positions (block start + index), and "
                   "the last block of each loop may be shorter"),
    Criterion("backward against the plain attention", run="backward", judge=judge_backward, timeout=30,
              uses=("backward",),
              hint="D = rowsum(do * o) once, from the whole o you are given; per tile P = exp(S - lse) with S "
                   "scaled and masked as in forward; dv += P^T do, dS = P * (do v^T - D), dq += dS k * scale, "
                   "dk += dS^T q * scale: the scale once in each, and not again on a q you scaled already"),
    Criterion("float32 inputs", run="float32", judge=judge_float32, timeout=30, uses=("forward", "backward"),
              hint="float32 in, float32 out: make m, l, the accumulators and the results with dtype=q.dtype "
                   "(np.zeros(shape) alone is float64)"),
    Criterion("no T x T matrix: the memory held", run="memory", judge=judge_memory, timeout=60,
              uses=("forward", "backward"),
              hint="never make q k^T of the whole sequence, nor a T x T mask, nor a strip of block_q x T "
                   "scores: one block_q x block_k tile of scores at a time, then drop it"),
    Criterion("trainer --attention tiled --attn-block 5",
              trainer=trainer_flags("--attention", "tiled", "--attn-block", "5"), timeout=120,
              uses=("forward", "backward"),
              hint="a tiny GPT (T = 16, blocks of 5: a ragged last block) trains with your forward and backward "
                   "in every layer's attention (causal, tiled_attention.TiledAttention); the grader compares the "
                   "run with its own single-process run of the plain attention"),
]
