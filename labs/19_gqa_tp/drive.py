"""Lab 19, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's head assignment, packed-qkv columns, key/value groups and key/value gradient
sum, and the seam. Nothing here judges; lab.py does, in the grader, against its own plain
oracle.

Cases: every (H, Hkv, tp) of SHAPES (multi-query Hkv = 1, multi-head Hkv = H, tp = 1, tp = Hkv,
tp > Hkv, tp = H, tp = 3 and 6, and shapes that must be refused: tp not dividing H, tp and Hkv
neither dividing the other, Hkv not dividing H, a rank outside the group); the sliced attention
of ATTENTION's shapes (B = 2, T = 5), each rank's heads computed by minipar's own grouped-query
attention op on the columns the student's qkv_columns picks; the gradient sum on groups of
p = 1, 2, 3 and 4 ranks cut from 4, split into key/value groups of every size that divides p
(and 0+2 / 1+3, ranks that are not neighbours), 1-D to 3-D gradients, an empty one, float64 and
float32. Every input is drawn from a seed, so the grader rebuilds each one without being told.
"""
import numpy as np

from labs.framework import rank_groups
from labs.results import key
from minipar.autograd.attention import CausalSelfAttention
from minipar.autograd.tensor import Function, Tensor
from minipar.model.llama import FAMILY as LLAMA
from minipar.parallel.tensor import tensor_parallel as tpar

# minipar's own layout of the heads (kv_share, a tensor-parallel model's shard and unshard), its
# key/value gradient sum (SumGradOver) and tensor parallelism's all-reduce, and minipar.comm's
# collectives: reached from the student's file, each raises (labs/child.py)
OWN = [f"minipar.parallel.tensor.tensor_parallel:{n}" for n in (
    "kv_share", "TensorParallelGPT.shard", "TensorParallelGPT.unshard", "SumGradOver.forward",
    "SumGradOver.backward", "tp_all_reduce", "tp_collective")] + \
      [f"minipar.comm:{n}" for n in ("all_reduce", "all_reduce_async", "reduce_scatter", "reduce_scatter_async",
                                     "all_gather", "all_gather_async", "broadcast", "reduce", "all_to_all",
                                     "all_to_all_async")]

# (H, Hkv) and the tp sizes tried with each: 1 .. H + 1 (so every tp that does not divide H too)
HEADS = ((1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (4, 1), (4, 2), (4, 4), (6, 1), (6, 2), (6, 3), (6, 6),
         (8, 2), (8, 4), (12, 4), (12, 6))
# Hkv that does not divide H: always refused
BAD_HEADS = ((4, 3, 1), (6, 4, 2), (8, 3, 2))
HEAD_SIZES = (3,)


def shapes():
    """(H, Hkv, tp) of the head, column and group criteria, in order: the valid and the
    refused mixed as they come, then Hkv not dividing H."""
    return [(H, Hkv, tp) for H, Hkv in HEADS for tp in range(1, H + 2)] + list(BAD_HEADS)


def valid(H, Hkv, tp) -> bool:
    """The plain rule (lab.py's oracle says it again in its own words)."""
    return H % Hkv == 0 and H % tp == 0 and (Hkv % tp == 0 or tp % Hkv == 0)


# the sliced attention: (H, Hkv, tp), head size 2, B = 2 sequences of T = 5 tokens
ATTENTION = ((2, 2, 1), (4, 1, 2), (4, 1, 4), (4, 2, 2), (4, 2, 4), (4, 4, 2), (6, 3, 3), (6, 1, 3),
             (6, 2, 6), (8, 2, 4), (8, 4, 2), (8, 2, 8))
ATT_B, ATT_T, ATT_HS = 2, 5, 2

# the gradient sum: gradients' shapes and dtypes, and the layouts of each group of p ranks
GRADS = (((6, 4), "float64"), ((5,), "float64"), ((2, 3, 2), "float64"), ((0, 4), "float64"),
         ((3, 4), "float32"))
P_MAX = 4


def layouts(p: int) -> list:
    """The key/value groups a group of p ranks is cut into: contiguous groups of every size
    that divides p (as tensor parallelism's), and for p = 4 the pairs {0, 2} and {1, 3}."""
    out = [[list(range(i, i + s)) for i in range(0, p, s)] for s in range(1, p + 1) if p % s == 0]
    if p == 4:
        out.append([[0, 2], [1, 3]])
    return out


def draw(shape, dtype, *seed) -> np.ndarray:
    """N(0, 1) drawn in float64 from the seed, rounded to dtype."""
    return np.asarray(np.random.default_rng([19, *seed]).standard_normal(shape), dtype=dtype)


def attention_inputs(i):
    """(qkv, dy) of attention case i: the packed projection (B, T, (H + 2 Hkv) hs) and the
    gradient of the output (B, T, H hs)."""
    H, Hkv, _ = ATTENTION[i]
    qkv = draw((ATT_B, ATT_T, (H + 2 * Hkv) * ATT_HS), "float64", 1, i)
    dy = draw((ATT_B, ATT_T, H * ATT_HS), "float64", 2, i)
    return qkv, dy


def grad_input(p, li, r, i):
    """Rank r's gradient of case i in layout li of a group of p ranks."""
    shape, dtype = GRADS[i]
    return draw(shape, dtype, 3, p, li, r, i)


def local_kv(Hkv, tp) -> int:
    """Key/value heads a rank computes (what minipar's Llama forward reads: TensorSplit.kv_heads)."""
    return max(1, Hkv // tp)


# --- recording ------------------------------------------------------------------------------

def refused_or(out, k, fn, *args):
    """fn(*args), recorded as ("returned", value) or ("raised", exception class, message). The
    stub's NotImplementedError, and minipar's own guard, are not recorded: they end the case."""
    try:
        got = fn(*args)
    except NotImplementedError:
        raise
    except Exception as e:                          # noqa: BLE001 - the judge says which was wanted
        if type(e).__name__ == "OwnCalled":
            raise
        try:
            text = str(e)
        except Exception:                           # noqa: BLE001 - a hostile __str__
            text = "<its message could not be printed>"
        out.put(k, ("raised", type(e).__name__, text[:300]))
        return None
    if type(got) is tuple:
        got = tuple(np.array(v) if type(v) is np.ndarray else v for v in got)
    out.put(k, ("returned", got))
    return got


def aliases(got, grad) -> bool:
    """Is the result grad itself, a view of it, or memory it shares (an empty view counts too)?"""
    if got is grad:
        return True
    return isinstance(got, np.ndarray) and (got.base is grad or np.shares_memory(got, grad))


# --- what the child runs ----------------------------------------------------------------------

def ranks_tried(H, tp) -> range:
    """Every rank of a tp that divides H; rank 0 alone of one that does not (refused anyway)."""
    return range(tp) if H % tp == 0 else range(1)


def head_cases():
    """(H, Hkv, tp, rank) of the head criterion: the ranks of every shape, then ranks outside
    their group (refused)."""
    return [(H, Hkv, tp, r) for H, Hkv, tp in shapes() for r in ranks_tried(H, tp)] + [(4, 2, 2, 2), (4, 1, 4, -1)]


def heads(student, out):
    for H, Hkv, tp, r in head_cases():
        out.case(f"rank_heads(n_head={H}, n_kv_head={Hkv}, tp={tp}, rank={r})")
        refused_or(out, key("heads", H, Hkv, tp, r), student.rank_heads, H, Hkv, tp, r)


def columns(student, out):
    for H, Hkv, tp in shapes():
        for hs in HEAD_SIZES:
            for r in ranks_tried(H, tp):
                out.case(f"qkv_columns(n_head={H}, n_kv_head={Hkv}, head_size={hs}, tp={tp}, rank={r})")
                refused_or(out, key("cols", H, Hkv, hs, tp, r), student.qkv_columns, H, Hkv, hs, tp, r)


def groups(student, out):
    for H, Hkv, tp in shapes():
        out.case(f"kv_groups(n_head={H}, n_kv_head={Hkv}, tp={tp})")
        refused_or(out, key("groups", H, Hkv, tp), student.kv_groups, H, Hkv, tp)


def attention(student, out):
    """Each rank's slice of the packed projection, by the student's columns, through minipar's
    own grouped-query attention (its H/tp query heads and its key/value heads), forward and
    backward: the output and the gradient of the slice, per rank."""
    for i, (H, Hkv, tp) in enumerate(ATTENTION):
        qkv, dy = attention_inputs(i)
        Hl, hs = H // tp, ATT_HS
        for r in range(tp):
            out.case(f"attention H={H} Hkv={Hkv} tp={tp} rank {r}: B={ATT_B} T={ATT_T} head size {hs}, the "
                     f"columns qkv_columns({H}, {Hkv}, {hs}, {tp}, {r}) picks")
            cols = np.asarray(student.qkv_columns(H, Hkv, hs, tp, r))
            local = Tensor(np.ascontiguousarray(qkv[..., cols]), requires_grad=True)
            y = CausalSelfAttention.apply(local, Hl, False, local_kv(Hkv, tp))
            y.backward(np.ascontiguousarray(dy[..., cols[:Hl * hs]]))     # the rank's query heads' outputs
            out.put(key("att", i, r, "y"), y.data)
            out.put(key("att", i, r, "dqkv"), local.grad)


def kv_sum(student, out):
    """sum_kv_grad on every rank of each group at once, each with the ranks of its own key/value
    group: the result, the gradient as it is afterwards, and whether the result is it."""
    for p, g in rank_groups(range(1, P_MAX + 1)):
        r = g.rank
        for li, layout in enumerate(layouts(p)):
            mine = next(grp for grp in layout if r in grp)
            for i, (shape, dtype) in enumerate(GRADS):
                out.case(f"sum_kv_grad on a group of {p} rank(s), rank {r}, ranks={mine} (key/value groups "
                         f"{layout}): grad {shape} {dtype}")
                grad = grad_input(p, li, r, i)
                k = key("sum", p, li, r, i)
                got = student.sum_kv_grad(g, grad, list(mine))
                out.put(k, got)
                out.put(key(k, "grad after"), grad)
                out.put(key(k, "aliases grad"), aliases(got, grad))


# --- the seam ---------------------------------------------------------------------------------

QKV = {"q_proj.weight": 0, "k_proj.weight": 1, "v_proj.weight": 2}


def block_of(cfg, name: str):
    """0, 1, 2 for a Llama block's q_proj, k_proj, v_proj weight; None for anything else."""
    if cfg.family is not LLAMA:
        return None
    return next((b for end, b in QKV.items() if name.endswith("self_attn." + end)), None)


class StudentKVSum(Function):
    """A key/value projection shard: identity forward, backward the student's sum_kv_grad over
    the ranks that hold the same head (what minipar's SumGradOver does over its kv group)."""

    def forward(self, p, sum_grad, group, ranks):
        self.sum_grad, self.group, self.ranks = sum_grad, group, ranks
        return p

    def backward(self, g):
        return self.sum_grad(self.group, g, list(self.ranks)), None, None, None


def install(student):
    """The tensor-parallel model's layout of q_proj, k_proj and v_proj becomes the student's
    qkv_columns (each rank's shard at init, in load_state_dict and in the checkpoint's
    consolidation), and every key/value shard's gradient goes through the student's
    sum_kv_grad over the group kv_groups gives for the key/value head rank_heads says this rank
    holds, counted in tensor parallelism's ledger as minipar's own sum is (kind kv_grads). Returns
    how many times the student's functions ran here."""
    calls = [0]
    own_init, own_shard, own_unshard = tpar.TensorParallelGPT.__init__, tpar.TensorParallelGPT.shard, \
        tpar.TensorParallelGPT.unshard

    def pieces(cfg, tp, r):
        """The student's columns of the packed [q | k | v], cut into this rank's q, k and v
        columns, each relative to its own projection."""
        H, Hkv, hs = cfg.n_head, cfg.kv_heads, cfg.head_size
        calls[0] += 1
        cols = np.asarray(student.qkv_columns(H, Hkv, hs, tp, r)).astype(np.int64).reshape(-1)
        n = [H // tp * hs, local_kv(Hkv, tp) * hs, local_kv(Hkv, tp) * hs]
        if cols.size != sum(n):
            raise ValueError(f"lab 19: qkv_columns({H}, {Hkv}, {hs}, {tp}, {r}) gave {cols.size} columns; rank {r} "
                             f"computes {H // tp} query and {local_kv(Hkv, tp)} key/value head(s) of {hs}: "
                             f"{sum(n)} columns")
        starts, widths = [0, H * hs, (H + Hkv) * hs], [H * hs, Hkv * hs, Hkv * hs]
        out, at = [], 0
        for b, name in enumerate("QKV"):
            part = cols[at:at + n[b]] - starts[b]
            at += n[b]
            bad = (part < 0) | (part >= widths[b])
            if bad.any():
                c = int(part[np.argmax(bad)] + starts[b])
                raise ValueError(f"lab 19: qkv_columns({H}, {Hkv}, {hs}, {tp}, {r}) puts packed column {c} in rank "
                                 f"{r}'s {name} block, outside {name}'s columns [{starts[b]}, "
                                 f"{starts[b] + widths[b]})")
            out.append(part)
        return out

    def shard(self, name, full, rank=None):
        b = block_of(self.cfg, name)
        if b is None:
            return own_shard(self, name, full, rank)
        if self.full_shapes.get(name) != tuple(np.shape(full)):
            return own_shard(self, name, full, rank)                 # minipar's own error
        r = self.tp_rank if rank is None else rank
        return np.ascontiguousarray(np.asarray(full)[..., pieces(self.cfg, self.tp_size, r)[b]])

    def unshard(self, name, shards):
        b = block_of(self.cfg, name)
        if b is None or len(shards) != self.tp_size:
            return own_unshard(self, name, shards)
        shape = self.full_shapes[name]
        full = np.full(shape, np.nan, dtype=np.asarray(shards[0]).dtype)   # a column nobody holds stays NaN
        for r in reversed(range(self.tp_size)):                   # a shared head: its first rank's copy
            full[..., pieces(self.cfg, self.tp_size, r)[b]] = shards[r]
        return full

    def init(self, cfg, tp_group, *args, **kwargs):
        own_init(self, cfg, tp_group, *args, **kwargs)
        if cfg.family is not LLAMA:
            return
        tp, r = tp_group.size, tp_group.rank
        calls[0] += 2
        _, kv = student.rank_heads(cfg.n_head, cfg.kv_heads, tp, r)
        every = student.kv_groups(cfg.n_head, cfg.kv_heads, tp)
        ranks = sorted(int(x) for x in every[int(kv[0])])
        if r not in ranks:
            raise ValueError(f"lab 19: kv_groups({cfg.n_head}, {cfg.kv_heads}, {tp}) gives key/value head {kv[0]} "
                             f"(rank {r}'s, by rank_heads) the ranks {ranks}, without rank {r}")
        self.split.student_kv = ranks

    def kv(self, p):
        ranks = getattr(self, "student_kv", None)
        if ranks is None:
            return own_kv(self, p)

        def summed(group, grad, ranks):
            calls[0] += 1
            if len(ranks) == 1:                             # minipar counts no sum of one rank either
                return student.sum_kv_grad(group, grad, ranks)
            # in tensor parallelism's ledger as minipar's own sum is (the run's summary counts it)
            return tpar.tp_collective("kv_grads", grad.size, lambda: student.sum_kv_grad(group, grad, ranks))

        return StudentKVSum.apply(p, summed, self.group, ranks)

    own_kv = tpar.TensorSplit.kv
    tpar.TensorParallelGPT.__init__, tpar.TensorParallelGPT.shard, tpar.TensorParallelGPT.unshard = init, shard, unshard
    tpar.TensorSplit.kv = kv
    return lambda: calls[0]
