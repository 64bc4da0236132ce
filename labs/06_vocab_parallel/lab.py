"""Lab 06's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): the two names of minipar/parallel/tensor/tensor_parallel.py the vocabulary-
parallel ends of TensorParallelGPT use: VocabParallelEmbedding, which TensorParallelGPT's layers
(tensor_parallel.TensorSplit) construct when it first runs, and vocab_parallel_cross_entropy,
which its loss calls. The embedding's all-reduce (kind g) and the
cross-entropy's three (kind cross_entropy) are then the student's.
Oracle: NumPy here, on the full, unpadded tensors the grader rebuilds from the cases' seeds
(drive.table, drive.ids_for, drive.full_logits, ...): W[ids] and the scatter-add of dy for
the embedding, the softmax cross-entropy with its max-shifted log-sum-exp for the loss, in
float64 (from the float32 inputs for the float32 cases). The child only hands back what each
rank's call returned, the gradients as the student's backward returned them, the inputs as
they were afterwards, and the ledgers' counts. The trainer criteria are judged against the
grader's own single-process twin (labs/twin.py), and the run's summary against Megatron's
4L + 5 all-reduces per step.
"""
import os

import numpy as np

from labs.framework import Criterion, first_difference, load_drive, trainer_flags
from labs.results import key, typename
from labs.scan import Allowed

TITLE = "the vocabulary-parallel embedding and cross-entropy"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
OWN_REASON = "minipar's own vocabulary-parallel code: this lab grades yours"
ALLOWED = Allowed(
    modules={"minipar.comm": {"Group"}, "minipar.tensor": {"Function", "Tensor"},
             "minipar.parallel.tensor.tensor_parallel": {"tp_all_reduce", "traffic", "reset_traffic"}},
    refused={**{f"minipar.parallel.tensor.tensor_parallel.{n}": OWN_REASON for n in (
        "MaskedEmbedding", "ReduceFromTP", "reduce_from_tp", "VocabParallelEmbedding", "VocabParallelCrossEntropy",
        "vocab_parallel_cross_entropy")},
        "minipar.parallel.tensor.tensor_parallel.tp_collective": "communicate only with tp_all_reduce, as the handout says",
        **{f"minipar.comm.{n}": "communicate only with tp_all_reduce: a bare comm collective is invisible to "
                                "tensor parallelism's ledger (tensor_parallel.traffic())"
           for n in ("all_reduce", "all_reduce_async", "all_gather", "reduce_scatter", "broadcast", "reduce")}})
TOL = {"float64": 1e-12, "float32": 1e-5}               # relative, and of the tensor's largest entry absolute


def close(got, want, dtype, what):
    """got (of `dtype`) == want (float64) to TOL[dtype]; entries near zero judged on the
    tensor's scale (sums reordered, float32 rounding)."""
    assert got is not None, f"{what}: None (no gradient came back)"
    assert isinstance(got, np.ndarray), f"{what}: got {typename(got)} {got!r:.100}, want an array of {dtype}"
    if got.dtype != np.dtype(dtype):
        raise AssertionError(f"{what}: dtype {got.dtype}, want {dtype} (the input's dtype: a float64 constant or "
                             f"np.zeros without dtype= widens the result)")
    tol = TOL[dtype]
    want = np.asarray(want, dtype=np.float64)
    atol = tol * float(np.abs(want).max()) if want.size else 0.0
    diff = first_difference(got, want.astype(dtype), rtol=tol, atol=atol)
    assert diff is None, f"{what}: {diff}"


INPUTS = {"ids after": "the ids", "w after": "the weight shard", "logits after": "the logits",
          "targets after": "the targets"}


def unchanged(res, w, k, name, given, what):
    """The input as the child saw it after the call equals the input given (bit for bit)."""
    after = res.get(w, key(k, name))
    if not (isinstance(after, np.ndarray) and after.shape == given.shape and after.dtype == given.dtype
            and np.array_equal(after, given)):
        diff = first_difference(after, given, rtol=0.0)
        raise AssertionError(f"{what}: {INPUTS[name]} modified in place ({diff}): the caller still needs them")


def floats(a, shape) -> bool:
    """a is a float array of `shape` (so its padding can be looked at)."""
    return isinstance(a, np.ndarray) and a.dtype.kind == "f" and a.shape == shape


def tensor_of(res, w, k, what, call):
    assert res.get(w, key(k, "tensor")) is True, f"{what}: {call} did not return a minipar Tensor"


# --- the judges -------------------------------------------------------------------------------

def judge_embedding(res):
    """VocabParallelEmbedding on rank r's rows of the padded table against W[ids] and the
    scatter-add of dy into W's rows."""
    for tp in drive.TPS:
        for ranks in drive.members(tp):
            for V, dtype, shape, idt in drive.embedding_cases(tp):
                W = drive.table(V, dtype)
                ids = drive.ids_for(V, tp, shape, idt)
                dy = drive.upstream_dy(V, tp, shape, dtype)
                Vp, n, _, _ = drive.layout(V, tp, 0)
                dW = np.zeros((Vp, drive.C))
                np.add.at(dW, ids, dy.astype(np.float64))             # repeated ids add up
                for r, w in enumerate(ranks):
                    _, _, start, valid = drive.layout(V, tp, r)
                    padded = np.zeros((Vp, drive.C), dtype=dtype)
                    padded[:V] = W
                    what = drive.embedding_text(tp, r, V, dtype, shape, idt) + (f" (world rank {w})" * (tp > 1))
                    k = key("emb", tp, w, V, dtype, shape, idt)
                    tensor_of(res, w, k, what, "VocabParallelEmbedding(weight, vocab_start, group)(idx)")
                    y = res.get(w, key(k, "y"))
                    close(y, W[ids], dtype, f"{what}: forward (want W[ids], the whole rows, on every rank)")
                    aliases = res.get(w, key(k, "y aliases"))
                    assert aliases == [], f"{what}: the output shares memory with {aliases!r}: return a new array"
                    dw = res.get(w, key(k, "dw"))
                    if floats(dw, (n, drive.C)) and valid < n:
                        pad = dw[valid:]
                        bad = np.nonzero(np.any(pad != 0, axis=-1))[0]
                        assert not bad.size, \
                            f"{what}: gradient in padding row(s) {(start + valid + bad).tolist()} (ids >= V={V} " \
                            f"never occur; these rows must stay exactly zero), got e.g. {pad[bad[0]].tolist()}"
                    close(dw, dW[start:start + n], dtype,
                          f"{what}: dL/dW of this rank's rows {start}:{start + n} (the scatter-add of dy over the "
                          f"ids it owns, zero elsewhere)")
                    unchanged(res, w, k, "ids after", ids, what)
                    unchanged(res, w, k, "w after", padded[start:start + n], what)
                ys = [res.get(w, key("emb", tp, w, V, dtype, shape, idt, "y")) for w in ranks]
                for r in range(1, len(ranks)):
                    assert ys[r].tobytes() == ys[0].tobytes(), \
                        f"{drive.embedding_text(tp, r, V, dtype, shape, idt)}: the output differs from tp rank " \
                        f"0's: every tp rank must get the same, bit for bit"


def cross_entropy_oracle(Z, targets, denom, upstream):
    """The full softmax cross-entropy of Z (N, V) in float64, max-shifted, and its gradient."""
    m = Z.max(-1, keepdims=True)
    e = np.exp(Z - m)
    s = e.sum(-1, keepdims=True)
    rows = np.arange(Z.shape[0])
    loss = (np.log(s[:, 0]) - (Z[rows, targets] - m[:, 0])).sum() / denom
    d = e / s
    d[rows, targets] -= 1.0
    return loss, d * (upstream / denom)


def judge_cross_entropy(res):
    """vocab_parallel_cross_entropy on rank r's columns of the padded logits (padded columns
    -inf, as MaskColumns leaves them) against the full softmax cross-entropy."""
    for tp in drive.TPS:
        for ranks in drive.members(tp):
            for V, dtype, shape, tdt, scale, d in drive.cross_entropy_cases(tp):
                N = int(np.prod(shape))
                Z = drive.full_logits(V, tp, N, scale, dtype)
                targets = drive.ids_for(V, tp, shape, tdt)
                denom = drive.denom_of(d, N)
                want_loss, want_d = cross_entropy_oracle(Z.astype(np.float64), targets.reshape(-1).astype(np.int64),
                                                         N if denom is None else denom, drive.UPSTREAM)
                Vp, n, _, _ = drive.layout(V, tp, 0)
                padded = np.full((N, Vp), -np.inf, dtype=dtype)
                padded[:, :V] = Z
                full_d = np.zeros((N, Vp))
                full_d[:, :V] = want_d
                losses = []
                for r, w in enumerate(ranks):
                    _, _, start, valid = drive.layout(V, tp, r)
                    what = drive.cross_entropy_text(tp, r, V, dtype, shape, tdt, scale, d) + \
                        (f" (world rank {w})" if tp > 1 else "")
                    k = key("ce", tp, w, V, dtype, shape, tdt, scale, d)
                    tensor_of(res, w, k, what, "vocab_parallel_cross_entropy")
                    loss = res.get(w, key(k, "loss"))
                    assert isinstance(loss, np.ndarray) and loss.shape == (), \
                        f"{what}: the loss is {typename(loss)} {getattr(loss, 'shape', '')}, want a 0-d array"
                    close(loss, np.asarray(want_loss), dtype,
                          f"{what}: the loss (sum over rows of log sum exp - target logit, / "
                          f"{'rows' if denom is None else 'loss_denom'})")
                    losses.append((r, loss))
                    got = res.get(w, key(k, "dlogits"))
                    if floats(got, (*shape, n)) and valid < n:
                        pad = got[..., valid:]
                        assert not np.any(pad) and not np.isnan(pad).any(), \
                            f"{what}: gradient in the padded columns {start + valid}:{start + n} (ids >= V={V}; " \
                            f"they hold -inf, probability 0, and must get exactly 0), got e.g. {pad.ravel()[:3]}"
                    close(got, full_d[:, start:start + n].reshape(*shape, n), dtype,
                          f"{what}: dL/dlogits of this rank's columns (softmax - onehot) x {drive.UPSTREAM} / "
                          f"{'rows' if denom is None else 'loss_denom'}")
                    unchanged(res, w, k, "logits after", padded[:, start:start + n].reshape(*shape, n), what)
                    unchanged(res, w, k, "targets after", targets, what)
                r0, first = losses[0]
                for r, loss in losses[1:]:
                    assert loss.tobytes() == first.tobytes(), \
                        f"{drive.cross_entropy_text(tp, r, V, dtype, shape, tdt, scale, d)}: the loss {loss!r} " \
                        f"differs from tp rank 0's {first!r}: every tp rank must get the same, bit for bit"


def judge_count(res):
    """One call each, by minipar's ledgers: the embedding 1 all-reduce (sum, kind g, B t C
    elements) forward and none backward; the cross-entropy 3 (max, sum, sum, kind
    cross_entropy, B t elements each) forward and none backward; then TensorParallelGPT built
    with both (L = 1): Megatron's 4L + 5 by kind (f 2L + 1, g 2L + 1, cross_entropy 3)."""
    bt = int(np.prod(drive.COUNT_SHAPE))
    C = drive.C
    for tp in drive.TPS:
        if tp == 1:
            continue
        V = drive.VOCABS[tp][-1]
        for ranks in drive.members(tp):
            for r, w in enumerate(ranks):
                Vp, n, _, _ = drive.layout(V, tp, r)
                for part, text, kinds, ops in (
                        ("emb", f"embedding tp={tp} rank {r} V={V} ids {drive.COUNT_SHAPE} C={C}",
                         {"g": [1, bt * C]}, [["sum", "g", bt * C]]),
                        ("ce", f"cross-entropy tp={tp} rank {r} V={V} logits {(*drive.COUNT_SHAPE, n)}",
                         {"cross_entropy": [3, 3 * bt]}, [["max", "cross_entropy", bt], ["sum", "cross_entropy", bt],
                                                          ["sum", "cross_entropy", bt]])):
                    what = f"{text}, one forward + backward"
                    got = res.get(w, key("count", part, tp, w))
                    assert isinstance(got, dict), f"{what}: the counts came back as {typename(got)} (tampered with?)"
                    forward, backward = got.get("forward"), got.get("backward")
                    assert (forward, backward) == (len(ops), 0), \
                        f"{what}: {forward} all-reduces forward and {backward} backward, want {len(ops)} and 0 " \
                        f"(tensor_parallel.traffic() by kind, [calls, elements]: {got.get('kinds')})"
                    assert got.get("kinds") == kinds, \
                        f"{what}: tensor_parallel.traffic() counted [calls, elements] {got.get('kinds')}, want " \
                        f"{kinds}: every all-reduce through tp_all_reduce(group, x, op, kind)"
                    seen = got.get("ops")
                    ok = isinstance(seen, list) and all(isinstance(s, list) for s in seen)
                    assert ok and sorted(map(tuple, seen), key=repr) == sorted(map(tuple, ops), key=repr), \
                        f"{what}: tp_all_reduce calls (op, kind, elements) {seen}, want {ops} in some order"
                heads, width = drive.MODEL_CFG[tp]
                case = f"TensorParallelGPT tp={tp} rank {r} (V=256, Vp={-(-256 // tp) * tp}) L=1"
                assert res.get(w, key("count", "model yours", tp, w)) is True, \
                    f"{case}: the model's forward did not run your embedding and cross-entropy once each"
                kinds = res.get(w, key("count", "model", tp, w))
                want = {"f": 3, "g": 3, "cross_entropy": 3}
                assert kinds == want, f"{case} with your embedding and cross-entropy, one forward + backward: " \
                                      f"tensor_parallel.traffic() counted {kinds}, Megatron's 4L+5 by kind is {want}"


def judge_summary(run):
    """The run's summary: tensor parallelism's all-reduces per step are Megatron's 4L + 5."""
    tp = run.summary.get("tensor_parallel") if isinstance(run.summary, dict) else None
    assert isinstance(tp, dict), f"the run's summary holds no tensor_parallel figures: {str(run.summary)[:200]}"
    calls, want = tp.get("all_reduces_per_step"), tp.get("megatron_all_reduces_per_step")
    assert isinstance(calls, (int, float)) and isinstance(want, (int, float)) and calls == want, \
        f"tensor parallelism's ledger counted {calls!r} all-reduces per step, Megatron's (4L+5) x micro-batches is " \
        f"{want!r}: every all-reduce through tp_all_reduce, none in backward"


CRITERIA = [
    Criterion("embedding vs full lookup", ranks=4, run="embedding", judge=judge_embedding, timeout=60,
              uses=("VocabParallelEmbedding",),
              hint="ids outside [vocab_start, vocab_start + rows) must give zero rows before the sum "
                   "(exactly one rank contributes each token); backward adds dy into the owned rows "
                   "only, repeated ids adding up (np.add.at, not w[rows] += ...); float32 in, float32 out; "
                   "minipar.parallel.tensor.tensor_parallel.MaskedEmbedding's docstring"),
    Criterion("cross-entropy vs full softmax", ranks=4, run="cross_entropy", judge=judge_cross_entropy, timeout=60,
              uses=("vocab_parallel_cross_entropy",),
              hint="the max must be the global one (op 'max') before any exp; the target logit comes "
                   "from the one rank that owns it, the others add 0; divide by loss_denom when given; "
                   "padded columns are -inf, exp gives them 0 (do not replace -inf); with one rank "
                   "tp_all_reduce hands back its input itself; "
                   "minipar.parallel.tensor.tensor_parallel.VocabParallelCrossEntropy's docstring"),
    Criterion("all-reduces per call", ranks=4, run="count", judge=judge_count, timeout=60,
              uses=("VocabParallelEmbedding", "vocab_parallel_cross_entropy"),
              hint="the embedding 1 (sum, kind 'g') and the cross-entropy 3 (max, sum, sum, kind "
                   "'cross_entropy'), all forward, none backward; "
                   "minipar.parallel.tensor.tensor_parallel.traffic shows what you sent, by kind"),
    Criterion("trainer --tp 4", ranks=4, trainer=trainer_flags("--tp", "4", n_head=4), judge=judge_summary,
              timeout=90, uses=("VocabParallelEmbedding", "vocab_parallel_cross_entropy"),
              hint="tp 4 for 3 steps against the grader's own single-process run: read the weight in "
                   "__call__ each time, the optimizer updates it in place after every step"),
    Criterion("trainer --tp 2 (dp 2) float32", ranks=4, trainer=trainer_flags("--tp", "2", n_head=4, dtype="float32"),
              judge=judge_summary, timeout=90, uses=("VocabParallelEmbedding", "vocab_parallel_cross_entropy"),
              hint="dp 2 x tp 2 in float32 for 3 steps against one process: the tp groups are halves of "
                   "the world, and float32 in gives float32 out"),
]
