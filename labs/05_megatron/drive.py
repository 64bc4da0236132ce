"""Lab 05, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's f, g and linear layers, and the seam. Nothing here judges; lab.py does, in
the grader, with its own full linear layer in NumPy and minipar's single-process GPT.

Cases: the 4 ranks cut into tp groups in four layouts at once (four groups of 1, two of 2,
one of 3 beside one of 1, one of 4); float64, float32 and float16 (the trainer's dtypes and
--precision fp16's buffers). Every input is drawn from a seed that names the layout, the
group, the rank (for f and g, whose inputs differ per rank) and the case, so the grader
rebuilds each one without being told. For every call the child records what came back (the
output, the gradient that reached x as the student's backward returned it, the parameters'
gradients), every input as it is afterwards, and what tensor parallelism's ledger counted.
"""
import numpy as np
from mpi4py import MPI

from labs.framework import layout_groups
from labs.results import key
from minipar import comm
from minipar.model.gpt import GPTConfig
from minipar.parallel.tensor import tensor_parallel as tpar
from minipar.autograd.tensor import Function, Tensor

# minipar's own f, g and layers (what reference.py imports): reached from the student's file,
# each raises (labs/child.py). The seam (install) makes the model use the student's classes.
OWN = [f"minipar.parallel.tensor.tensor_parallel:{n}" for n in (
    "CopyToTP.forward", "CopyToTP.backward", "ReduceFromTP.forward", "ReduceFromTP.backward",
    "ColumnParallelLinear.__call__", "RowParallelLinear.__call__", "copy_to_tp", "reduce_from_tp")]

WORLD = 4
LAYOUTS = ((1, 1, 1, 1), (2, 2), (3, 1), (4,))         # group sizes, the ranks in order
DTYPES = ("float64", "float32", "float16")
FG_SHAPES = [(2, 3, 8), (1, 5, 4), (7,), (6, 5), (), (2, 2, 3, 2)]     # f and g: any shape
ALIAS_DTYPES = ("float64", "float32")                  # dy given to backward is y itself
# the layers: (x's shape, Cout); x is (..., Cin): (B, t, Cin) as the model passes, and (N, Cin)
LAYERS = [((2, 3, 8), 12), ((1, 4, 16), 8), ((2, 3, 12), 24), ((1, 1, 24), 12), ((5, 12), 36),
          ((3, 24), 12)]
COUNT_CFG = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=4, n_embd=16)
COUNT_B, COUNT_T = 2, 8
COUNT_TPS = (2, 4)
COUNT_DTYPES = ("float64", "float32")


def layouts():
    """(layout index, sizes, group index, rank in the group, Group) for each layout, here."""
    return layout_groups(LAYOUTS)


def draw(shape, dtype, *seed) -> np.ndarray:
    """N(0, 1) drawn in float64 from the seed, rounded to dtype."""
    return np.asarray(np.random.default_rng([5, *seed]).standard_normal(shape), dtype=dtype)


def fg_input(li, gi, r, i, dtype, what):
    """Rank r's x (what=0) or dy (what=1) of f / g case i in layout li, group gi."""
    shape = FG_SHAPES[i]
    return draw(shape, dtype, li, gi, r, i, np.dtype(dtype).num, what)


def layer_cases(tp: int) -> list[int]:
    """The LAYERS a group of tp ranks runs: those whose Cin and Cout tp divides."""
    return [i for i, (shape, cout) in enumerate(LAYERS) if shape[-1] % tp == 0 and cout % tp == 0]


def layer_inputs(li, gi, i, dtype):
    """(x, W, b, dy) of layer case i for group gi of layout li: the full tensors, the same on
    every rank of the group (each rank takes its shard)."""
    shape, cout = LAYERS[i]
    n = np.dtype(dtype).num
    x = draw(shape, dtype, li, gi, i, n, 0)
    W = draw((shape[-1], cout), dtype, li, gi, i, n, 1)
    b = draw((cout,), dtype, li, gi, i, n, 2)
    dy = draw((*shape[:-1], cout), dtype, li, gi, i, n, 3)
    return x, W, b, dy


def shard(n: int, tp: int, r: int) -> slice:
    return slice(r * n // tp, (r + 1) * n // tp)


def layer_text(kind, tp, sizes, r, i, dtype) -> str:
    shape, cout = LAYERS[i]
    return (f"{kind}-parallel tp={tp} (layout {'+'.join(map(str, sizes))}) rank {r}: x {shape} "
            f"(Cin={shape[-1]}), Cout={cout}, {dtype}")


# --- recording ------------------------------------------------------------------------------

class Probe(Function):
    """Identity on x, between the leaf and the student's code: its backward keeps the gradient
    exactly as the student's backward returned it (its dtype, its memory), before the engine
    casts it into the leaf's .grad."""

    def forward(self, x, box):
        self.box = box
        return x

    def backward(self, grad):
        self.box.append(grad)
        return grad, None


def ledger() -> dict:
    """Since the last reset: {"tp": {kind: [calls, elements]}} of tensor parallelism's ledger,
    "comm": {operation: calls} of minipar.comm's (every collective, whoever called it)."""
    return {"tp": {k: [int(v["calls"]), int(v["elements"])] for k, v in tpar.traffic().items()},
            "comm": {k: int(v["calls"]) for k, v in comm.traffic().items()}}


def reset():
    comm.reset_traffic()
    tpar.reset_traffic()


def run_fg(out, k, fn, g, x, dy):
    """y = fn.apply(x) then y.backward(dy) (dy None: y's own array, which may be x itself),
    recording y, the gradient that reached x, the inputs afterwards and the ledger. (The
    record copies each array when it is put: a later write cannot change it.)"""
    leaf = Tensor(x, requires_grad=True)
    box = []
    reset()
    y = fn.apply(Probe.apply(leaf, box), g)
    out.put(key(k, "y"), y.data)
    out.put(key(k, "ledger forward"), ledger())
    reset()
    grad = y.data if dy is None else dy
    y.backward(grad)
    out.put(key(k, "dx"), box[0] if box else None)
    out.put(key(k, "ledger backward"), ledger())
    out.put(key(k, "x after"), x)
    out.put(key(k, "dy after"), grad)


# --- what the child runs ----------------------------------------------------------------------

def f_and_g(student, out):
    """f and g alone, each rank with its own x and dy, in every layout, shape and dtype; then
    with dy being y's own array (f may return x itself: dy is then x)."""
    for li, sizes, gi, r, g in layouts():
        wr = MPI.COMM_WORLD.Get_rank()
        lay = "+".join(map(str, sizes))
        for name, fn in (("f", student.CopyToTP), ("g", student.ReduceFromTP)):
            for i, shape in enumerate(FG_SHAPES):
                for dtype in DTYPES:
                    out.case(f"{name} tp={g.size} (layout {lay}) rank {r}: shape {shape} {dtype}")
                    run_fg(out, key(name, li, wr, i, dtype), fn, g, fg_input(li, gi, r, i, dtype, 0),
                           fg_input(li, gi, r, i, dtype, 1))
            for dtype in ALIAS_DTYPES:
                out.case(f"{name} tp={g.size} (layout {lay}) rank {r}: shape {FG_SHAPES[0]} {dtype}, "
                         f"y.backward(y.data): dy is y's own array")
                run_fg(out, key(name, li, wr, "alias", dtype), fn, g, fg_input(li, gi, r, 0, dtype, 0), None)


def run_layer(out, k, layer, x, w, b, dy):
    """y = layer(x) then y.backward(dy): y, dL/dx as returned, the parameters' gradients, and
    every input afterwards."""
    leaf, wt, bt = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True), Tensor(b, requires_grad=True)
    box = []
    y = layer(wt, bt)(Probe.apply(leaf, box))
    out.put(key(k, "y"), y.data if isinstance(y, Tensor) else y)
    y.backward(dy)
    out.put(key(k, "dx"), box[0] if box else None)
    out.put(key(k, "dW"), wt.grad)
    out.put(key(k, "db"), bt.grad)
    for name, a in (("x", x), ("W", w), ("b", b), ("dy", dy)):
        out.put(key(k, name, "after"), a)


def column(student, out):
    """ColumnParallelLinear on this rank's columns of W and b, x whole."""
    for li, sizes, gi, r, g in layouts():
        wr, tp = MPI.COMM_WORLD.Get_rank(), g.size
        for i in layer_cases(tp):
            for dtype in DTYPES:
                out.case(layer_text("column", tp, sizes, r, i, dtype))
                x, W, b, dy = layer_inputs(li, gi, i, dtype)
                cols = shard(W.shape[1], tp, r)
                run_layer(out, key("column", li, wr, i, dtype),
                          lambda w_, b_: student.ColumnParallelLinear(w_, b_, g), x,
                          W[:, cols].copy(), b[cols].copy(), np.ascontiguousarray(dy[..., cols]))


def row(student, out):
    """RowParallelLinear on this rank's rows of W (and columns of x), b whole."""
    for li, sizes, gi, r, g in layouts():
        wr, tp = MPI.COMM_WORLD.Get_rank(), g.size
        for i in layer_cases(tp):
            for dtype in DTYPES:
                out.case(layer_text("row", tp, sizes, r, i, dtype))
                x, W, b, dy = layer_inputs(li, gi, i, dtype)
                rows = shard(W.shape[0], tp, r)
                run_layer(out, key("row", li, wr, i, dtype), lambda w_, b_: student.RowParallelLinear(w_, b_, g),
                          np.ascontiguousarray(x[..., rows]), W[rows].copy(), b.copy(), dy.copy())


def count_ids(tp: int):
    """(idx, targets) of the counting micro-batch."""
    cfg = COUNT_CFG
    ids = np.random.default_rng([5, tp]).integers(0, cfg.vocab_size, size=(2, COUNT_B, COUNT_T))
    return ids[0], ids[1]


def count(student, out):
    """One forward + backward of TensorParallelGPT built from the student's layers (the seam):
    the all-reduces minipar.comm and tensor parallelism's ledger counted, by kind, and the loss."""
    layer_calls = install(student)
    cfg, world = COUNT_CFG, MPI.COMM_WORLD
    wr = world.Get_rank()
    for tp in COUNT_TPS:
        sub = world.Split(wr // tp, wr)
        g = comm.Group(sub)
        sub.Free()
        for dtype in COUNT_DTYPES:
            k = key("count", tp, wr, dtype)
            out.case(f"tp={tp} rank {g.rank}, TensorParallelGPT L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd} "
                     f"B={COUNT_B} t={COUNT_T} {dtype}, one forward + backward")
            model = tpar.TensorParallelGPT(cfg, g, seed=0, dtype=np.dtype(dtype))
            idx, targets = count_ids(tp)
            reset()
            before = layer_calls()
            loss = model(idx, targets)
            # the forward ran your layers: 2 column- and 2 row-parallel per block
            out.put(key(k, "built"), [layer_calls() - before == 4 * cfg.n_layer])
            out.put(key(k, "ledger forward"), ledger())
            out.put(key(k, "bytes forward"), {n: int(v["bytes_sent"]) for n, v in tpar.traffic().items()})
            loss.backward()
            out.put(key(k, "ledger total"), ledger())
            out.put(key(k, "bytes total"), {n: int(v["bytes_sent"]) for n, v in tpar.traffic().items()})
            out.put(key(k, "loss"), float(loss.item()))
        g.comm.Free()


# --- the seam ---------------------------------------------------------------------------------

def install(student):
    """TensorParallelGPT's f, g and linear layers become the student's: a model builds each
    layer from this module's names when its parameter is first used (and keeps it), so every
    model run after this call runs the student's. Returns the count of the student's linear
    layers called so far."""
    layers = [0]

    class Column(student.ColumnParallelLinear):
        def __call__(self, x):
            layers[0] += 1
            return super().__call__(x)

    class Row(student.RowParallelLinear):
        def __call__(self, x):
            layers[0] += 1
            return super().__call__(x)

    tpar.CopyToTP, tpar.ReduceFromTP = student.CopyToTP, student.ReduceFromTP
    tpar.ColumnParallelLinear, tpar.RowParallelLinear = Column, Row
    return lambda: layers[0]
