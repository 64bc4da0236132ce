"""Lab 14's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): sequence_parallel.SequenceSplit's gather_linear (the fused f and
linear that its column and logits apply; its gather and scatter become the student's f),
row, replicated and tokens, the calls the model's family makes on a tp rank with --sp: every
gather and scatter along the sequence of the residual stream (f before each column-parallel
linear and the head, g-bar after each row-parallel linear and the embedding) and every
replicated parameter's gradient sum (GPT-2's LayerNorms and row-parallel biases, Llama's
RMSNorms) is then the student's. GPT-2's position rows (PositionsOfShard) stay minipar's.
Oracles, computed here in NumPy from the inputs the grader rebuilds from the cases' seeds
(drive.py): the concatenation of the ranks' tokens along axis 1, the sum of the ranks'
partial sums cut along axis 1, the adjoint identity, and the sum of the ranks' parameter
gradients. The child hands back what the student's code returned, the inputs as they were
afterwards, and what minipar.comm's ledger counted.
"""
import os

import numpy as np

from labs.framework import Criterion, first_difference, load_drive, place, trainer_flags
from labs.results import key, typename
from labs.scan import Allowed

TITLE = "sequence parallelism: the gather and scatter along the sequence, g and g-bar, the norms' gradient sum"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
OWN_REASON = "minipar's own sequence parallelism: this lab grades yours"
ALLOWED = Allowed(
    modules={"minipar.comm": {"Group", "all_gather", "reduce_scatter", "all_reduce"},
             "minipar.tensor": {"Function", "Tensor"},
             # named, with nothing given, so that each of their names is refused with its reason
             "minipar.parallel.tensor.sequence_parallel": set(), "minipar.parallel.tensor.tensor_parallel": set()},
    refused={**{f"minipar.parallel.tensor.sequence_parallel.{n}": OWN_REASON for n in (
        "gather_seq", "scatter_seq", "ScatterToSequence", "GatherSequenceLinear", "SequenceSplit",
        "SequenceParallelGPT", "PositionsOfShard")},
        "minipar.parallel.tensor.tensor_parallel.SumGradOver": OWN_REASON,
        **{f"minipar.parallel.tensor.tensor_parallel.{n}": "communicate with comm.all_gather, reduce_scatter and "
                                                         "all_reduce, as the handout says"
           for n in ("tp_all_reduce", "tp_collective")}})
# float32: the sums of multiples of 1/8 are exact; the adjoint's float64 inner products are
# sums in another order
ADJOINT_RTOL = 1e-12


def expect(got, want, what):
    """got == want exactly (the inputs are multiples of 1/8: every sum here is exact), its
    shape and dtype too."""
    if got is None:
        raise AssertionError(f"{what}: None (no gradient reached this tensor)")
    diff = first_difference(got, want, rtol=0.0, atol=0.0)
    assert diff is None, f"{what}: {diff}"


def untouched(res, wr, k, name, want, what):
    got = res.get(wr, k)
    assert isinstance(got, np.ndarray) and got.shape == want.shape and np.array_equal(got, want), \
        f"{what}: {name} was modified (leave the inputs as they are: build new arrays)"


def gathered(pieces):
    """The oracle of the gather: every rank's (B, m, ...) tokens, rank s at [s m, (s+1) m)."""
    return np.concatenate(pieces, axis=1)


def scattered(parts, r, p):
    """The oracle of the scatter: rank r's tokens of the sum of the ranks' (B, t, ...)."""
    total = np.sum([a.astype(np.float64) for a in parts], axis=0).astype(parts[0].dtype)
    m = total.shape[1] // p
    return total[:, r * m:(r + 1) * m]


def cases():
    """(layout index, sizes, world rank, group index, rank in group, p) of every rank."""
    for li, sizes in enumerate(drive.LAYOUTS):
        for wr in range(drive.WORLD):
            gi, r, p = place(sizes, wr)
            yield li, sizes, wr, gi, r, p


# --- the gather and the scatter on arrays ---------------------------------------------------

def judge_arrays(res):
    for li, sizes, wr, gi, r, p in cases():
        for i in range(len(drive.SHAPES)):
            for dtype in drive.DTYPES:
                pieces = [drive.gather_input(li, gi, s, i, dtype) for s in range(p)]
                what = drive.case_text("gather_sequence", p, sizes, r, pieces[r].shape, dtype)
                expect(res.get(wr, key("gather", li, wr, i, dtype)), gathered(pieces),
                       f"{what}: want (B, t, ...) = every rank's tokens along axis 1 (the sequence), rank s's "
                       f"at [s t/p, (s+1) t/p)")
                untouched(res, wr, key("gather", li, wr, i, dtype, "x after"), "x", pieces[r], what)
                parts = [drive.scatter_input(li, gi, s, i, dtype, p) for s in range(p)]
                what = drive.case_text("scatter_sequence", p, sizes, r, parts[r].shape, dtype)
                expect(res.get(wr, key("scatter", li, wr, i, dtype)), scattered(parts, r, p),
                       f"{what}: want (B, t/p, ...) = tokens [r t/p, (r+1) t/p) (axis 1) of the SUM of every rank's x")
                untouched(res, wr, key("scatter", li, wr, i, dtype, "x after"), "x", parts[r], what)


# --- the pairing: <F(x), dy> = <x, F*(dy)> over the ranks -------------------------------------

def judge_pairing(res):
    for li, sizes in enumerate(drive.LAYOUTS):
        for gi, p in enumerate(sizes):
            first = sum(sizes[:gi])
            for name in ("f", "g"):
                for i in drive.PAIRING_SHAPES:
                    fwd = bwd = 0.0
                    scale = 0.0
                    what_f = "GatherFromSequence" if name == "f" else "ScatterToSequence"
                    for r in range(p):
                        wr = first + r
                        x, dy = drive.pairing_inputs(name, li, gi, r, i, p)
                        what = drive.case_text(what_f, p, sizes, r, x.shape, "float64") + f", dy {dy.shape}"
                        k = key("pair", name, li, wr, i)
                        y, dx = res.get(wr, key(k, "y")), res.get(wr, key(k, "dx"))
                        for v, want, n in ((y, dy, "forward y"), (dx, x, "backward dL/dx")):
                            ok = isinstance(v, np.ndarray) and v.shape == want.shape and v.dtype == np.float64
                            shape = getattr(v, "shape", None)
                            assert ok, f"{what}: {n} is {typename(v)} {shape} {getattr(v, 'dtype', '')}, want " \
                                       f"float64 {want.shape} (backward maps dy back to x's shape)"
                        fwd += float(np.vdot(y, dy))
                        bwd += float(np.vdot(x, dx))
                        scale += float(np.abs(y).ravel() @ np.abs(dy).ravel() + np.abs(x).ravel() @ np.abs(dx).ravel())
                    lay = "+".join(map(str, sizes))
                    assert abs(fwd - bwd) <= ADJOINT_RTOL * max(scale, 1.0), \
                        f"{what_f} p={p} (layout {lay}) group {gi}, x {drive.pairing_inputs(name, li, gi, 0, i, p)[0].shape}: " \
                        f"sum over ranks of <F(x), dy> = {fwd!r} but of <x, F*(dy)> = {bwd!r} (difference " \
                        f"{abs(fwd - bwd):.3g}): backward is not forward's adjoint"


# --- g and g-bar in the graph, and the ledger -----------------------------------------------

def same_ledger(got, want, what, when):
    if not isinstance(got, dict):
        raise AssertionError(f"{what}: {when}, the ledger record is {typename(got)} (tampered with?)")
    assert got == want, f"{what}: {when}, minipar.comm counted {got} ({{operation: [calls, bytes sent]}}), " \
                        f"want {want}"


def judge_functions(res):
    for li, sizes, wr, gi, r, p in cases():
        for name in ("f", "g"):
            for i in drive.FUNCTION_SHAPES:
                for dtype in drive.DTYPES:
                    xs, dys = zip(*[drive.function_inputs(name, li, gi, s, i, dtype, p) for s in range(p)])
                    x, dy = xs[r], dys[r]
                    what_f = "GatherFromSequence" if name == "f" else "ScatterToSequence"
                    what = drive.case_text(what_f, p, sizes, r, x.shape, dtype) + f", dy {dy.shape}"
                    k = key(name, li, wr, i, dtype)
                    if name == "f":
                        y_want, dx_want = gathered(list(xs)), scattered(list(dys), r, p)
                        texts = ("forward y (every rank's tokens, along the sequence)",
                                 "backward dL/dx (this rank's tokens of the SUM of every rank's dy)")
                        ops = ("all_gather", (p - 1) * x.nbytes), ("reduce_scatter", (p - 1) * dy.nbytes // p)
                    else:
                        y_want, dx_want = scattered(list(xs), r, p), gathered(list(dys))
                        texts = ("forward y (this rank's tokens of the SUM of every rank's x)",
                                 "backward dL/dx (every rank's dy, gathered along the sequence)")
                        ops = ("reduce_scatter", (p - 1) * x.nbytes // p), ("all_gather", (p - 1) * dy.nbytes)
                    expect(res.get(wr, key(k, "y")), y_want, f"{what}: {texts[0]}")
                    expect(res.get(wr, key(k, "dx")), dx_want, f"{what}: {texts[1]}")
                    untouched(res, wr, key(k, "x after"), "the input x", x, what)
                    untouched(res, wr, key(k, "dy after"), "the gradient dy given to backward", dy, what)
                    for when, (op, nbytes) in zip(("in forward", "in backward"), ops):
                        got = res.get(wr, key(k, f"ledger {when.split()[1]}"))
                        if p == 1:
                            sent = sum(v[1] for v in got.values()) if isinstance(got, dict) else None
                            assert sent == 0, f"{what}: {when}, sent {sent} bytes: a rank alone sends nothing"
                        elif x.size:
                            same_ledger(got, {op: [1, nbytes]}, what,
                                        f"{when} (one comm.{op} of the array's own elements, in its dtype)")


# --- the replicated parameters' gradient sum --------------------------------------------------

def judge_replicated(res):
    for li, sizes, wr, gi, r, p in cases():
        for j, shape in enumerate(drive.PARAM_SHAPES):
            for dtype in drive.DTYPES:
                ins = [drive.param_inputs(li, gi, s, j, dtype) for s in range(p)]
                w, a, b, dy = ins[r]
                base = drive.case_text("SumGradOverTP", p, sizes, r, shape, dtype, "w")
                sent = {"all_reduce": 1} if p > 1 else {}
                for case, want in (("once", np.sum([v[3].astype(np.float64) for v in ins], axis=0)),
                                   ("twice", np.sum([((v[1] + v[2]) * v[3]).astype(np.float64) for v in ins], axis=0))):
                    what = base + (", used once (y = w)" if case == "once" else ", used twice (y = w a + w b)")
                    k = key(case, li, wr, j, dtype)
                    if case == "once":
                        expect(res.get(wr, key(k, "y")), w, f"{what}: forward (the parameter's values, unchanged)")
                    expect(res.get(wr, key(k, "dx")), want.astype(dtype),
                           f"{what}: backward dL/dw (the SUM over the {p} rank(s) of the group of each rank's "
                           f"gradient; not the mean, not this rank's alone, not summed twice)")
                    untouched(res, wr, key(k, "x after"), "the parameter", w, what)
                    if case == "once":
                        untouched(res, wr, key(k, "dy after"), "the gradient given to backward", dy, what)
                    for when, want_calls in (("forward", {}), ("backward", sent)):
                        got = res.get(wr, key(k, f"ledger {when}"))
                        calls = {op: v[0] for op, v in got.items()} if isinstance(got, dict) else got
                        assert calls == want_calls, \
                            f"{what}: in {when}, minipar.comm counted {calls} ({{operation: calls}}), want " \
                            f"{want_calls}: one all_reduce in backward per use of SumGradOverTP, none in forward" \
                            f"{' (a rank alone sends nothing)' if p == 1 else ''}"


TRAINER_HINT = "the grader compares the run with one process; the message names the parameter that differs most"

CRITERIA = [
    Criterion("gather and scatter along the sequence", ranks=4, run="arrays", judge=judge_arrays, timeout=40,
              uses=("gather_sequence", "scatter_sequence"),
              hint="the sequence is axis 1 of (B, t, ...): comm's collectives work on flat arrays in rank order, "
                   "so move the rank pieces to the front (np.moveaxis) around each; reduce_scatter sums "
                   "(never divide by p); keep the dtype; B may be 0"),
    Criterion("forward/backward pairing (the adjoint)", ranks=4, run="pairing", judge=judge_pairing, timeout=40,
              uses=("GatherFromSequence", "ScatterToSequence"),
              hint="f's backward is the reduce-scatter, g-bar's the all-gather (each the other's adjoint): "
                   "sum over ranks of <F(x), dy> equals that of <x, F*(dy)>; backward returns dx in x's shape"),
    Criterion("g and g-bar: values and the ledger", ranks=4, run="functions", judge=judge_functions, timeout=40,
              uses=("GatherFromSequence", "ScatterToSequence", "gather_sequence", "scatter_sequence"),
              hint="one comm.all_gather of x's own elements (p-1 times x's bytes sent), one comm.reduce_scatter "
                   "((p-1)/p of the array), nothing else: no all_reduce of a zero-padded (B, t, ...) buffer, "
                   "no float64 copies; minipar.comm.traffic shows what was counted"),
    Criterion("the replicated parameters' gradient sum", ranks=4, run="replicated", judge=judge_replicated,
              timeout=40, uses=("SumGradOverTP",),
              hint="each tp rank saw only its t/p tokens, so its gradient of a LayerNorm's weight is a partial "
                   "sum: comm.all_reduce it over the group in backward, once, a sum (not a mean), into a new "
                   "array (the gradient given to backward is not yours to modify)"),
    Criterion("trainer --tp 2 --sp", ranks=2, trainer=trainer_flags("--tp", "2", "--sp"), timeout=90,
              uses=("GatherFromSequence", "ScatterToSequence", "SumGradOverTP"),
              hint="GPT-2 on tp 2 with the sequence split: " + TRAINER_HINT + " (ln_1, ln_2, ln_f and the "
                   "row-parallel biases go through SumGradOverTP)"),
    Criterion("trainer --dp 2 --tp 2 --sp --arch llama", ranks=4,
              trainer=trainer_flags("--dp", "2", "--tp", "2", "--sp", "--arch", "llama"), timeout=90,
              uses=("GatherFromSequence", "ScatterToSequence", "SumGradOverTP"),
              hint="Llama (RMSNorm, no biases) on dp 2 x tp 2: the norms' gradients are summed over the tp "
                   "group only (the data-parallel sync averages over dp after): " + TRAINER_HINT),
]
