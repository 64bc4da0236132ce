"""Lab 06, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's vocabulary-parallel embedding and cross-entropy, and the seam. Nothing here
judges; lab.py does, in the grader, with the full lookup and the full softmax cross-entropy
in NumPy.

Cases: the 4 ranks cut into tp groups of 1 (four at once), 2 (ranks {0, 1} and {2, 3} at
once), 4, and 3 (ranks 0..2; rank 3 sits out); float64 and float32; vocabularies that tp
divides and that it does not (padded, down to a rank holding only padding); ids and targets
on every shard's edges, of several integer dtypes and (B, t) shapes. Every input (the full
table, the ids, dL/dy, the full logits, the targets) is drawn from a seed that names the case,
so the grader rebuilds it without being told. For every call the child records what came
back: the output, the gradient as the student's backward returned it (a probe Function sits
between the leaf and the student's code), every input as it is afterwards, whether the output
shares memory with an input, and what the ledgers counted.
"""
import numpy as np
from mpi4py import MPI

from labs.results import key
from minipar import comm
from minipar.model.gpt import GPTConfig
from minipar.parallel.tensor import tensor_parallel as tpar
from minipar.autograd.tensor import Function, Tensor

# minipar's own embedding, g and cross-entropy (what reference.py imports): reached from the
# student's file, each raises (labs/child.py). The seam (install) makes the model use the
# student's.
OWN = [f"minipar.parallel.tensor.tensor_parallel:{n}" for n in (
    "MaskedEmbedding.forward", "MaskedEmbedding.backward", "ReduceFromTP.forward", "ReduceFromTP.backward",
    "VocabParallelEmbedding.__init__", "VocabParallelEmbedding.__call__",
    "VocabParallelCrossEntropy.forward", "VocabParallelCrossEntropy.backward",
    "vocab_parallel_cross_entropy", "reduce_from_tp")]

WORLD = 4
TPS = (1, 2, 4, 3)
C = 4                                                   # embedding width
# V per tp: divisible and padded; tp=3 V=4: rank 2 holds only padding
VOCABS = {1: (13,), 2: (16, 13), 4: (16, 13), 3: (12, 10, 4)}
DTYPES = ("float64", "float32")
# (shape, dtype) of the ids / targets: the main one holds every shard's edges
MAIN_IDS = ((2, 16), "int64")
MORE_IDS = (((3, 5), "int32"), ((1, 1), "int64"), ((1, 9), "int16"))
SCALES = (3.0, 1e4)                                     # logits ~ N(0, 3^2), and +-1e4 (+ noise): exp overflows naively
UPSTREAM = 0.75                                         # dL/dloss given to the loss's backward
COUNT_SHAPE = (2, 9)                                    # the ids of the counting criterion
MODEL_CFG = {2: (4, 16), 4: (4, 16), 3: (3, 12)}        # tp -> (n_head, n_embd) for TensorParallelGPT


def members(tp: int) -> list[list[int]]:
    """The world ranks of each tp group, in tp-rank order."""
    if tp == 3:
        return [[0, 1, 2]]
    return [list(range(s, s + tp)) for s in range(0, WORLD, tp)]


def groups():
    """(tp, Group or None) for each tp of TPS: groups of tp consecutive ranks (all at once),
    and for tp = 3 ranks 0..2 (rank 3 gets None and sits the case out)."""
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    for tp in TPS:
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
    """(Vp, n = Vp/tp, start, valid): the padding of TensorParallelGPT for tp rank r."""
    Vp = -(-V // tp) * tp
    n = Vp // tp
    start = r * n
    return Vp, n, start, min(max(V - start, 0), n)


def ids_for(V, tp, shape, dtype):
    """Ids in [0, V) of `shape`: every shard's edges (vocab_start - 1, vocab_start, its last
    valid row), 0 and V - 1, three of them repeated, as many as fit; then random ids; shuffled."""
    size = int(np.prod(shape))
    n = layout(V, tp, 0)[1]
    edges = {0, V - 1}
    for s in range(tp):
        edges |= {s * n - 1, s * n, min(s * n + n, V) - 1}
    edges = sorted(e for e in edges if 0 <= e < V)
    rng = np.random.default_rng([V, tp, size, len(shape)])
    fixed = edges + edges[:3]
    ids = np.concatenate([fixed, rng.integers(0, V, size=max(size - len(fixed), 0))])[:size]
    return rng.permutation(ids).astype(dtype).reshape(shape)


def table(V, dtype):
    """The full (V, C) table, drawn in float64 and rounded to dtype."""
    return np.random.default_rng([1, V]).standard_normal((V, C)).astype(dtype)


def upstream_dy(V, tp, shape, dtype):
    """dL/dy (B, t, C) of an embedding case, the same on every rank."""
    return np.random.default_rng([2, V, tp, *shape]).standard_normal((*shape, C)).astype(dtype)


def full_logits(V, tp, N, scale, dtype):
    """The full (N, V) logits of a cross-entropy case."""
    rng = np.random.default_rng([3, V, tp, int(scale), N])
    if scale < 100:
        Z = scale * rng.standard_normal((N, V))
    else:                                               # +-1e4 and a little noise: exp(1e4) = inf
        Z = scale * rng.choice([-1.0, 1.0], size=(N, V)) + rng.standard_normal((N, V))
    return Z.astype(dtype)


def denom_of(kind, N):
    return None if kind == "none" else 2.5 * N + 1


def embedding_cases(tp):
    """(V, dtype, shape, ids dtype) of the embedding criterion for a group of tp."""
    return [(V, dtype, shape, idt) for V in VOCABS[tp] for dtype in DTYPES
            for shape, idt in (MAIN_IDS, *MORE_IDS)]


def cross_entropy_cases(tp):
    """(V, dtype, shape, targets dtype, scale, denom kind) of the cross-entropy criterion."""
    out = []
    for V in VOCABS[tp]:
        for dtype in DTYPES:
            shape, tdt = MAIN_IDS
            out += [(V, dtype, shape, tdt, scale, d) for scale in SCALES for d in ("none", "given")]
            out += [(V, dtype, shape, tdt, scale, d) for (shape, tdt), scale, d in
                    zip(MORE_IDS, (1e4, 3.0, 1e4), ("none", "given", "given"))]
    return out


def embedding_text(tp, r, V, dtype, shape, idt):
    Vp, n, start, valid = layout(V, tp, r)
    return (f"embedding tp={tp} rank {r} V={V} (Vp={Vp}, rows {start}:{start + n} here, {valid} valid) "
            f"ids {shape} {idt}, {dtype}")


def cross_entropy_text(tp, r, V, dtype, shape, tdt, scale, d):
    Vp, n, start, valid = layout(V, tp, r)
    N = int(np.prod(shape))
    return (f"cross-entropy tp={tp} rank {r} V={V} (Vp={Vp}, columns {start}:{start + n} here, {valid} valid) "
            f"logits {(*shape, n)} ~{'N(0, 3^2)' if scale < 100 else '+-1e4'} targets {tdt}, "
            f"loss_denom={denom_of(d, N)}, {dtype}")


class Probe(Function):
    """Identity forward (the very array); backward keeps the gradient exactly as the student's
    backward returned it (its dtype too: a leaf's .grad is cast to the leaf's dtype)."""

    def forward(self, x):
        return x

    def backward(self, grad):
        self.got = grad
        return grad


def probed(leaf: Tensor):
    """(the tensor the student gets, the probe node whose .got is the gradient that came back)."""
    t = Probe.apply(leaf)
    return t, t._ctx                                    # noqa: SLF001 - the node itself, kept past backward


def shares(a, b) -> bool:
    return bool(isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.shares_memory(a, b))


# --- what the child runs ----------------------------------------------------------------------

def embedding(student, out):
    me = MPI.COMM_WORLD.Get_rank()
    for tp, g in groups():
        if g is None:
            continue
        r = g.rank
        for V, dtype, shape, idt in embedding_cases(tp):
            out.case(embedding_text(tp, r, V, dtype, shape, idt))
            k = key("emb", tp, me, V, dtype, shape, idt)
            Vp, n, start, _ = layout(V, tp, r)
            padded = np.zeros((Vp, C), dtype=dtype)
            padded[:V] = table(V, dtype)
            shard = padded[start:start + n].copy()
            ids = ids_for(V, tp, shape, idt)
            weight, probe = probed(Tensor(shard, requires_grad=True))
            y = student.VocabParallelEmbedding(weight, start, g)(ids)
            out.put(key(k, "tensor"), isinstance(y, Tensor))
            if isinstance(y, Tensor):
                out.put(key(k, "y"), y.data)
                out.put(key(k, "y aliases"), [name for name, a in (("the weight shard", shard), ("the ids", ids))
                                              if shares(y.data, a)])
                y.backward(upstream_dy(V, tp, shape, dtype))
                out.put(key(k, "dw"), getattr(probe, "got", None))
            out.put(key(k, "ids after"), ids)
            out.put(key(k, "w after"), shard)


def cross_entropy(student, out):
    me = MPI.COMM_WORLD.Get_rank()
    for tp, g in groups():
        if g is None:
            continue
        r = g.rank
        for V, dtype, shape, tdt, scale, d in cross_entropy_cases(tp):
            out.case(cross_entropy_text(tp, r, V, dtype, shape, tdt, scale, d))
            k = key("ce", tp, me, V, dtype, shape, tdt, scale, d)
            Vp, n, start, _ = layout(V, tp, r)
            N = int(np.prod(shape))
            padded = np.full((N, Vp), -np.inf, dtype=dtype)
            padded[:, :V] = full_logits(V, tp, N, scale, dtype)
            local = padded[:, start:start + n].reshape(*shape, n).copy()
            targets = ids_for(V, tp, shape, tdt)
            logits, probe = probed(Tensor(local, requires_grad=True))
            loss = student.vocab_parallel_cross_entropy(logits, targets, g, start, denom_of(d, N))
            out.put(key(k, "tensor"), isinstance(loss, Tensor))
            if isinstance(loss, Tensor):
                out.put(key(k, "loss"), loss.data)
                if isinstance(loss.data, np.ndarray) and loss.data.shape == ():
                    loss.backward(np.asarray(UPSTREAM))
                    out.put(key(k, "dlogits"), getattr(probe, "got", None))
            out.put(key(k, "logits after"), local)
            out.put(key(k, "targets after"), targets)


SEEN: list = []                                         # (op, kind, elements) of each tp_all_reduce


def spy_on_all_reduce(student):
    """Record every tp_all_reduce in SEEN, whether the student calls it as
    tensor_parallel.tp_all_reduce or by the name imported into their module."""
    original = tpar.tp_all_reduce

    def spy(group, x, op, kind):
        SEEN.append((str(op), str(kind), int(np.size(x))))
        return original(group, x, op, kind)
    tpar.tp_all_reduce = spy
    if getattr(student, "tp_all_reduce", None) is original:
        student.tp_all_reduce = spy


def counted(run) -> dict:
    """Run forward (run() -> backward) then backward: what the ledgers counted."""
    comm.reset_traffic()
    tpar.reset_traffic()
    SEEN.clear()
    backward = run()
    forward = comm.traffic().get("all_reduce", {}).get("calls", 0)
    backward()
    total = comm.traffic().get("all_reduce", {}).get("calls", 0)
    return {"forward": int(forward), "backward": int(total - forward),
            "kinds": {str(k): [int(v["calls"]), int(v["elements"])] for k, v in tpar.traffic().items()},
            "ops": [list(s) for s in SEEN]}


def count(student, out):
    """One call each, counted by minipar's ledgers and a spy on tp_all_reduce; then
    TensorParallelGPT (L = 1) built with both, one forward + backward, by kind."""
    me = MPI.COMM_WORLD.Get_rank()
    spy_on_all_reduce(student)
    seam_calls = install(student)
    for tp, g in groups():
        if g is None or tp == 1:
            continue
        r = g.rank
        V = VOCABS[tp][-1]
        Vp, n, start, _ = layout(V, tp, r)
        ids = ids_for(V, tp, COUNT_SHAPE, "int64")
        W = np.zeros((Vp, C))
        W[:V] = table(V, "float64")

        def embed():
            y = student.VocabParallelEmbedding(Tensor(W[start:start + n].copy(), requires_grad=True), start, g)(ids)
            return lambda: y.backward(np.ones(y.shape))
        out.case(f"embedding tp={tp} rank {r} V={V} ids {ids.shape} C={C}, one forward + backward, counting")
        out.put(key("count", "emb", tp, me), counted(embed))

        Z = np.full((ids.size, Vp), -np.inf)
        Z[:, :V] = full_logits(V, tp, ids.size, 3.0, "float64")

        def loss():
            z = Tensor(Z[:, start:start + n].reshape(*ids.shape, n).copy(), requires_grad=True)
            y = student.vocab_parallel_cross_entropy(z, ids, g, start)
            return lambda: y.backward()
        out.case(f"cross-entropy tp={tp} rank {r} V={V} logits {(*ids.shape, n)}, one forward + backward, counting")
        out.put(key("count", "ce", tp, me), counted(loss))

        heads, width = MODEL_CFG[tp]
        cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=heads, n_embd=width)
        out.case(f"TensorParallelGPT tp={tp} rank {r} V=256 L=1 H={heads} C={width} with your embedding and "
                 f"cross-entropy, one forward + backward, counting")
        model = tpar.TensorParallelGPT(cfg, g, seed=0, dtype=np.float64)
        data = np.random.default_rng([5, tp]).integers(0, cfg.vocab_size, size=(2, 2, 8))
        comm.reset_traffic()
        tpar.reset_traffic()
        before = seam_calls()
        model(data[0], data[1]).backward()
        # the forward ran your embedding and your cross-entropy, once each
        out.put(key("count", "model yours", tp, me), seam_calls() - before == 2)
        out.put(key("count", "model", tp, me), {str(k): int(v["calls"]) for k, v in tpar.traffic().items()})


# --- the seam -------------------------------------------------------------------------------

def install(student):
    """TensorParallelGPT's vocabulary-parallel embedding and cross-entropy become the
    student's (counted): a model builds its embedding from this module's name when it first
    runs (and keeps it), so every model run after this call runs the student's."""
    calls = [0]

    class Embedding(student.VocabParallelEmbedding):
        def __call__(self, idx):
            calls[0] += 1
            return super().__call__(idx)

    def cross_entropy_seam(logits, targets, group, vocab_start, denom=None):
        calls[0] += 1
        return student.vocab_parallel_cross_entropy(logits, targets, group, vocab_start, denom)

    tpar.VocabParallelEmbedding = Embedding
    tpar.vocab_parallel_cross_entropy = cross_entropy_seam
    return lambda: calls[0]
