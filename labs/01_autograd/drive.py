"""Lab 01, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's three backwards, and the seam. Nothing here judges; lab.py does, in the
grader, with its own finite differences and minipar's reference formulas.

Every input is drawn from a seed (rng_for) by the *_case functions below, so the grader
rebuilds each one without being told. For every call the child records what it returned,
each input as it is afterwards, and which inputs each returned array shares memory with.
"""
import os

import numpy as np

from labs.framework import extra_cases
from labs.results import key
from minipar.autograd import ops
from minipar.model.gpt import GPT, GPTConfig
from minipar.autograd.dtypes import compute, store

HERE = os.path.dirname(os.path.abspath(__file__))
TEACHER_SEED = int(extra_cases(HERE).get("seed", 0))
EPS = 1e-5                                      # minipar's LayerNorm eps (docs/design.md §1)
# minipar's own backwards (and its autograd engine): reached from the student's file, each
# raises (labs/child.py). The seam (install) replaces ops.*.backward by calls to the student's
# functions; a guard it replaces is not needed there (the seam calls the student, not minipar).
OWN = ["minipar.ops:LayerNormReference.backward", "minipar.ops:LayerNorm.backward",
       "minipar.ops:Softmax.backward", "minipar.ops:CrossEntropyReference.backward",
       "minipar.ops:CrossEntropy.backward", "minipar.tensor:Tensor.backward", "minipar.tensor:backward"]


def rng_for(*k):
    """The generator of a case; a teacher's "seed" ($MINIPAR_LAB_EXTRA/01_autograd/cases.json)
    draws other inputs."""
    return np.random.default_rng([1, *k] + ([TEACHER_SEED] if TEACHER_SEED else []))


def softmax(x):
    """softmax over the last axis, stably: exp(x - max) / sum exp(x - max) (builds y)."""
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# --- the cases ------------------------------------------------------------------------------
# eps: how the case passes eps: a float (positionally), ("kw", value) as eps=value, or None
# (left out: the signature's default, which the contract says is minipar's 1e-5)

# (label, N, C, x scale, x offset, eps): rows of C channels, x = offset + scale * N(0, 1)
LAYERNORM_FD = [
    ("N=3 C=5, eps=1e-5 by keyword", 3, 5, 1.0, 0.0, ("kw", EPS)),
    ("N=4 C=1 (one channel: variance 0)", 4, 1, 1.0, 0.0, EPS),
    ("N=2 C=16 x ~ 1e3", 2, 16, 1e3, 0.0, EPS),
    ("N=5 C=8 x ~ 1e-3 (variance below eps), eps left out (the default)", 5, 8, 1e-3, 0.0, None),
    ("N=1 C=7 x ~ 3 + N(0,1) (one row)", 1, 7, 1.0, 3.0, EPS),
    ("N=1 C=1 (one row of one channel)", 1, 1, 1.0, 0.0, EPS),
    ("N=3 C=6 eps=1e-3", 3, 6, 0.1, 0.0, 1e-3),
]

# (label, shape, scale): softmax over the last axis of x = scale * N(0, 1)
SOFTMAX_FD = [
    ("shape (4, 6)", (4, 6), 2.0),
    ("shape (2, 3, 5)", (2, 3, 5), 1.0),
    ("shape (3, 4) x ~ 10 (nearly one-hot)", (3, 4), 10.0),
    ("shape (7,) (one row, 1-D)", (7,), 1.5),
    ("shape (2, 2, 3, 4) (4-D)", (2, 2, 3, 4), 1.0),
    ("shape (5, 1) (K = 1: y is 1)", (5, 1), 1.0),
]

# (label, N, V, logit scale, row offset, loss_denom, dloss, targets dtype); offset "+-" puts
# each row at +1e4 or -1e4
CROSS_ENTROPY_FD = [
    ("N=4 V=5 loss_denom=4", 4, 5, 2.0, 0.0, 4.0, 1.0, "int64"),
    ("N=3 V=7 loss_denom=10 dloss=2.5", 3, 7, 2.0, 0.0, 10.0, 2.5, "int64"),
    ("N=4 V=6 logits +-1e4 loss_denom=8", 4, 6, 3.0, "+-", 8.0, 1.0, "int64"),
    ("N=6 V=3 repeated targets loss_denom=2.5 dloss=0.5, int32 targets", 6, 3, 1.0, 0.0, 2.5, 0.5, "int32"),
    ("N=1 V=4 (one row) loss_denom=1", 1, 4, 1.0, 0.0, 1.0, 1.0, "int64"),
    ("N=3 V=1 (one class: loss 0) loss_denom=3", 3, 1, 1.0, 0.0, 3.0, 1.0, "int64"),
]

# against minipar's formulas at 1e-12: bigger cases
LAYERNORM_REF = [("N=24 C=32", 24, 32, 1.0, 0.0, EPS), ("N=6 C=1", 6, 1, 1.0, 0.0, EPS),
                 ("N=64 C=96 x ~ 2 + 1e3 N(0,1)", 64, 96, 1e3, 2.0, EPS),
                 ("N=10 C=7 x ~ 1e-3", 10, 7, 1e-3, 0.0, EPS)]
SOFTMAX_REF = [("shape (8, 16, 16)", (8, 16, 16), 3.0), ("shape (5, 300)", (5, 300), 3.0)]
CROSS_ENTROPY_REF = [("N=32 V=50 loss_denom=32", 32, 50, 2.0, 0.0, 32.0, 1.0, "int64"),
                     ("N=16 V=256 logits +-1e4 loss_denom=64 dloss=0.5", 16, 256, 3.0, "+-", 64.0, 0.5, "int64"),
                     ("N=5 V=3 loss_denom=2.5 dloss=3", 5, 3, 1.0, 0.0, 2.5, 3.0, "int64")]

# float32 inputs (what training hands the functions: float32 runs, and fp16 / bf16 runs, which
# compute in float32): the results must be float32, close to the formulas in float64
LAYERNORM_32 = [("N=16 C=32", 16, 32, 1.0, 0.0, EPS), ("N=8 C=64 x ~ 200 + N(0,1)", 8, 64, 1.0, 200.0, EPS),
                ("N=5 C=1", 5, 1, 1.0, 0.0, EPS), ("N=1 C=9 x ~ 3 + N(0,1), eps left out", 1, 9, 1.0, 3.0, None)]
SOFTMAX_32 = [("shape (6, 10)", (6, 10), 2.0), ("shape (2, 3, 7)", (2, 3, 7), 1.0)]
CROSS_ENTROPY_32 = [("N=8 V=20 loss_denom=8", 8, 20, 2.0, 0.0, 8.0, 1.0, "int64"),
                    ("N=4 V=6 logits +-1e4 loss_denom=16 dloss=2", 4, 6, 3.0, "+-", 16.0, 2.0, "int32")]

GPT_CONFIG = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)
GPT_B = 3
GPT_DTYPES = ("float64", "float32")


def eps_args(eps) -> tuple[tuple, dict, float]:
    """(positional extra, keyword extra, the eps value the forward uses)."""
    if eps is None:
        return (), {}, EPS
    if isinstance(eps, tuple):
        return (), {"eps": eps[1]}, eps[1]
    return (eps,), {}, eps


def eps_text(eps) -> str:
    return "eps left out" if eps is None else f"eps={eps[1]:g} by keyword" if isinstance(eps, tuple) \
        else f"eps={eps:g}"


def layernorm_case(N, C, scale, offset, seed, dtype="float64"):
    """(x, w, b, dout) of a case, in `dtype`."""
    r = rng_for(seed, N, C)
    x = offset + scale * r.standard_normal((N, C))
    w, b = 1.0 + 0.5 * r.standard_normal(C), r.standard_normal(C)
    dout = r.standard_normal((N, C))
    return tuple(a.astype(dtype) for a in (x, w, b, dout))


def softmax_case(shape, scale, seed, dtype="float64"):
    """(x, y, dout) of a case, in `dtype`: y = softmax(x), computed in float64 then rounded."""
    r = rng_for(seed, *shape)
    x, dout = scale * r.standard_normal(shape), r.standard_normal(shape)
    return x.astype(dtype), softmax(x).astype(dtype), dout.astype(dtype)


def cross_entropy_case(N, V, scale, offset, seed, dtype="float64", tdtype="int64"):
    """(logits, targets) of a case."""
    r = rng_for(seed, N, V)
    logits = scale * r.standard_normal((N, V))
    if offset == "+-":
        logits += r.choice([-1e4, 1e4], size=(N, 1))
    targets = r.integers(0, V, size=N)
    if N >= 3:
        targets[1] = targets[2] = targets[0]                  # rows sharing a target
    return logits.astype(dtype), targets.astype(tdtype)


# seeds of each family (the grader rebuilds the inputs from them)
SEED = {"ln_fd": 0, "sm_fd": 1, "ce_fd": 2, "ln_ref": 3, "sm_ref": 4, "ce_ref": 5, "ln_32": 8, "sm_32": 9,
        "ce_32": 10}


def gpt_inputs():
    """(idx, targets, loss_denom) of the GPT case: loss_denom as with 4 micro-batches."""
    cfg = GPT_CONFIG
    r = rng_for(6)
    idx = r.integers(0, cfg.vocab_size, size=(GPT_B, cfg.block_size))
    targets = r.integers(0, cfg.vocab_size, size=(GPT_B, cfg.block_size))
    return idx, targets, 4.0 * GPT_B * cfg.block_size


def gpt_gradients(dtype):
    """(loss, {name: gradient}) of a fresh tiny GPT's loss.backward(), with whatever backwards
    ops holds in this process: the student's in the child (after install), minipar's own in
    the grader."""
    idx, targets, denom = gpt_inputs()
    model = GPT(GPT_CONFIG, seed=7, dtype=np.dtype(dtype))
    loss = model(idx, targets, loss_denom=denom)
    loss.backward()
    grads = {name: (p.grad.copy() if isinstance(p.grad, np.ndarray) else p.grad) for name, p in model.params.items()}
    return loss.item(), grads


# --- recording one call ---------------------------------------------------------------------

def call_and_record(out, k, fn, args, kwargs, inputs: dict):
    """fn(*args, **kwargs): record what it returned, each of `inputs` as it is afterwards, and
    for each returned array the names of the inputs it shares memory with."""
    got = fn(*args, **kwargs)
    out.put(k, got)
    for name, a in inputs.items():
        out.put(key(k, "after", name), a)
    parts = list(got[:8]) if isinstance(got, (tuple, list)) else [got]
    out.put(key(k, "shares"), [[name for name, a in inputs.items()
                                if isinstance(p, np.ndarray) and np.may_share_memory(p, a)] for p in parts])


def run_layernorm(student, out, family, cases, dtype):
    for i, (label, N, C, scale, offset, eps) in enumerate(cases):
        out.case(f"layernorm_backward, {label}, {dtype}")
        x, w, _, dout = layernorm_case(N, C, scale, offset, SEED[family], dtype)
        extra, kw, _ = eps_args(eps)
        call_and_record(out, key(family, i), student.layernorm_backward, (dout, x, w, *extra), kw,
                        {"dout": dout, "x": x, "w": w})


def run_softmax(student, out, family, cases, dtype):
    for i, (label, shape, scale) in enumerate(cases):
        out.case(f"softmax_backward, {label}, {dtype}")
        _, y, dout = softmax_case(shape, scale, SEED[family], dtype)
        call_and_record(out, key(family, i), student.softmax_backward, (dout, y), {}, {"dout": dout, "y": y})


def run_cross_entropy(student, out, family, cases, dtype):
    for i, (label, N, V, scale, offset, denom, dloss, tdtype) in enumerate(cases):
        out.case(f"cross_entropy_backward, {label}, {dtype}")
        logits, targets = cross_entropy_case(N, V, scale, offset, SEED[family], dtype, tdtype)
        call_and_record(out, key(family, i), student.cross_entropy_backward, (logits, targets, dloss, denom), {},
                        {"logits": logits, "targets": targets})


# --- what the child runs ----------------------------------------------------------------------

def layernorm_fd(student, out):
    run_layernorm(student, out, "ln_fd", LAYERNORM_FD, "float64")


def softmax_fd(student, out):
    run_softmax(student, out, "sm_fd", SOFTMAX_FD, "float64")


def cross_entropy_fd(student, out):
    run_cross_entropy(student, out, "ce_fd", CROSS_ENTROPY_FD, "float64")


def reference(student, out):
    run_layernorm(student, out, "ln_ref", LAYERNORM_REF, "float64")
    run_softmax(student, out, "sm_ref", SOFTMAX_REF, "float64")
    run_cross_entropy(student, out, "ce_ref", CROSS_ENTROPY_REF, "float64")


def float32(student, out):
    run_layernorm(student, out, "ln_32", LAYERNORM_32, "float32")
    run_softmax(student, out, "sm_32", SOFTMAX_32, "float32")
    run_cross_entropy(student, out, "ce_32", CROSS_ENTROPY_32, "float32")


def gpt(student, out):
    """The tiny GPT's loss and gradients with the student's backwards at the seam, and how
    many times the seam ran them, in float64 and float32."""
    calls = install(student)
    for dtype in GPT_DTYPES:
        cfg = GPT_CONFIG
        out.case(f"GPT L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd} V={cfg.vocab_size}, B={GPT_B} "
                 f"T={cfg.block_size}, {dtype}, loss.backward() with your backwards at the seam")
        before = calls()
        loss, grads = gpt_gradients(dtype)
        out.put(key("gpt", dtype, "loss"), loss)
        out.put(key("gpt", dtype, "grads"), grads)
        out.put(key("gpt", dtype, "calls"), calls() - before)


# --- the seam ---------------------------------------------------------------------------------

def install(student):
    """ops.LayerNorm, ops.CrossEntropy and ops.Softmax compute their backward with the
    student's functions, on this process; the forwards stay minipar's. -> calls().

    minipar's fast forwards save what their own backward wants (xhat and rstd; the
    probabilities), not the inputs the student's functions start from, so each forward is
    wrapped to keep its input too (the forward itself is minipar's, untouched: the loss is
    bit for bit the same)."""
    calls = [0]
    ln_forward, ce_forward = ops.LayerNorm.forward, ops.CrossEntropy.forward

    def layer_norm_forward(self, x, w, b, eps=EPS):
        self.lab_input = (x, eps)                             # the fast op saves xhat and rstd, not x
        return ln_forward(self, x, w, b, eps)

    def layer_norm_backward(self, g):
        calls[0] += 1
        (x, eps), (_, w, _) = self.lab_input, self.saved      # w as the forward computed with it
        C = x.shape[-1]
        dx, dw, db = student.layernorm_backward(compute(g).reshape(-1, C), compute(x).reshape(-1, C), w, eps)
        return store(dx.reshape(g.shape), self.dtype), store(dw, self.dtype), store(db, self.dtype), None

    def cross_entropy_forward(self, logits, targets, denom=None):
        self.lab_logits = logits                              # the fast op saves the probabilities
        return ce_forward(self, logits, targets, denom)

    def cross_entropy_backward(self, g):
        calls[0] += 1
        (_, t), V = self.saved, self.shape[-1]
        d = student.cross_entropy_backward(compute(self.lab_logits).reshape(-1, V), t, float(g), self.denom)
        return store(d.reshape(self.shape), self.dtype), None, None

    def softmax_backward(self, g):
        calls[0] += 1
        (y,) = self.saved
        dx = student.softmax_backward(np.moveaxis(compute(g), self.axis, -1), np.moveaxis(y, self.axis, -1))
        return store(np.moveaxis(dx, -1, self.axis), self.dtype), None

    ops.LayerNorm.forward, ops.LayerNorm.backward = layer_norm_forward, layer_norm_backward
    ops.CrossEntropy.forward, ops.CrossEntropy.backward = cross_entropy_forward, cross_entropy_backward
    ops.Softmax.backward = softmax_backward
    return lambda: calls[0]
