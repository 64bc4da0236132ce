"""Lab 14, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's sequence gather and scatter, f, g-bar and the replicated parameters' sum,
and the seam. Nothing here judges; lab.py does, in the grader, with NumPy.

Cases: the 4 ranks cut into tp groups in four layouts at once (four groups of 1, two of 2,
one of 3 beside one of 1, one of 4), so every rank is in a group and a sum over the wrong
ranks shows as a wrong value, not a hang. Activations (B, t, ...) with t = p m: several B
(0: an empty batch, 1, 2, 3), m (1, 2, 3 tokens per rank), trailing shapes ((), (1,), (4,),
(5,), (2, 3)), float64 and float32. Every input is drawn from a seed that names the layout,
the group, the rank (where ranks' inputs differ) and the case, so the grader rebuilds each one
without being told. The child records what came back, every input as it is afterwards, and
what minipar.comm's ledger counted (operation: calls, bytes sent).
"""
import numpy as np
from mpi4py import MPI

from labs.framework import layout_groups
from labs.results import key
from minipar import comm
from minipar.autograd import ops
from minipar.autograd.tensor import Function, Tensor
from minipar.parallel.tensor import sequence_parallel as sp
from minipar.parallel.tensor.tensor_parallel import MaskedEmbedding, tp_collective

# minipar's own sequence parallelism (what reference.py adapts): reached from the student's
# file, each raises (labs/child.py). The seam (install) makes the model use the student's.
OWN = [f"minipar.parallel.tensor.sequence_parallel:{n}" for n in (
    "gather_seq", "scatter_seq", "ScatterToSequence.forward", "ScatterToSequence.backward",
    "GatherSequenceLinear.forward", "GatherSequenceLinear.backward", "SequenceSplit.replicated")] + \
      [f"minipar.parallel.tensor.tensor_parallel:{n}" for n in (
          "SumGradOver.forward", "SumGradOver.backward", "tp_all_reduce", "tp_collective")]

WORLD = 4
LAYOUTS = ((1, 1, 1, 1), (2, 2), (3, 1), (4,))         # group sizes, the ranks in order
DTYPES = ("float64", "float32")
# (B, m = t/p tokens per rank, trailing shape): the sequence is axis 1
SHAPES = [(2, 3, (4,)), (3, 2, (1,)), (1, 2, (5,)), (2, 1, (3,)), (0, 2, (4,)), (2, 2, (2, 3)), (3, 2, ())]
FUNCTION_SHAPES = [0, 2, 4, 5]                         # indices into SHAPES for g and g-bar
PAIRING_SHAPES = [0, 1, 5]
PARAM_SHAPES = [(5,), (2, 3), (1,)]                    # the replicated parameters


def layouts():
    """(layout index, sizes, group index, rank in the group, Group) for each layout, here."""
    return layout_groups(LAYOUTS)


def draw(shape, dtype, *seed) -> np.ndarray:
    """Multiples of 1/8 in [-8, 8] (sums of a few are exact in float32), from the seed."""
    return (np.random.default_rng([14, *seed]).integers(-64, 65, shape) / 8.0).astype(dtype)


def normal(shape, *seed) -> np.ndarray:
    return np.random.default_rng([141, *seed]).standard_normal(shape)


def shard_shape(i, p):
    B, m, rest = SHAPES[i]
    return (B, m, *rest)


def whole_shape(i, p):
    B, m, rest = SHAPES[i]
    return (B, p * m, *rest)


def gather_input(li, gi, r, i, dtype):
    """Rank r's tokens (B, m, ...) in gather case i of group gi of layout li."""
    return draw(shard_shape(i, 0), dtype, li, gi, r, i, np.dtype(dtype).num, 0)


def scatter_input(li, gi, r, i, dtype, p):
    """Rank r's partial sum (B, p m, ...) in scatter case i."""
    return draw(whole_shape(i, p), dtype, li, gi, r, i, np.dtype(dtype).num, 1)


def case_text(what, p, sizes, r, shape, dtype, name="x") -> str:
    return f"{what} p={p} (layout {'+'.join(map(str, sizes))}) rank {r}: {name} {tuple(shape)} {dtype}"


def ledger() -> dict:
    """{operation: [calls, bytes sent]} of minipar.comm's ledger since the last reset."""
    return {k: [int(v["calls"]), int(v["bytes_sent"])] for k, v in comm.traffic().items()}


class Probe(Function):
    """Identity on x between the leaf and the student's code: its backward keeps the gradient
    exactly as the student's backward returned it (dtype, shape), before the engine casts it."""

    def forward(self, x, box):
        self.box = box
        return x

    def backward(self, grad):
        self.box.append(grad)
        return grad, None


def run_function(out, k, fn, g, x, dy):
    """y = fn.apply(x, g), then y.backward(dy): y, the gradient that reached x as returned,
    the ledger of each pass, and x and dy afterwards."""
    leaf, box = Tensor(x, requires_grad=True), []
    comm.reset_traffic()
    y = fn.apply(Probe.apply(leaf, box), g)
    out.put(key(k, "y"), y.data if isinstance(y, Tensor) else y)
    out.put(key(k, "ledger forward"), ledger())
    comm.reset_traffic()
    y.backward(dy)
    out.put(key(k, "dx"), box[0] if box else None)
    out.put(key(k, "ledger backward"), ledger())
    out.put(key(k, "x after"), x)
    out.put(key(k, "dy after"), dy)


# --- what the child runs ----------------------------------------------------------------------

def arrays(student, out):
    """gather_sequence and scatter_sequence on arrays, every shape and dtype, every layout."""
    for li, sizes, gi, r, g in layouts():
        wr, p = MPI.COMM_WORLD.Get_rank(), g.size
        for i in range(len(SHAPES)):
            for dtype in DTYPES:
                x = gather_input(li, gi, r, i, dtype)
                out.case(case_text("gather_sequence", p, sizes, r, x.shape, dtype))
                y = student.gather_sequence(g, x)
                out.put(key("gather", li, wr, i, dtype), y)
                out.put(key("gather", li, wr, i, dtype, "x after"), x)
                x = scatter_input(li, gi, r, i, dtype, p)
                out.case(case_text("scatter_sequence", p, sizes, r, x.shape, dtype))
                y = student.scatter_sequence(g, x)
                out.put(key("scatter", li, wr, i, dtype), y)
                out.put(key("scatter", li, wr, i, dtype, "x after"), x)


def function_inputs(name, li, gi, r, i, dtype, p):
    """(x, dy) of f (name "f") or g-bar ("g") in case i: per rank, different on every rank."""
    n = np.dtype(dtype).num
    if name == "f":
        return (draw(shard_shape(i, p), dtype, li, gi, r, i, n, 2),
                draw(whole_shape(i, p), dtype, li, gi, r, i, n, 3))
    return (draw(whole_shape(i, p), dtype, li, gi, r, i, n, 4),
            draw(shard_shape(i, p), dtype, li, gi, r, i, n, 5))


def functions(student, out):
    """GatherFromSequence (f) and ScatterToSequence (g-bar), forward and backward, in the graph."""
    for li, sizes, gi, r, g in layouts():
        wr, p = MPI.COMM_WORLD.Get_rank(), g.size
        for name, fn in (("f", student.GatherFromSequence), ("g", student.ScatterToSequence)):
            for i in FUNCTION_SHAPES:
                for dtype in DTYPES:
                    x, dy = function_inputs(name, li, gi, r, i, dtype, p)
                    what = "GatherFromSequence" if name == "f" else "ScatterToSequence"
                    out.case(case_text(what, p, sizes, r, x.shape, dtype) + f", dy {dy.shape}")
                    run_function(out, key(name, li, wr, i, dtype), fn, g, x, dy)


def pairing_inputs(name, li, gi, r, i, p):
    """(x, dy) of the adjoint case: float64 normals, different on every rank."""
    xs, ys = (shard_shape(i, p), whole_shape(i, p)) if name == "f" else (whole_shape(i, p), shard_shape(i, p))
    return normal(xs, li, gi, r, i, 0 if name == "f" else 2), normal(ys, li, gi, r, i, 1 if name == "f" else 3)


def pairing(student, out):
    """g and g-bar on float64 normals: y = F(x) and dx = F*(dy), for the adjoint test."""
    for li, sizes, gi, r, g in layouts():
        wr, p = MPI.COMM_WORLD.Get_rank(), g.size
        for name, fn in (("f", student.GatherFromSequence), ("g", student.ScatterToSequence)):
            for i in PAIRING_SHAPES:
                x, dy = pairing_inputs(name, li, gi, r, i, p)
                what = "GatherFromSequence" if name == "f" else "ScatterToSequence"
                out.case(case_text(what, p, sizes, r, x.shape, "float64") + f", dy {dy.shape} (the adjoint)")
                run_function(out, key("pair", name, li, wr, i), fn, g, x, dy)


def param_inputs(li, gi, r, j, dtype):
    """(p, a, b, dy) of replicated-parameter case j: p the same on the group's ranks; a, b
    and dy this rank's own (its tokens' share)."""
    shape, n = PARAM_SHAPES[j], np.dtype(dtype).num
    return (draw(shape, dtype, li, gi, j, n, 6), draw(shape, dtype, li, gi, r, j, n, 7),
            draw(shape, dtype, li, gi, r, j, n, 8), draw(shape, dtype, li, gi, r, j, n, 9))


def replicated(student, out):
    """SumGradOverTP: used once (y = w, dy this rank's), and used twice after one application
    (y = w a + w b: the engine adds both uses' gradients before the sum)."""
    for li, sizes, gi, r, g in layouts():
        wr, p = MPI.COMM_WORLD.Get_rank(), g.size
        for j, shape in enumerate(PARAM_SHAPES):
            for dtype in DTYPES:
                w, a, b, dy = param_inputs(li, gi, r, j, dtype)
                out.case(case_text("SumGradOverTP", p, sizes, r, shape, dtype, "w") + ", used once")
                run_function(out, key("once", li, wr, j, dtype), student.SumGradOverTP, g, w, dy)
                out.case(case_text("SumGradOverTP", p, sizes, r, shape, dtype, "w") + ", used twice (w a + w b)")
                k = key("twice", li, wr, j, dtype)
                leaf, box = Tensor(w, requires_grad=True), []
                comm.reset_traffic()
                q = student.SumGradOverTP.apply(Probe.apply(leaf, box), g)
                y = q * Tensor(a) + q * Tensor(b)
                out.put(key(k, "ledger forward"), ledger())
                comm.reset_traffic()
                y.backward(dy)
                out.put(key(k, "dx"), box[0] if box else None)
                out.put(key(k, "ledger backward"), ledger())
                out.put(key(k, "x after"), w)


# --- the seam ---------------------------------------------------------------------------------

def install(student):
    """SequenceSplit's layers (what the model's family calls on a tp rank with --sp) become
    the student's: minipar's column-parallel linear (and the head) gathers its input with the
    student's f, a row-parallel one (and the embedding) reduce-scatters with the student's
    g-bar, and every replicated parameter goes through the student's SumGradOverTP. f stays
    fused with the linear as minipar's is (sequence_parallel.GatherSequenceLinear: only the
    input's shard is kept, and backward gathers it again with the student's f forward for
    the weight gradient), so the run's collectives are sp_count's. Returns how many times the
    student's code was applied on this rank."""
    calls = [0]

    class Column(sp.GatherSequenceLinear):          # each collective counted in tensor parallelism's
        def gather(self, x, kind):                  # ledger by kind, as minipar's own (sp_count's line)
            calls[0] += kind == "f_gather"
            self.f = student.GatherFromSequence()   # the last gather's node runs f's backward
            return tp_collective(kind, x.size * self.group.size, lambda: self.f.forward(x, self.group))

        def scatter(self, dx):
            out = tp_collective("f_scatter", dx.size, lambda: self.f.backward(dx))
            return out[0] if isinstance(out, (tuple, list)) else out

    class G(student.ScatterToSequence):
        def forward(self, x, group):
            calls[0] += 1
            self.seam_tp = group.size
            return tp_collective("g_scatter", x.size, lambda: super(G, self).forward(x, group))

        def backward(self, grad):
            return tp_collective("g_gather", grad.size * self.seam_tp, lambda: super(G, self).backward(grad))

    class S(student.SumGradOverTP):
        def backward(self, grad):
            return tp_collective("sp_grads", grad.size, lambda: super(S, self).backward(grad))

    def g(x, group):
        return G.apply(x, group)

    def row(self, x, w, b=None):
        y = g(ops.linear(x, w), self.group)
        return y if b is None else y + b

    def replicated(self, p):
        calls[0] += 1
        return S.apply(p, self.group)

    def tokens(self, idx, w):
        return g(MaskedEmbedding.apply(idx, w, self.vocab_start), self.group)

    split = sp.SequenceSplit
    split.gather_linear, split.row, split.replicated, split.tokens = Column, row, replicated, tokens
    return lambda: calls[0]
