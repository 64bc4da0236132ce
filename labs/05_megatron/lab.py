"""Lab 05's seam and criteria (labs/framework.py says what a lab is).

Seam: the four names of minipar/parallel/tensor_parallel.py that TensorParallelGPT builds its
layers from: CopyToTP (f) and ReduceFromTP (g), which copy_to_tp / reduce_from_tp apply (the
vocabulary-parallel embedding's g and the LM head's f use them too), and ColumnParallelLinear
and RowParallelLinear, which TensorParallelGPT.__init__ constructs (so install() runs before
the model is built). Every all-reduce of tensor parallelism but the cross-entropy's three is
then the student's.
Oracle: NumPy on every rank's inputs gathered by MPI's own Allgather (f and g), and the full
linear layer y = x @ W + b with its textbook gradients (the layers), in float64, on tp groups
of 2 (two of them) and 4 cut from 4 ranks; megatron_count for the number of all-reduces.
"""
import numpy as np
from mpi4py import MPI

from labs import framework
from labs.framework import Criterion, collective_uses, gathered, trainer_flags
from minipar import comm
from minipar.model import GPTConfig
from minipar.parallel import tensor_parallel as tpar
from minipar.tensor import Tensor

TITLE = "Megatron's f and g, and the column- and row-parallel linear layers"
TPS = (2, 4)
SHAPES = [(2, 3, 8), (1, 5, 4), (7,)]                  # f and g: any shape
LAYERS = [(2, 3, 8, 12), (1, 4, 16, 8)]                # (B, t, Cin, Cout): Cin, Cout divisible by 4
RTOL = 1e-12


def groups():
    """(tp, Group) for tp = 2 (ranks {0, 1} and {2, 3}, two groups at once) and tp = 4."""
    world = MPI.COMM_WORLD
    for tp in TPS:
        sub = world.Split(world.Get_rank() // tp, world.Get_rank())
        g = comm.Group(sub)
        sub.Free()
        yield tp, g
        g.comm.Free()


def normal(*seed, shape):
    return np.random.default_rng(list(seed)).standard_normal(shape)


def expect(got, want, what):
    """got == want to RTOL, entries near zero judged on the tensor's scale (sums reordered)."""
    assert got is not None, f"{what}: None (no gradient reached this tensor)"
    atol = RTOL * float(np.abs(want).max()) if np.size(want) else 0.0
    framework.expect(got, want, what, rtol=RTOL, atol=atol)


def unchanged(a, keep, what):
    assert np.array_equal(a, keep), f"{what} was modified in place (the caller still needs it)"


# --- the criteria -------------------------------------------------------------------------

def check_static(student):
    """The student's file calls no MPI collective (the scan minipar's own code passes)."""
    found = collective_uses(student)
    assert not found, "calls MPI's own collectives: " + "; ".join(found[:3])


def check_f_and_g(student):
    """f and g alone, each rank with its own x and its own upstream gradient dy."""
    for tp, g in groups():
        r = g.rank
        for shape in SHAPES:
            x, dy = normal(tp, r, 0, shape=shape), normal(tp, r, 1, shape=shape)
            xs, dys = gathered(g, x), gathered(g, dy)
            cases = (("f", student.CopyToTP, x, "x", dys.sum(0), "the sum of dy over the ranks"),
                     ("g", student.ReduceFromTP, xs.sum(0), "the sum of x over the ranks", dy, "dy"))
            for name, fn, y_want, y_is, dx_want, dx_is in cases:
                what = f"{name} tp={tp} rank {r} shape {shape} float64"
                keep_x, keep_dy = x.copy(), dy.copy()
                xt = Tensor(x, requires_grad=True)
                y = fn.apply(xt, g)
                expect(y.data, y_want, f"{what}: forward y (want {y_is})")
                y.backward(dy)
                expect(xt.grad, dx_want, f"{what}: backward dL/dx (want {dx_is})")
                unchanged(x, keep_x, f"{what}: the input x")
                unchanged(dy, keep_dy, f"{what}: the gradient dy given to backward")


def check_column(student):
    """ColumnParallelLinear on rank r's columns against the full y = x @ W + b."""
    for tp, g in groups():
        r = g.rank
        for B, t, cin, cout in LAYERS:
            x, dy = normal(0, B, t, cin, shape=(B, t, cin)), normal(1, B, t, cout, shape=(B, t, cout))
            W, b = normal(2, cin, cout, shape=(cin, cout)), normal(3, cout, shape=cout)
            cols = slice(r * cout // tp, (r + 1) * cout // tp)
            what = f"column-parallel tp={tp} rank {r} x (B, t, Cin)=({B}, {t}, {cin}) Cout={cout} float64"
            xt = Tensor(x.copy(), requires_grad=True)
            w, bias = Tensor(W[:, cols].copy(), requires_grad=True), Tensor(b[cols].copy(), requires_grad=True)
            y = student.ColumnParallelLinear(w, bias, g)(xt)
            expect(y.data, (x @ W + b)[..., cols], f"{what}: forward y (this rank's columns {cols.start}:{cols.stop})")
            y.backward(np.ascontiguousarray(dy[..., cols]))
            expect(xt.grad, dy @ W.T, f"{what}: dL/dx (the whole gradient, on every rank)")
            expect(w.grad, x.reshape(-1, cin).T @ dy[..., cols].reshape(-1, cols.stop - cols.start),
                   f"{what}: dL/dW of the shard (Cin, Cout/tp)")
            expect(bias.grad, dy[..., cols].sum((0, 1)), f"{what}: dL/db of the shard (Cout/tp,)")


def check_row(student):
    """RowParallelLinear on rank r's rows against the full y = x @ W + b."""
    for tp, g in groups():
        r = g.rank
        for B, t, cin, cout in LAYERS:
            x, dy = normal(0, B, t, cin, shape=(B, t, cin)), normal(1, B, t, cout, shape=(B, t, cout))
            W, b = normal(2, cin, cout, shape=(cin, cout)), normal(3, cout, shape=cout)
            rows = slice(r * cin // tp, (r + 1) * cin // tp)
            what = f"row-parallel tp={tp} rank {r} x (B, t, Cin/tp)=({B}, {t}, {cin // tp}) Cout={cout} float64"
            xt = Tensor(np.ascontiguousarray(x[..., rows]), requires_grad=True)
            w, bias = Tensor(W[rows].copy(), requires_grad=True), Tensor(b.copy(), requires_grad=True)
            y = student.RowParallelLinear(w, bias, g)(xt)
            expect(y.data, x @ W + b, f"{what}: forward y (the whole output, on every rank)")
            y.backward(dy.copy())
            expect(xt.grad, (dy @ W.T)[..., rows], f"{what}: dL/dx of this rank's columns {rows.start}:{rows.stop}")
            expect(w.grad, x[..., rows].reshape(-1, rows.stop - rows.start).T @ dy.reshape(-1, cout),
                   f"{what}: dL/dW of the shard (Cin/tp, Cout)")
            expect(bias.grad, dy.sum((0, 1)), f"{what}: dL/db (the whole bias gradient, on every rank)")


COUNT_CFG = GPTConfig(vocab_size=256, block_size=8, n_layer=2, n_head=4, n_embd=16)
COUNT_B, COUNT_T = 2, 8


def check_count(student):
    """One forward + backward of TensorParallelGPT built from the student's layers: the
    all-reduces minipar's ledger counted, against Megatron's 4L + 5 (megatron_count)."""
    install(student)
    cfg, B, t = COUNT_CFG, COUNT_B, COUNT_T
    L, C = cfg.n_layer, cfg.n_embd
    for tp, g in groups():
        r = g.rank
        model = tpar.TensorParallelGPT(cfg, g, seed=0, dtype=np.float64)
        assert isinstance(model.mlp[0].c_fc, student.ColumnParallelLinear) and \
            isinstance(model.attn[0].c_proj, student.RowParallelLinear), "the model was not built from your layers"
        ids = np.random.default_rng([5, tp]).integers(0, cfg.vocab_size, size=(2, B, t))
        comm.reset_traffic()
        tpar.reset_traffic()
        loss = model(ids[0], ids[1])
        forward = comm.traffic().get("all_reduce", {}).get("calls", 0)
        loss.backward()
        total = comm.traffic().get("all_reduce", {}).get("calls", 0)
        calls, elements = tpar.megatron_count(cfg, B, t)
        kinds = {k: v["calls"] for k, v in tpar.traffic().items()}
        what = f"tp={tp} rank {r}, L={L} B={B} t={t} C={C}, one forward + backward"
        assert (forward, total - forward) == (2 * L + 4, 2 * L + 1), \
            f"{what}: {forward} all-reduces forward and {total - forward} backward, {total} in all; " \
            f"Megatron's count is 2L+4 = {2 * L + 4} forward (the layers' g's, the embedding's g, the " \
            f"cross-entropy's 3) and 2L+1 = {2 * L + 1} backward (the f's), 4L+5 = {calls}; by kind {kinds}"
        want = {"f": 2 * L + 1, "g": 2 * L + 1, "cross_entropy": 3}
        assert kinds == want, f"{what}: tensor_parallel.traffic() counted {kinds}, want {want}: call " \
                              f"tp_all_reduce(group, x, 'sum', 'f') in f and ... 'g') in g"
        counted = sum(v["elements"] for v in tpar.traffic().values())
        assert counted == elements, f"{what}: {counted} elements all-reduced, Megatron's (4L+2) B t C + 3 B t " \
                                    f"= {elements}"


# --- the seam -------------------------------------------------------------------------------

def install(student):
    """TensorParallelGPT's f, g and linear layers become the student's (counted), for every
    model built after this call."""
    calls = [0]

    class F(student.CopyToTP):
        def forward(self, *args, **kwargs):
            calls[0] += 1
            return super().forward(*args, **kwargs)

    class G(student.ReduceFromTP):
        def forward(self, *args, **kwargs):
            calls[0] += 1
            return super().forward(*args, **kwargs)

    class Column(student.ColumnParallelLinear):
        def __call__(self, x):
            calls[0] += 1
            return super().__call__(x)

    class Row(student.RowParallelLinear):
        def __call__(self, x):
            calls[0] += 1
            return super().__call__(x)

    tpar.CopyToTP, tpar.ReduceFromTP = F, G
    tpar.ColumnParallelLinear, tpar.RowParallelLinear = Column, Row
    return lambda: calls[0]



CRITERIA = [
    Criterion("no MPI collective", check=check_static, timeout=30,
              hint="all-reduce only with minipar.parallel.tensor_parallel.tp_all_reduce"),
    Criterion("f and g against NumPy", ranks=4, check=check_f_and_g, timeout=30,
              hint="f: forward returns x, backward sums the gradient over the group; g the other way "
                   "round. Each rank's x and dy differ here, so a sum in the wrong pass shows"),
    Criterion("column-parallel vs full linear", ranks=4, check=check_column, timeout=30,
              hint="x goes through f before the matmul: each rank's columns give only part of dL/dx "
                   "(minipar.parallel.tensor_parallel.ColumnParallelLinear's docstring)"),
    Criterion("row-parallel vs full linear", ranks=4, check=check_row, timeout=30,
              hint="g sums the partial products x_r @ W_r; the bias is added once, after the sum "
                   "(added before it, every rank's copy would be summed: tp times the bias)"),
    Criterion("4L+5 all-reduces per micro-batch", ranks=4, check=check_count, timeout=30,
              hint="2 per layer forward (g) and 2 backward (f), and nothing else in the layers; "
                   "minipar.parallel.tensor_parallel.megatron_count is the formula, "
                   "minipar.parallel.tensor_parallel.traffic what was sent, by kind"),
    Criterion("trainer --tp 4 --verify", ranks=4, trainer=trainer_flags("--tp", "4", n_head=4), timeout=60,
              hint="tp 4 for 3 steps against one process: every operation on a parameter belongs "
                   "in __call__, where each step's graph is built; the verify: line names the "
                   "parameter that differs most"),
    Criterion("trainer --tp 2 --verify", ranks=4, trainer=trainer_flags("--tp", "2", n_head=4), timeout=60,
              hint="dp 2 x tp 2 for 3 steps against one process: the data-parallel buckets wait "
                   "for every parameter's gradient, so one that never arrives stops the step"),
]
