"""Lab 05's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): the four names of minipar/parallel/tensor/tensor_parallel.py that
TensorParallelGPT builds its layers from: CopyToTP (f) and ReduceFromTP (g), which copy_to_tp /
reduce_from_tp apply (the vocabulary-parallel embedding's g and the LM head's f use them too),
and ColumnParallelLinear and RowParallelLinear, which TensorParallelGPT's layers
(tensor_parallel.TensorSplit) construct when a parameter is first used, and keep. Every
all-reduce of tensor parallelism but the cross-entropy's three is then the student's.
Oracles, computed here from the inputs the grader rebuilds from the cases' seeds (drive.py):
the sums of every rank's x and dy (f and g), the full linear layer y = x @ W + b with its
textbook gradients in float64 (the layers), megatron_count and minipar's single-process GPT's
loss (the count). The child hands back what the student's code returned, the inputs as they
were afterwards, and what minipar's ledgers counted.
"""
import os

import numpy as np

from labs.framework import Criterion, first_difference, load_drive, place, trainer_flags
from labs.judging import scale_of
from labs.results import key, typename
from labs.scan import ANY, Allowed
from minipar.model.gpt import GPT
from minipar.parallel.tensor import tensor_parallel as tpar

TITLE = "Megatron's f and g, and the column- and row-parallel linear layers"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
OWN_REASON = "minipar's own f, g and layers: this lab grades yours"
ALLOWED = Allowed(
    modules={"minipar.comm": {"Group"}, "minipar.ops": ANY, "minipar.tensor": {"Function", "Tensor"},
             "minipar.parallel.tensor.tensor_parallel": {"tp_all_reduce", "traffic", "megatron_count"}},
    refused={**{f"minipar.parallel.tensor.tensor_parallel.{n}": OWN_REASON for n in (
        "CopyToTP", "ReduceFromTP", "ColumnParallelLinear", "RowParallelLinear", "copy_to_tp", "reduce_from_tp",
        "ParallelMLP", "ParallelAttention")},
        "minipar.parallel.tensor.tensor_parallel.tp_collective": "communicate only with tp_all_reduce, as the handout says",
        **{f"minipar.comm.{n}": "communicate only with tp_all_reduce: a bare comm collective is invisible to "
                                "tensor parallelism's ledger (tensor_parallel.traffic())"
           for n in ("all_reduce", "all_reduce_async", "untracked")}})
# float64 is judged to 1e-12 (the same sums in another order); float32 and float16 results
# against the float64 formulas on the same rounded inputs, relative to the tensor's scale
TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 5e-3}


def expect(got, want, what, tol=0.0, scale=None):
    """got == want (its dtype and shape too) within tol relative, and tol of `scale` (the
    tensor's largest entry by default) absolute: entries near 0 are sums that cancel."""
    if got is None:
        raise AssertionError(f"{what}: None (no gradient reached this tensor)")
    atol = tol * (scale_of(want) if scale is None else scale)
    diff = first_difference(got, want, rtol=tol, atol=atol)
    assert diff is None, f"{what}: {diff}"


def untouched(res, rank, k, name, want, what):
    after = res.get(rank, k)
    if isinstance(after, np.generic) and not isinstance(after, (np.bool_, np.object_)):
        after = np.asarray(after)                       # a 0-d array comes back as its scalar
    if not (isinstance(after, np.ndarray) and after.shape == want.shape and after.dtype == want.dtype
            and np.array_equal(after, want)):
        raise AssertionError(f"{what}: {name} was modified in place ({first_difference(after, want, rtol=0.0)}): "
                             f"the caller still needs it")


def same_ledger(got, want, what, when):
    """The ledgers a call left: tensor parallelism's {kind: [calls, elements]} and comm's
    {operation: calls}."""
    assert isinstance(got, dict) and isinstance(got.get("tp"), dict) and isinstance(got.get("comm"), dict), \
        f"{what}: the ledger record is {typename(got)} (tampered with?)"
    tp_got = {k: list(v) if isinstance(v, (list, tuple)) else v for k, v in got["tp"].items()}
    assert tp_got == want["tp"], \
        f"{what}: {when}, tensor_parallel.traffic() counted {tp_got} ({{kind: [calls, elements]}}), want " \
        f"{want['tp']}: f all-reduces once in backward, tp_all_reduce(group, grad, 'sum', 'f'), g once in " \
        f"forward, tp_all_reduce(group, x, 'sum', 'g'), and nothing else (a group of one sends nothing)"
    assert got["comm"] == want["comm"], \
        f"{what}: {when}, minipar.comm counted {got['comm']} ({{operation: calls}}), want {want['comm']}: " \
        f"every message through tp_all_reduce"


# --- f and g ----------------------------------------------------------------------------------

def sum_tol(dtype, tp) -> float:
    """A sum of tp terms in dtype, in another order: a few roundings."""
    return {"float64": 1e-12}.get(dtype, 2 * tp * float(np.finfo(np.dtype(dtype)).eps))


def f_and_g_wants(name, xs, dys, r, tp, dtype):
    """(y, dL/dx, y's tolerance, dx's tolerance, scale of y, scale of dx, the ledgers) of f or g."""
    total_x = np.sum([a.astype(np.float64) for a in xs], axis=0)
    total_dy = np.sum([a.astype(np.float64) for a in dys], axis=0)
    size = int(np.size(xs[0]))
    sent = {"tp": {name: [1, size]}, "comm": {"all_reduce": 1}} if tp > 1 else {"tp": {}, "comm": {}}
    nothing = {"tp": {}, "comm": {}}
    t = sum_tol(dtype, tp)
    if name == "f":
        return (xs[r], total_dy.astype(dtype), 0.0, t, None, scale_of(np.sum(np.abs(dys), axis=0)),
                nothing, sent)
    return (total_x.astype(dtype), dys[r], t, 0.0, scale_of(np.sum(np.abs(xs), axis=0)), None, sent, nothing)


def judge_f_and_g(res):
    for li, sizes in enumerate(drive.LAYOUTS):
        lay = "+".join(map(str, sizes))
        for wr in range(drive.WORLD):
            gi, r, tp = place(sizes, wr)
            for name in ("f", "g"):
                for i, shape in enumerate(drive.FG_SHAPES):
                    for dtype in drive.DTYPES:
                        what = f"{name} tp={tp} (layout {lay}) rank {r}: shape {shape} {dtype}"
                        xs = [drive.fg_input(li, gi, rr, i, dtype, 0) for rr in range(tp)]
                        dys = [drive.fg_input(li, gi, rr, i, dtype, 1) for rr in range(tp)]
                        judge_fg_case(res, wr, key(name, li, wr, i, dtype), name, xs, dys, r, tp, dtype, what)
                for dtype in drive.ALIAS_DTYPES:
                    what = f"{name} tp={tp} (layout {lay}) rank {r}: shape {drive.FG_SHAPES[0]} {dtype}, " \
                           f"y.backward(y.data) (dy is y's own array)"
                    xs = [drive.fg_input(li, gi, rr, 0, dtype, 0) for rr in range(tp)]
                    ys = [xs[rr] for rr in range(tp)] if name == "f" else \
                        [np.sum([a.astype(np.float64) for a in xs], axis=0).astype(dtype)] * tp
                    judge_fg_case(res, wr, key(name, li, wr, "alias", dtype), name, xs, ys, r, tp, dtype, what,
                                  alias=True)


def judge_fg_case(res, wr, k, name, xs, dys, r, tp, dtype, what, alias=False):
    """One call of f or g; alias: dy was y's own array (g's y is a sum: its last bit is
    comm's, so dy is judged against the y this rank recorded, and dx with the sum's tolerance)."""
    y_want, dx_want, y_tol, dx_tol, y_scale, dx_scale, fwd, bwd = f_and_g_wants(name, xs, dys, r, tp, dtype)
    if alias and name == "g":
        dx_tol, dx_scale = y_tol, y_scale
        y_got = res.get(wr, key(k, "y"))
        expect(y_got, y_want, f"{what}: forward y (want the sum of x over the group's ranks)", y_tol, y_scale)
        dys = [y_got] * tp
    y_is = "x" if name == "f" else "the sum of x over the group's ranks"
    dx_is = "the sum of dy over the group's ranks" if name == "f" else "dy"
    expect(res.get(wr, key(k, "y")), y_want, f"{what}: forward y (want {y_is})", y_tol, y_scale)
    same_ledger(res.get(wr, key(k, "ledger forward")), fwd, what, "in forward")
    expect(res.get(wr, key(k, "dx")), dx_want, f"{what}: backward dL/dx (want {dx_is})", dx_tol, dx_scale)
    same_ledger(res.get(wr, key(k, "ledger backward")), bwd, what, "in backward")
    untouched(res, wr, key(k, "x after"), "the input x", xs[r], what)
    untouched(res, wr, key(k, "dy after"), "the gradient dy given to backward", dys[r], what)


# --- the layers -------------------------------------------------------------------------------

_full: dict = {}


def full_linear(li, gi, i, dtype):
    """(x, W, b, dy) as drawn, and (y, dx, dW, db) of the full layer in float64."""
    k = (li, gi, i, dtype)
    if k not in _full:
        x, W, b, dy = drive.layer_inputs(li, gi, i, dtype)
        X, Wf, bf, dY = (a.astype(np.float64) for a in (x, W, b, dy))
        X2, dY2 = X.reshape(-1, X.shape[-1]), dY.reshape(-1, dY.shape[-1])
        _full[k] = (x, W, b, dy), (X @ Wf + bf, dY @ Wf.T, X2.T @ dY2, dY2.sum(0))
    return _full[k]


def judge_layer(res, kind):
    for li, sizes in enumerate(drive.LAYOUTS):
        for wr in range(drive.WORLD):
            gi, r, tp = place(sizes, wr)
            for i in drive.layer_cases(tp):
                for dtype in drive.DTYPES:
                    what = drive.layer_text(kind, tp, sizes, r, i, dtype)
                    (x, W, b, dy), (y, dx, dW, db) = full_linear(li, gi, i, dtype)
                    k, tol = key(kind, li, wr, i, dtype), TOL[dtype]
                    if kind == "column":
                        s = drive.shard(W.shape[1], tp, r)
                        where = f"this rank's columns {s.start}:{s.stop}"
                        wants = [("y", y[..., s], f"forward y ({where} of x @ W + b)"),
                                 ("dx", dx, "dL/dx (the whole gradient, on every rank)"),
                                 ("dW", dW[:, s], f"dL/dW of the shard (Cin, Cout/tp): {where}"),
                                 ("db", db[s], f"dL/db of the shard (Cout/tp,): {where}")]
                        inputs = [("x", x, "the input x"), ("W", W[:, s], "the weight"), ("b", b[s], "the bias"),
                                  ("dy", dy[..., s], "the gradient dy given to backward")]
                    else:
                        s = drive.shard(W.shape[0], tp, r)
                        where = f"this rank's rows {s.start}:{s.stop}"
                        wants = [("y", y, "forward y (the whole x @ W + b, on every rank)"),
                                 ("dx", dx[..., s], f"dL/dx of this rank's columns {s.start}:{s.stop}"),
                                 ("dW", dW[s], f"dL/dW of the shard (Cin/tp, Cout): {where}"),
                                 ("db", db, "dL/db (the whole bias gradient, on every rank)")]
                        inputs = [("x", x[..., s], "the input x"), ("W", W[s], "the weight"), ("b", b, "the bias"),
                                  ("dy", dy, "the gradient dy given to backward")]
                    for name, want, text in wants:
                        expect(res.get(wr, key(k, name)), want.astype(dtype), f"{what}: {text}", tol)
                    for name, want, text in inputs:
                        untouched(res, wr, key(k, name, "after"), text, np.ascontiguousarray(want), what)


def judge_column(res):
    judge_layer(res, "column")


def judge_row(res):
    judge_layer(res, "row")


# --- the count --------------------------------------------------------------------------------

_losses: dict = {}


def single_process_loss(tp, dtype):
    """minipar's own GPT on one process, with the same initial weights: the loss of the
    counting micro-batch."""
    if (tp, dtype) not in _losses:
        idx, targets = drive.count_ids(tp)
        _losses[(tp, dtype)] = float(GPT(drive.COUNT_CFG, seed=0, dtype=np.dtype(dtype))(idx, targets).item())
    return _losses[(tp, dtype)]


def calls_of(ledger, op="all_reduce"):
    c = ledger.get("comm", {}).get(op, 0) if isinstance(ledger, dict) and isinstance(ledger.get("comm"), dict) else None
    return c if isinstance(c, int) else None


def judge_count(res):
    cfg, B, t = drive.COUNT_CFG, drive.COUNT_B, drive.COUNT_T
    L, C = cfg.n_layer, cfg.n_embd
    calls, elements = tpar.megatron_count(cfg, B, t)
    for tp in drive.COUNT_TPS:
        for wr in range(drive.WORLD):
            for dtype in drive.COUNT_DTYPES:
                k = key("count", tp, wr, dtype)
                what = f"tp={tp} rank {wr % tp}, L={L} B={B} t={t} C={C} {dtype}, one forward + backward"
                built = res.get(wr, key(k, "built"))
                assert isinstance(built, list) and built and all(v is True for v in built), \
                    f"{what}: the model was not built from your layers ({built!r:.200}): a lab bug?"
                fwd, total = res.get(wr, key(k, "ledger forward")), res.get(wr, key(k, "ledger total"))
                forward, everything = calls_of(fwd), calls_of(total)
                assert forward is not None and everything is not None, \
                    f"{what}: the ledger record is {typename(fwd)} / {typename(total)} (tampered with?)"
                others = sorted(set(total["comm"]) - {"all_reduce"})
                assert not others, f"{what}: minipar.comm also counted {others}: tensor parallelism all-reduces, " \
                                   f"and only with tp_all_reduce"
                backward = everything - forward
                assert (forward, backward) == (2 * L + 4, 2 * L + 1), \
                    f"{what}: {forward} all-reduces forward and {backward} backward, {everything} in all; " \
                    f"Megatron's count is 2L+4 = {2 * L + 4} forward (the layers' g's, the embedding's g, the " \
                    f"cross-entropy's 3) and 2L+1 = {2 * L + 1} backward (the f's), 4L+5 = {calls}; by kind " \
                    f"{total.get('tp')!r:.300}"
                kinds = total.get("tp")
                kinds = {n: v[0] for n, v in kinds.items() if isinstance(v, (list, tuple)) and v} \
                    if isinstance(kinds, dict) else kinds
                want = {"f": 2 * L + 1, "g": 2 * L + 1, "cross_entropy": 3}
                assert kinds == want, f"{what}: tensor_parallel.traffic() counted {kinds!r:.300}, want {want}: " \
                                      f"call tp_all_reduce(group, x, 'sum', 'f') in f and ... 'g') in g"
                counted = sum(v[1] for v in total["tp"].values())
                assert counted == elements, f"{what}: {counted} elements all-reduced, Megatron's (4L+2) B t C + " \
                                            f"3 B t = {elements}"
                if tp == 2:                         # at tp = 2 an all-reduce of n bytes sends n bytes
                    sent = res.get(wr, key(k, "bytes total"))
                    size = np.dtype(dtype).itemsize
                    for kind in ("f", "g"):
                        n = total["tp"][kind][1]
                        got = sent.get(kind) if isinstance(sent, dict) else None
                        assert got == n * size, \
                            f"{what}: the {kind} all-reduces sent {got!r} bytes for {n} elements of {dtype}, want " \
                            f"{n * size} ({size} bytes each): all-reduce the activations in their own dtype"
                loss, want_loss = res.get(wr, key(k, "loss")), single_process_loss(tp, dtype)
                rtol = 1e-10 if dtype == "float64" else 1e-4
                assert isinstance(loss, float) and np.isclose(loss, want_loss, rtol=rtol, atol=0.0), \
                    f"{what}: the loss is {loss!r}, the single-process GPT's {want_loss!r} (rtol {rtol:g})"


CRITERIA = [
    Criterion("f and g against NumPy", ranks=4, run="f_and_g", judge=judge_f_and_g, timeout=40,
              uses=("CopyToTP", "ReduceFromTP"),
              hint="f: forward returns x, backward sums the gradient over the group; g the other way "
                   "round. Each rank's x and dy differ here, so a sum in the wrong pass shows; keep "
                   "the arrays' dtype (float32 stays float32) and let a group of one rank work too"),
    Criterion("column-parallel vs full linear", ranks=4, run="column", judge=judge_column, timeout=40,
              uses=("ColumnParallelLinear", "CopyToTP"),
              hint="x goes through f before the matmul: each rank's columns give only part of dL/dx "
                   "(minipar.parallel.tensor.tensor_parallel.ColumnParallelLinear's docstring); x may be "
                   "(B, t, Cin) or (N, Cin), as for ops.linear"),
    Criterion("row-parallel vs full linear", ranks=4, run="row", judge=judge_row, timeout=40,
              uses=("RowParallelLinear", "ReduceFromTP"),
              hint="g sums the partial products x_r @ W_r; the bias is added once, after the sum "
                   "(added before it, every rank's copy would be summed: tp times the bias), by every "
                   "rank, tp = 1 included"),
    Criterion("4L+5 all-reduces per micro-batch", ranks=4, run="count", judge=judge_count, timeout=40,
              uses=("CopyToTP", "ReduceFromTP", "ColumnParallelLinear", "RowParallelLinear"),
              hint="2 per layer forward (g) and 2 backward (f), and nothing else in the layers; "
                   "minipar.parallel.tensor.tensor_parallel.megatron_count is the formula, "
                   "minipar.parallel.tensor.tensor_parallel.traffic what was sent, by kind"),
    Criterion("trainer --tp 4", ranks=4, trainer=trainer_flags("--tp", "4", n_head=4), timeout=90,
              uses=("CopyToTP", "ReduceFromTP", "ColumnParallelLinear", "RowParallelLinear"),
              hint="tp 4 for 3 steps against the grader's single-process run: every operation on a "
                   "parameter belongs in __call__, where each step's graph is built; the message names "
                   "the parameter that differs most"),
    Criterion("trainer --tp 4 float32", ranks=4, trainer=trainer_flags("--tp", "4", n_head=4, dtype="float32"),
              timeout=90, uses=("CopyToTP", "ReduceFromTP", "ColumnParallelLinear", "RowParallelLinear"),
              hint="the same in float32 (the twin's tolerance is float32's): your f, g and layers get "
                   "float32 arrays and must hand back float32 ones"),
    Criterion("trainer --tp 2", ranks=4, trainer=trainer_flags("--tp", "2", n_head=4), timeout=90,
              uses=("CopyToTP", "ReduceFromTP", "ColumnParallelLinear", "RowParallelLinear"),
              hint="dp 2 x tp 2 for 3 steps against one process: the data-parallel buckets wait "
                   "for every parameter's gradient, so one that never arrives stops the step"),
]
