"""Lab 17's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): recompute.block, through which recompute.runner's run_block runs every
transformer block (--recompute full), and parallelize.recomputed_attention, the attention core
of --recompute selective, become calls to the student's checkpoint.
Oracles, computed here: every case of drive.CASES run again in this process with the plain
block instead of a checkpoint (drive.plain: minipar's autograd on the un-checkpointed block,
nothing of the student's loaded), from the same seeds; the runs a checkpointed block makes;
the saved bytes of a GPT by a formula written out below (and held to minipar's planner,
minipar/plan/activations.py); the FLOPs of one forward and backward by a formula written out
below (and held to recompute.added_flops). The child only hands back what came out of the
student's code: outputs, gradients, inputs afterwards, the runs it made, the bytes it kept.
"""
import os

import numpy as np

from labs.framework import Criterion, first_difference, load_drive, trainer_flags
from labs.judging import scale_of
from labs.results import key, typename
from labs.scan import Allowed
from minipar.autograd import recompute
from minipar.plan import activations

TITLE = "activation recomputation: a checkpointed block, its forward run again in backward"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
OWN_REASON = "minipar's own recomputation: this lab grades yours"
GRAD_NAMES = {"Function", "Tensor", "no_grad", "enable_grad", "is_grad_enabled"}
ALLOWED = Allowed(
    modules={"minipar.tensor": GRAD_NAMES, "minipar.autograd.tensor": GRAD_NAMES,
             "minipar.autograd": set()},             # only so that its recompute is refused by name
    refused={**{f"minipar.autograd.{n}": OWN_REASON for n in ("recompute", "backward_split")},
             **{n: OWN_REASON for n in ("Recompute", "runner", "replaying")}})
TOL = 1e-12                     # float64: the same operations; 1e-12 of the tensor's scale


# --- the gradients -----------------------------------------------------------------------------

_plain: dict = {}


def plain_case(name):
    """The case run with the plain block, here (cached): the oracle."""
    if name not in _plain:
        _plain[name] = drive.CASES[name][1](drive.plain)
    return _plain[name]


def pattern(got, want, before=None) -> str:
    """A word on a common wrong gradient: twice the right one, zero, or the right one without
    what was there before."""
    try:
        g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
        if g.shape != w.shape or not w.size or not np.abs(w).max():
            return ""
        if before is not None and np.allclose(g - before, 2 * (w - before), rtol=1e-9, atol=1e-12):
            return " (the plain block's contribution added twice: the block's backward ran twice?)"
        if before is not None and np.allclose(g, w - before, rtol=1e-9, atol=1e-12):
            return " (what .grad held before is gone: add into it, never replace it)"
        if np.allclose(g, 2 * w, rtol=1e-9, atol=1e-12):
            return " (twice the plain block's: accumulated twice?)"
        if not np.abs(g).max():
            return " (all zero)"
    except (TypeError, ValueError):
        return ""
    return ""


def close(got, want, what, before=None):
    if got is None and want is not None:
        raise AssertionError(f"{what}: None, want an array {np.shape(want)} (no gradient reached it)")
    if want is None:
        if got is not None:
            raise AssertionError(f"{what}: got {typename(got)}, want None (nothing should reach it)")
        return
    diff = first_difference(got, want, rtol=TOL, atol=TOL * scale_of(want))
    assert diff is None, f"{what}: {diff}{pattern(got, want, before)}"


def judge_case(res, name):
    what = f"{name} ({drive.CASES[name][0]})"
    want = plain_case(name)
    got = res.get(0, key("case", name))
    assert isinstance(got, dict), f"{what}: the record is {typename(got)} (tampered with?)"
    for k, v in want.items():
        if k.endswith(" before"):                                   # the inputs afterwards: untouched
            after = got.get(k.replace(" before", " after"))
            label = k.replace(" before", "")
            if not (isinstance(after, np.ndarray) and after.shape == v.shape and np.array_equal(after, v)):
                diff = first_difference(after, v, rtol=0.0)
                kind = "the output's gradient handed to backward" if label.startswith("g") else "the input"
                raise AssertionError(f"{what}: {kind} {label} was modified ({diff}): compute into new arrays")
    for k in ("y", "y1", "y2"):
        if k in want:
            close(got.get(k), want[k], f"{what}: the output {k} (the plain block's forward)")
    if "y requires grad" in want and got.get("y requires grad") != want["y requires grad"]:
        raise AssertionError(f"{what}: y.requires_grad is {got.get('y requires grad')!r}, want "
                             f"{want['y requires grad']} (" + ("under no_grad() nothing is recorded: return run(x)"
                                                               if not want["y requires grad"] else
                                                               "the output must be part of the graph") + ")")
    for k, v in want.items():
        if k.endswith(" grad") and k != "y requires grad":
            close(got.get(k), v, f"{what}: the gradient of the input {k[:-5]}")
    params = got.get("params")
    assert isinstance(params, dict) and set(params) == set(want["params"]), \
        f"{what}: the record of the parameters' gradients is damaged"
    before = {n: drive.rng_for(5, n).standard_normal(np.shape(v)) for n, v in want["params"].items()} \
        if name == "accumulated" else {}
    for n, v in want["params"].items():
        close(params[n], v, f"{what}: the gradient of parameter {n}", before.get(n))


def judge_one(res):
    for name in drive.ONE:
        judge_case(res, name)


def judge_many(res):
    for name in drive.MANY:
        judge_case(res, name)


# --- the saved activations: formulas ----------------------------------------------------------

D = 8                           # float64


def ends_bytes(N, T, C, V, d=D):
    """What a whole GPT keeps outside its blocks (one process): the token ids (N int64), the
    positions (T int64), the final LayerNorm's normalised input and 1/std (N C + N), the
    head's input (N C), the softmax of the logits (N V), the targets (N int64)."""
    return 8 * N + 8 * T + d * (N * C + N) + d * N * C + d * N * V + 8 * N


def layer_bytes(s, b, h, a, setting, d=D):
    """One minipar block's saved bytes, by Korthikanti et al.'s letters (s tokens, b rows, h
    width, a heads): none d sbh (20 + 2/h + as/h) = d (20 sbh + 2 sb + a s^2 b): the two
    LayerNorms' xhat and 1/std (2 sbh + 2 sb), c_attn's and c_fc's inputs (2 sbh), q k v
    (3 sbh), the softmax (a s^2 b), c_proj's input (sbh), GELU's input and sigmoid (8 sbh),
    mlp c_proj's input (4 sbh). selective: all but the softmax (the attention core keeps its
    input, q k v, 3 sbh). full: the block's input alone, sbh."""
    sbh, sb = s * b * h, s * b
    return {"none": d * (20 * sbh + 2 * sb + a * s * s * b), "selective": d * (20 * sbh + 2 * sb),
            "full": d * sbh}[setting]


def korthikanti(s, b, h, a):
    """Korthikanti et al. 2022, Table 2, no parallelism: sbh (34 + 5as/h) bytes per layer
    (2-byte values, 1-byte dropout masks)."""
    return s * b * h * (34 + 5 * a * s / h)


def gpt_bytes(cfg, rows, setting):
    T, C, V, L, H = cfg.block_size, cfg.n_embd, cfg.vocab_size, cfg.n_layer, cfg.n_head
    return L * layer_bytes(T, rows, C, H, setting) + ends_bytes(rows * T, T, C, V)


def planner_check(cfg, rows):
    """The formula above equals minipar's planner (activations.layer_bytes, stage_bytes): if
    not, the grader is wrong, not the student."""
    for setting in ("none", "selective", "full"):
        mine = gpt_bytes(cfg, rows, setting)
        theirs = activations.stage_bytes(cfg, 0, 1, 1, rows, D, D, recompute=setting)
        layer = activations.layer_bytes(rows, cfg.block_size, cfg.n_embd, cfg.n_head, store=D, recompute=setting)
        assert mine == theirs and layer == layer_bytes(cfg.block_size, rows, cfg.n_embd, cfg.n_head, setting), \
            f"the grader's formula ({setting}: {mine} B) disagrees with minipar's planner ({theirs} B): a bug " \
            f"of the grader, not of your code"


_plain_held: list = []


def judge_memory(res):
    cfg, rows = drive.MEM_CFG, drive.MEM_B
    planner_check(cfg, rows)
    N, C, L = rows * drive.MEM_T, cfg.n_embd, cfg.n_layer
    held = res.get(0, "chain held")
    assert isinstance(held, int), f"the chain's record is {typename(held)} (tampered with?)"
    want, slack = L * N * C * D, L * 4096
    if held > want + slack and not _plain_held:                     # for the message: the plain chain's
        _plain_held.append(drive.held_by_chain(drive.plain)[0])
    assert held <= want + slack, \
        f"a chain of {L} checkpointed GPT blocks, x ({rows}, {drive.MEM_T}, {C}) float64: {held} bytes allocated " \
        f"in forward were still alive before backward; a checkpointed block keeps its input alone, so the " \
        f"chain holds the inputs of blocks 2..{L} and the output, {L} x B T C x 8 = {want} B (up to " \
        f"{slack} B more for Python's objects); the plain chain holds {_plain_held[0]} B. Is a graph (or a " \
        f"copy of x) kept somewhere, on self or elsewhere?"
    s, a = drive.MEM_T, cfg.n_head
    for setting in ("full", "selective"):
        got = res.get(0, key("gpt saved", setting))
        want = gpt_bytes(cfg, rows, setting)
        if got == want:
            continue
        plain = gpt_bytes(cfg, rows, "none")
        per = layer_bytes(s, rows, C, a, setting)
        raise AssertionError(
            f"a GPT (L={L}, C={C}, {a} heads, T={s}, {rows} sequences, float64) built for --recompute {setting}: "
            f"the loss graph's saved_bytes() is {got} B, want {want} B = {L} layers x {per} B ("
            + ("d sbh: each block's input, kept by your node's self.saved" if setting == "full" else
               "d sbh (20 + 2/h): all but the softmax; the attention core keeps its input qkv, 3 sbh")
            + f") + {want - L * per} B outside the blocks; without recomputation {plain} B, L x d sbh (20 + 2/h "
            f"+ as/h) + the same ends (Korthikanti's sbh (34 + 5as/h) = {korthikanti(s, rows, C, a):.0f} B per "
            f"layer in 2-byte values). "
            + ("More: something beyond x is saved (or x is saved twice)." if got > want else
               "Less: keep x in self.saved = (x,), which saved_bytes counts, not in an attribute of your own."))


# --- one more forward -------------------------------------------------------------------------

# each block's runs, in order: True when a graph was being recorded (the recomputation in
# backward, or a block run plainly), False under no_grad (a checkpoint's forward)
F, R = False, True
RUNS = {"one_mlp": {"mlp0": [F, R]}, "one_gpt_block": {"block0": [F, R]}, "no_parameters": {"gelu(x) x": [F, R]},
        "empty_batch": {"mlp0": [F, R]}, "under_no_grad": {"mlp0": [F]}, "output_used_twice": {"mlp0": [F, R]},
        "block_used_twice": {"block0": [F, F, R, R]}, "two_graphs_in_flight": {"mlp0": [F, F, R, R]},
        "chain": {"block0": [F, R], "block1": [F, R], "block2": [F, R]},
        "last_of_a_chain": {"block0": [R], "block1": [R], "block2": [F, R]},
        "data_input": {"block0": [R], "block1": [F, R]},
        "nested": {"outer": [F, R], "block0": [F, R], "block1": [F, F, R], "block2": [R]},
        "accumulated": {"mlp0": [F, R, F, R]}}


def flop_formula(L, B, T, C, V, mode):
    """Matrix-product FLOPs counted by drive.count_flops (the forwards of minipar's products,
    2 M N K each) over one forward and backward: the forward's, L (24 B T C^2 + 4 B T^2 C)
    (c_attn 6, c_proj 2, c_fc and mlp c_proj 8 + 8 B T C^2; Q K^T and P V 2 B T^2 C each) and
    the head's 2 B T C V; full adds every block's forward again, selective (the attention core
    checkpointed) its Q K^T and P V again, 4 B T^2 C a layer."""
    forward = L * (24 * B * T * C * C + 4 * B * T * T * C) + 2 * B * T * C * V
    return forward + {"none": 0, "full": L * (24 * B * T * C * C + 4 * B * T * T * C),
                      "selective": L * 4 * B * T * T * C}[mode]


def show_runs(flags) -> str:
    return "[" + ", ".join("graph" if f is True else "no_grad" if f is False else "?" for f in flags) + "]"


def judge_flops(res):
    for name, want in RUNS.items():
        got = res.get(0, key("runs", name))
        what = f"{name} ({drive.CASES[name][0]})"
        assert isinstance(got, dict), f"{what}: the record of the runs is {typename(got)} (tampered with?)"
        for label, flags in want.items():
            runs = got.get(label)
            if runs != flags:
                ran = show_runs(runs) if isinstance(runs, list) else f"{typename(runs)} (tampered with?)"
                raise AssertionError(
                    f"{what}: block {label} ran {len(runs) if isinstance(runs, list) else '?'} time(s), "
                    f"{ran}; want {show_runs(flags)}: a checkpointed "
                    f"block runs once under no_grad in forward and once recording its graph in backward, "
                    f"one more forward and no more")
    cfg, B = drive.FLOP_CFG, drive.FLOP_B
    L, T, C, V = cfg.n_layer, cfg.block_size, cfg.n_embd, cfg.vocab_size
    assert flop_formula(L, B, T, C, V, "full") - flop_formula(L, B, T, C, V, "none") == \
        recompute.added_flops(L, B, T, C, "full"), "the grader's FLOPs disagree with recompute.added_flops: " \
                                                   "a bug of the grader"
    for mode, calls in (("none", 0), ("full", L), ("selective", L)):
        got, seam = res.get(0, key("flops", mode)), res.get(0, key("seam calls", mode))
        want = flop_formula(L, B, T, C, V, mode)
        what = f"a GPT (L={L}, C={C}, T={T}, B={B}) built for --recompute {mode}"
        assert seam == calls, f"{what}: your checkpoint was called {seam} time(s), want {calls}"
        assert got == want, \
            f"{what}: {got} FLOPs of matrix products in one forward and backward, want {want} = the forward's " \
            f"{flop_formula(L, B, T, C, V, 'none')}" + \
            (f" + {want - flop_formula(L, B, T, C, V, 'none')} again ("
             + ("every block's forward once more" if mode == "full" else "each attention core's Q K^T and P V")
             + ")" if mode != "none" else "")


CRITERIA = [
    Criterion("one block against the plain block", run="gradients", judge=judge_one,
              timeout=60, uses=("checkpoint",),
              hint="forward runs the block under no_grad() and keeps x; backward runs it again on a leaf that "
                   "requires a gradient, recording (enable_grad), back-propagates once and returns the leaf's "
                   "gradient; under no_grad() or for data x, checkpoint returns run(x) itself"),
    Criterion("chains, reuse and accumulation", run="gradients",
              judge=judge_many, timeout=60, uses=("checkpoint",),
              hint="keep everything on self (one node per call), never on the class or in a global; "
                   "recompute from the kept input, not the output; run the block's backward once; "
                   "x without requires_grad: return run(x), so the block's own graph reaches its parameters"),
    Criterion("saved bytes against the formula", run="costs", judge=judge_memory, timeout=60,
              uses=("checkpoint",),
              hint="the forward must record nothing (no_grad) and keep x itself in self.saved = (x,): no graph, "
                   "no copy, nothing on self beyond x and run; minipar.tensor.Tensor.saved_bytes counts "
                   "what self.saved holds"),
    Criterion("one more forward per block", run="costs", judge=judge_flops, timeout=60,
              uses=("checkpoint",),
              hint="a checkpointed block runs twice: once in forward under no_grad, once in backward "
                   "recording its graph; not again for the input's gradient"),
    Criterion("trainer --pp 3 --recompute full", ranks=3,
              trainer=trainer_flags("--pp", "3", "--micro-batches", "2", "--recompute", "full", n_layer=3),
              timeout=120, uses=("checkpoint",),
              hint="every transformer block runs through your checkpoint, on 3 pipeline stages with 2 "
                   "micro-batches' graphs in flight (1F1B); each stage's first block gets the activation "
                   "received from the previous stage; the grader compares the run with one process"),
    Criterion("trainer --tp 2 --recompute selective", ranks=2,
              trainer=trainer_flags("--tp", "2", "--recompute", "selective"), timeout=120,
              uses=("checkpoint",),
              hint="every attention core (Q K^T, softmax, P V) runs through your checkpoint on this rank's "
                   "heads; the grader compares the run with one process"),
]
