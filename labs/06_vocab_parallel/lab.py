"""Lab 06's seam and criteria (labs/framework.py says what a lab is).

Seam: the two names of minipar/parallel/tensor_parallel.py the vocabulary-parallel ends of
TensorParallelGPT use: VocabParallelEmbedding, which TensorParallelGPT.__init__ constructs
(so install() runs before the model is built), and vocab_parallel_cross_entropy, which
TensorParallelGPT.loss calls. The embedding's all-reduce (kind g) and the cross-entropy's
three (kind cross_entropy) are then the student's.
Oracle: NumPy on the full, unpadded tensors (the table W (V, C) and the logits Z (N, V)):
W[ids] and the scatter-add of dy for the embedding, the softmax cross-entropy with its
max-shifted log-sum-exp for the loss, in float64, on tp groups of 2 (two of them) and 4 cut
from 4 ranks, and of 3 (ranks 0..2, rank 3 sits out) where tp does not divide V.
"""
import numpy as np
from mpi4py import MPI

from labs import framework
from labs.framework import Criterion, collective_uses, trainer_flags
from minipar import comm
from minipar.model import GPTConfig
from minipar.parallel import tensor_parallel as tpar
from minipar.tensor import Tensor

TITLE = "the vocabulary-parallel embedding and cross-entropy"
RTOL = 1e-12
C = 4                                                   # embedding width
VOCABS = {2: (16, 13), 4: (16, 13), 3: (10, 4)}         # V per tp: divisible, padded; tp=3 V=4: rank 2 all padding
B, T = 2, 9                                             # rows of ids/logits (B, T) besides the edge ids
SCALES = (3.0, 1e4)                                     # logits ~ N(0, 3^2), and +-1e4 (+ noise): exp overflows naively


def groups():
    """(tp, Group or None) for tp = 2 (ranks {0, 1} and {2, 3} at once), 4, and 3 (ranks 0..2;
    rank 3 gets None and sits the case out)."""
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    for tp in (2, 4, 3):
        color = rank // tp if tp != 3 else (0 if rank < 3 else MPI.UNDEFINED)
        sub = world.Split(color, rank)
        if sub == MPI.COMM_NULL:
            yield tp, None
            continue
        g = comm.Group(sub)
        sub.Free()
        yield tp, g
        g.comm.Free()


def layout(V, tp, r):
    """(Vp, n = Vp/tp, start, valid): the padding of TensorParallelGPT for rank r."""
    Vp = -(-V // tp) * tp
    n = Vp // tp
    start = r * n
    return Vp, n, start, min(max(V - start, 0), n)


def edge_ids(V, tp, size):
    """Every shard's edges: vocab_start - 1, vocab_start, its last valid row; 0 and V - 1;
    then random ids (repeats included) up to `size`, shuffled, all in [0, V)."""
    Vp, n, _, _ = layout(V, tp, 0)
    edges = {0, V - 1}
    for s in range(tp):
        start = s * n
        edges |= {start - 1, start, min(start + n, V) - 1}
    edges = sorted(e for e in edges if 0 <= e < V)
    rng = np.random.default_rng([V, tp, size])
    ids = np.concatenate([edges, edges[:3], rng.integers(0, V, size=max(size - len(edges) - 3, 0))])
    return rng.permutation(ids)[:max(size, len(edges))].astype(np.int64)


def expect(got, want, what):
    """got == want to RTOL, entries near zero judged on the tensor's scale (sums reordered)."""
    assert got is not None, f"{what}: None (no gradient reached this tensor)"
    want = np.asarray(want)
    atol = RTOL * float(np.abs(want).max()) if want.size else 0.0
    framework.expect(got, want, what, rtol=RTOL, atol=atol)


def call(what, fn, *args):
    """fn(*args); an exception in the student's code becomes a failure naming the case and
    the line of their file it came from."""
    try:
        return fn(*args)
    except Exception as e:                      # noqa: BLE001 - the student's code failed on this case
        import traceback                        # noqa: PLC0415
        where = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.endswith("student.py")]
        at = f" (student.py:{where[-1].lineno})" if where else ""
        raise AssertionError(f"{what}: {type(e).__name__}: {e}{at}") from e


def unchanged(a, keep, what):
    assert np.array_equal(a, keep), f"{what} was modified in place (the caller still needs it)"


def same_on_every_rank(g, x, what):
    x = np.ascontiguousarray(x, dtype=np.float64).reshape(-1)
    out = np.empty((g.size, x.size))
    g.comm.Allgather(x, out)
    bad = [s for s in range(g.size) if not np.array_equal(out[s], out[0])]
    assert not bad, f"{what} differs between tp rank 0 and tp rank {bad[0]} (first of {bad}): " \
                    f"every tp rank must get the same, bit for bit"


# --- the criteria -------------------------------------------------------------------------

def check_static(student):
    """The student's file calls no MPI collective (the scan minipar's own code passes)."""
    found = collective_uses(student)
    assert not found, "calls MPI's own collectives: " + "; ".join(found[:3])


def check_embedding(student):
    """VocabParallelEmbedding on rank r's rows of the padded table against W[ids] and the
    scatter-add of dy into W's rows."""
    for tp, g in groups():
        if g is None:
            continue
        r = g.rank
        for V in VOCABS[tp]:
            Vp, n, start, valid = layout(V, tp, r)
            W = np.random.default_rng([1, V]).standard_normal((V, C))
            padded = np.zeros((Vp, C))
            padded[:V] = W
            ids = edge_ids(V, tp, B * T).reshape(B, -1)
            dy = np.random.default_rng([2, V, tp]).standard_normal((*ids.shape, C))   # the same on every rank
            what = (f"embedding tp={tp} rank {r} V={V} (Vp={Vp}, rows {start}:{start + n} here, {valid} valid) "
                    f"ids {ids.shape} float64")
            weight = Tensor(padded[start:start + n].copy(), requires_grad=True)
            keep_ids, keep_w = ids.copy(), weight.data.copy()
            y = call(f"{what}: forward", lambda: student.VocabParallelEmbedding(weight, start, g)(ids))
            assert isinstance(y, Tensor), f"{what}: returned {type(y).__name__}, want a Tensor"
            expect(y.data, W[ids], f"{what}: forward (want W[ids], the whole rows, on every rank)")
            call(f"{what}: backward", y.backward, dy.copy())
            dW = np.zeros((Vp, C))
            np.add.at(dW, ids, dy)                    # repeated ids add up
            mine = dW[start:start + n]
            if valid < n:
                pad = weight.grad[valid:] if weight.grad is not None else None
                assert pad is None or not np.any(pad), \
                    f"{what}: gradient in padding row(s) {start + valid + np.argwhere(pad.any(-1)).ravel()} " \
                    f"(ids >= V={V} never occur; these rows must stay exactly zero)"
            expect(weight.grad, mine, f"{what}: dL/dW of this rank's rows {start}:{start + n} "
                                      f"(the scatter-add of dy over the ids it owns, zero elsewhere)")
            unchanged(ids, keep_ids, f"{what}: the ids")
            unchanged(weight.data, keep_w, f"{what}: the weight shard")


def cross_entropy_oracle(Z, targets, denom, upstream):
    """The full softmax cross-entropy (N, V) and its gradient, max-shifted."""
    m = Z.max(-1, keepdims=True)
    e = np.exp(Z - m)
    s = e.sum(-1, keepdims=True)
    rows = np.arange(Z.shape[0])
    loss = (np.log(s[:, 0]) - (Z[rows, targets] - m[:, 0])).sum() / denom
    d = e / s
    d[rows, targets] -= 1.0
    return np.asarray(loss), d * (upstream / denom)


def check_cross_entropy(student):
    """vocab_parallel_cross_entropy on rank r's columns of the padded logits (padded columns
    -inf, as MaskColumns leaves them) against the full softmax cross-entropy."""
    for tp, g in groups():
        if g is None:
            continue
        r = g.rank
        for V in VOCABS[tp]:
            Vp, n, start, valid = layout(V, tp, r)
            targets = edge_ids(V, tp, B * T).reshape(B, -1)
            N = targets.size
            for scale in SCALES:
                for denom in (None, 2.5 * N + 1):
                    rng = np.random.default_rng([3, V, tp, int(scale)])
                    if scale < 100:
                        Z = scale * rng.standard_normal((N, V))
                    else:                           # +-1e4 and a little noise: exp(1e4) = inf
                        Z = scale * rng.choice([-1.0, 1.0], size=(N, V)) + rng.standard_normal((N, V))
                    padded = np.full((N, Vp), -np.inf)
                    padded[:, :V] = Z
                    local = padded[:, start:start + n].reshape(*targets.shape, n).copy()
                    upstream = 0.75
                    want_loss, want_d = cross_entropy_oracle(Z, targets.reshape(-1), N if denom is None else denom,
                                                             upstream)
                    full_d = np.zeros((N, Vp))
                    full_d[:, :V] = want_d
                    what = (f"cross-entropy tp={tp} rank {r} V={V} (Vp={Vp}, columns {start}:{start + n} here, "
                            f"{valid} valid) logits {local.shape} ~{'N(0, 3^2)' if scale < 100 else '+-1e4'} "
                            f"loss_denom={denom} float64")
                    logits = Tensor(local, requires_grad=True)
                    keep_z, keep_t = local.copy(), targets.copy()
                    loss = call(f"{what}: forward", student.vocab_parallel_cross_entropy, logits, targets, g,
                                start, denom)
                    assert isinstance(loss, Tensor), f"{what}: returned {type(loss).__name__}, want a Tensor"
                    expect(loss.data, want_loss, f"{what}: the loss (sum over rows of log sum exp - target "
                                                 f"logit, / {'rows' if denom is None else 'loss_denom'})")
                    same_on_every_rank(g, loss.data, f"{what}: the loss")
                    call(f"{what}: backward", loss.backward, np.asarray(upstream))
                    mine = full_d[:, start:start + n].reshape(local.shape)
                    if valid < n and logits.grad is not None:
                        pad = logits.grad[..., valid:]
                        assert not np.any(pad) and not np.isnan(pad).any(), \
                            f"{what}: gradient in the padded columns {start + valid}:{start + n} (ids >= V={V}; " \
                            f"they hold -inf, probability 0, and must get exactly 0), got e.g. {pad.ravel()[:3]}"
                    expect(logits.grad, mine, f"{what}: dL/dlogits of this rank's columns (softmax - onehot) "
                                              f"x {upstream} / {'rows' if denom is None else 'loss_denom'}")
                    unchanged(local, keep_z, f"{what}: the logits")
                    unchanged(targets, keep_t, f"{what}: the targets")


SEEN: list = []                                         # (op, kind, elements) of each tp_all_reduce


def spy_on_all_reduce(student):
    """Record every tp_all_reduce in SEEN, whether the student calls it as
    tensor_parallel.tp_all_reduce or by the name imported into their module."""
    original = tpar.tp_all_reduce

    def spy(group, x, op, kind):
        SEEN.append((op, kind, np.size(x)))
        return original(group, x, op, kind)
    tpar.tp_all_reduce = spy
    if getattr(student, "tp_all_reduce", None) is original:
        student.tp_all_reduce = spy


def counted(what, run, want_forward, want_kinds, want_ops):
    """Run forward (run() -> (output, backward)) then backward; compare the ledgers."""
    comm.reset_traffic()
    tpar.reset_traffic()
    SEEN.clear()
    _, backward = run()
    forward = comm.traffic().get("all_reduce", {}).get("calls", 0)
    backward()
    total = comm.traffic().get("all_reduce", {}).get("calls", 0)
    kinds = {k: (v["calls"], v["elements"]) for k, v in tpar.traffic().items()}
    assert (forward, total - forward) == (want_forward, 0), \
        f"{what}: {forward} all-reduces forward and {total - forward} backward, want {want_forward} and 0 " \
        f"(by kind, (calls, elements): {kinds})"
    assert kinds == want_kinds, f"{what}: tensor_parallel.traffic() counted (calls, elements) {kinds}, want " \
                                f"{want_kinds}: every all-reduce through tp_all_reduce(group, x, op, kind)"
    ops = sorted(op for op, _, _ in SEEN)
    assert ops == sorted(want_ops), f"{what}: all-reduce ops {[op for op, _, _ in SEEN]}, want {want_ops} " \
                                    f"in some order"


MODEL_CFG = {2: (4, 16), 4: (4, 16), 3: (3, 12)}        # tp -> (n_head, n_embd) for TensorParallelGPT


def check_count(student):
    """One call each, counted by minipar's ledgers: the embedding 1 all-reduce (sum, kind g,
    B t C elements) forward and none backward; the cross-entropy 3 (max, sum, sum, kind
    cross_entropy, B t elements each) forward and none backward; then TensorParallelGPT built
    with both (L = 1): Megatron's 4L + 5 by kind (f 2L + 1, g 2L + 1, cross_entropy 3)."""
    spy_on_all_reduce(student)
    install(student)
    for tp, g in groups():
        if g is None:
            continue
        r = g.rank
        V = VOCABS[tp][-1]
        Vp, n, start, valid = layout(V, tp, r)
        ids = edge_ids(V, tp, B * T).reshape(B, -1)
        bt = ids.size
        W = np.random.default_rng([1, V]).standard_normal((Vp, C))
        W[V:] = 0.0

        def embed():
            y = student.VocabParallelEmbedding(Tensor(W[start:start + n].copy(), requires_grad=True), start, g)(ids)
            return y, lambda: y.backward(np.ones(y.shape))
        counted(f"embedding tp={tp} rank {r} V={V} ids {ids.shape} C={C}, one forward + backward", embed,
                1, {"g": (1, bt * C)}, ["sum"])

        Z = np.random.default_rng([4, V]).standard_normal((bt, Vp))
        Z[:, V:] = -np.inf

        def loss():
            z = Tensor(Z[:, start:start + n].reshape(*ids.shape, n).copy(), requires_grad=True)
            out = student.vocab_parallel_cross_entropy(z, ids, g, start)
            return out, lambda: out.backward()
        counted(f"cross-entropy tp={tp} rank {r} V={V} logits {(*ids.shape, n)}, one forward + backward", loss,
                3, {"cross_entropy": (3, 3 * bt)}, ["max", "sum", "sum"])

        heads, width = MODEL_CFG[tp]
        cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=heads, n_embd=width)
        model = tpar.TensorParallelGPT(cfg, g, seed=0, dtype=np.float64)
        assert isinstance(model.wte, student.VocabParallelEmbedding), "the model was not built from your embedding"
        data = np.random.default_rng([5, tp]).integers(0, cfg.vocab_size, size=(2, 2, 8))
        comm.reset_traffic()
        tpar.reset_traffic()
        model(data[0], data[1]).backward()
        L = cfg.n_layer
        kinds = {k: v["calls"] for k, v in tpar.traffic().items()}
        want = {"f": 2 * L + 1, "g": 2 * L + 1, "cross_entropy": 3}
        assert kinds == want, f"TensorParallelGPT tp={tp} rank {r} (V=256, Vp={-(-256 // tp) * tp}) L={L} with " \
                              f"your embedding and cross-entropy, one forward + backward: tensor_parallel.traffic() " \
                              f"counted {kinds}, Megatron's 4L+5 by kind is {want}"


# --- the seam -------------------------------------------------------------------------------

def install(student):
    """TensorParallelGPT's vocabulary-parallel embedding (for every model built after this
    call) and cross-entropy become the student's (counted)."""
    calls = [0]

    class Embedding(student.VocabParallelEmbedding):
        def __call__(self, idx):
            calls[0] += 1
            return super().__call__(idx)

    def cross_entropy(logits, targets, group, vocab_start, denom=None):
        calls[0] += 1
        return student.vocab_parallel_cross_entropy(logits, targets, group, vocab_start, denom)

    tpar.VocabParallelEmbedding = Embedding
    tpar.vocab_parallel_cross_entropy = cross_entropy
    return lambda: calls[0]



CRITERIA = [
    Criterion("no MPI collective", check=check_static, timeout=30,
              hint="all-reduce only with minipar.parallel.tensor_parallel.tp_all_reduce"),
    Criterion("embedding vs full lookup", ranks=4, check=check_embedding, timeout=30,
              hint="ids outside [vocab_start, vocab_start + rows) must give zero rows before the sum "
                   "(exactly one rank contributes each token); backward adds dy into the owned rows "
                   "only, repeated ids adding up (np.add.at, not w[rows] += ...); "
                   "minipar.parallel.tensor_parallel.MaskedEmbedding's docstring"),
    Criterion("cross-entropy vs full softmax", ranks=4, check=check_cross_entropy, timeout=30,
              hint="the max must be the global one (op 'max') before any exp; the target logit comes "
                   "from the one rank that owns it, the others add 0; divide by loss_denom when given; "
                   "padded columns are -inf, exp gives them 0 (do not replace -inf); "
                   "minipar.parallel.tensor_parallel.VocabParallelCrossEntropy's docstring"),
    Criterion("all-reduces per call", ranks=4, check=check_count, timeout=30,
              hint="the embedding 1 (sum, kind 'g') and the cross-entropy 3 (max, sum, sum, kind "
                   "'cross_entropy'), all forward, none backward; "
                   "minipar.parallel.tensor_parallel.traffic shows what you sent, by kind"),
    Criterion("trainer --tp 4 --verify", ranks=4, trainer=trainer_flags("--tp", "4", n_head=4), timeout=60,
              hint="tp 4 for 3 steps against one process: read the weight in __call__ each time, "
                   "the optimizer updates it in place after every step; the verify: line names "
                   "the parameter that differs most"),
    Criterion("trainer --tp 2 --verify", ranks=4, trainer=trainer_flags("--tp", "2", n_head=4), timeout=60,
              hint="dp 2 x tp 2 for 3 steps against one process: the tp groups are halves of the world"),
]
