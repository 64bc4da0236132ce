"""Lab 13, the student's side (labs/framework.py says what a lab is): the cases the child runs on
the student's split, block attention, merge, plan and ring, and the seam. Nothing here judges;
lab.py does, in the grader.

Cases: the split for C = 1..5, T = 0, 2C, 6C and 10C (and a teacher's "chunk_lengths"), and T
that 2C does not divide (2C + 1; C, which C divides and 2C does not); one block of attention
with and without masks, rows that see no key, no keys at all, scores in the hundreds, float32;
the merge of the pieces of a split key set (two and three pieces in every grouping and order,
-inf pieces, large and small lse, float32, no rows); the plan for C = 1..5 and every (rank,
owner); the ring on groups of p = 1, 2, 3, 4 ranks cut from 4, both layouts, chunks of 1, 2 and
3 tokens, float64 and float32, scores in the hundreds. Every input is drawn from a seed, so the
grader rebuilds them without being told.
"""
import math
import os

import numpy as np

from labs.framework import extra_cases, rank_groups
from labs.results import key
from minipar import comm
from minipar.parallel.context import context_parallel, packed, ring_attention as ra

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUTS = ("zigzag", "contiguous")
C_MAX = 5                               # the split and the plan: C = 1..5
P_MAX = 4                               # the ring: groups of 1..4 ranks
# minipar's own ring attention, its split, plan and merge, and the other attentions of context
# parallelism: reached from the student's file, each raises (labs/child.py)
OWN = [f"minipar.parallel.context.ring_attention:{n}" for n in (
    "positions", "pairs", "ring_traffic", "sub_blocks", "blocks", "ring_attention", "partial_attention", "merge",
    "_scores", "_ring_step", "_finish", "RingAttention.forward", "RingAttention.backward")] + \
    [f"minipar.comm:{n}" for n in ("send", "recv", "send_async", "recv_async", "all_gather", "all_to_all")] + \
    ["minipar.parallel.context.allgather_attention:AllGatherAttention.forward",
     "minipar.parallel.context.ulysses:UlyssesAttention.forward"]


def rng_for(*parts):
    """A case's random numbers; a teacher's "seed" ($MINIPAR_LAB_EXTRA/13_ring_attention/cases.json)
    draws other values for every case."""
    seed = int(extra_cases(HERE).get("seed", 0))
    return np.random.default_rng([*[int(p) for p in parts], seed])


def split(rank, C, T, layout):
    """The positions the inputs are cut at (the child needs them; the grader has its own)."""
    c = T // (2 * C)
    a, b = (rank, 2 * C - 1 - rank) if layout == "zigzag" else (2 * rank, 2 * rank + 1)
    return np.r_[a * c:(a + 1) * c, b * c:(b + 1) * c]


# --- the split ----------------------------------------------------------------------------------

def split_cases():
    """(C, T) of the split criterion: T = 2C c for c = 0, 1, 3, 5 (and a teacher's chunk lengths)."""
    cs = sorted({0, 1, 3, 5, *map(int, extra_cases(HERE).get("chunk_lengths", []))})
    return [(C, 2 * C * c) for C in range(1, C_MAX + 1) for c in cs]


def bad_split_cases():
    """(C, T) that 2C does not divide: 2C + 1, and C itself where C divides it and 2C does not."""
    return [(C, T) for C in range(1, C_MAX + 1) for T in sorted({2 * C + 1, C} - {2 * C})]


# --- one block and the merge ---------------------------------------------------------------------

BLOCK_CASES = (   # name, leading dims, tq, tk, hs, mask kind, q scale, dtype
    ("no mask", (2, 3), 4, 5, 8, None, 1.0, "float64"),
    ("the causal mask of a chunk against itself", (2, 2), 5, 5, 4, "causal", 1.0, "float64"),
    ("a mask hiding every key from rows 0 and 2", (1, 2), 4, 6, 4, "rows", 1.0, "float64"),
    ("one query, one key", (3,), 1, 1, 2, "causal", 1.0, "float64"),
    ("no keys at all (an empty piece)", (2,), 3, 0, 4, None, 1.0, "float64"),
    ("scores in the hundreds", (2, 2), 4, 7, 4, "random", 300.0, "float64"),
    ("q without leading dimensions", (), 3, 4, 5, "random", 1.0, "float64"),
    ("float32", (2, 2), 4, 5, 8, "causal", 1.0, "float32"),
)


def block_mask(kind, tq, tk, r):
    if kind is None:
        return None
    if kind == "causal":
        return np.triu(np.ones((tq, tk), bool), 1)
    m = r.random((tq, tk)) < 0.4
    if kind == "rows":
        m[0] = m[2] = True
    else:
        m[:, 0] = False                                  # every row sees a key
    return m


def block_input(i):
    """(q, k, v, mask) of BLOCK_CASES[i]."""
    _, lead, tq, tk, hs, kind, scale, dtype = BLOCK_CASES[i]
    r = rng_for(13, 1, i)
    q = r.standard_normal((*lead, tq, hs)) * scale
    k, v = r.standard_normal((2, *lead, tk, hs))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), block_mask(kind, tq, tk, r)


MERGE_CASES = (   # name, rows, key pieces (their sizes), hidden: which piece each of some rows cannot see
    ("two pieces", 5, (3, 6), "none", 1.0, "float64"),
    ("three pieces", 4, (2, 5, 3), "none", 1.0, "float64"),
    ("scores in the hundreds (lse far above 709 and below -709)", 4, (3, 4), "none", 400.0, "float64"),
    ("rows 0 and 1 see no key of the second piece (lse2 = -inf)", 4, (3, 3), "second", 1.0, "float64"),
    ("rows 0 and 1 see no key of the first piece (lse1 = -inf)", 4, (3, 3), "first", 1.0, "float64"),
    ("row 0 sees no key at all (both -inf)", 3, (2, 2), "both", 1.0, "float64"),
    ("three pieces, the middle one empty for rows 1 and 3", 4, (2, 3, 2), "middle", 50.0, "float64"),
    ("float32", 4, (3, 5), "none", 1.0, "float32"),
    ("no rows", 0, (2, 3), "none", 1.0, "float64"),
)
LEAD = (2, 3)                           # the merge's leading dimensions (B, H)
MERGE_HS = 4


def merge_keys(i):
    """(q, k, v, mask over all keys, piece boundaries) of MERGE_CASES[i]; mask True: hidden."""
    _, rows, sizes, hidden, scale, dtype = MERGE_CASES[i]
    r = rng_for(13, 2, i)
    tk = sum(sizes)
    q = r.standard_normal((*LEAD, rows, MERGE_HS)) * scale
    k, v = r.standard_normal((2, *LEAD, tk, MERGE_HS))
    if scale >= 400:                # rows 0 and 1 see every key far below and far above: lse ~ -1000, +1000
        k[..., 0] += 5
        q[..., 0, :], q[..., 1, :] = -500 * np.eye(MERGE_HS)[0], 500 * np.eye(MERGE_HS)[0]
    bounds = np.cumsum([0, *sizes])
    mask = np.zeros((rows, tk), bool)
    if hidden in ("second", "first", "middle"):
        piece = {"first": 0, "second": 1, "middle": 1}[hidden]
        for row in ((1, 3) if hidden == "middle" else (0, 1)):
            mask[row, bounds[piece]:bounds[piece + 1]] = True
    if hidden == "both":
        mask[0] = True
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), mask, bounds


def piece(q, k, v, mask):
    """The attention result over some keys, made here as the merge's input (not the student's)."""
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) / math.sqrt(q.shape[-1])
    s = np.where(mask, -np.inf, s)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
        e = np.where(np.isfinite(s), np.exp(s - np.where(np.isfinite(m), m, 0)), 0.0)
        total = e.sum(-1, keepdims=True)
        o = np.where(total > 0, (e @ v.astype(np.float64)) / np.where(total > 0, total, 1), 0.0)
        lse = (np.where(np.isfinite(m), m, 0) + np.log(total))[..., 0]
    return o.astype(q.dtype), lse.astype(q.dtype)


def merge_pieces(i):
    """The pieces' (o, lse) of MERGE_CASES[i], in key order."""
    q, k, v, mask, bounds = merge_keys(i)
    return [piece(q, k[..., a:b, :], v[..., a:b, :], mask[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def merge_orders(n):
    """The groupings and orders the child merges n pieces in: (name, tree), a tree a piece's
    index or a pair of trees (merged left to right)."""
    if n == 2:
        return [("merge(p0, p1)", (0, 1)), ("merge(p1, p0)", (1, 0))]
    return [("merge(merge(p0, p1), p2)", ((0, 1), 2)), ("merge(p0, merge(p1, p2))", (0, (1, 2))),
            ("merge(merge(p2, p0), p1)", ((2, 0), 1))]


# --- the ring -------------------------------------------------------------------------------------

RING_CASES = (   # name, (B, H), c tokens a chunk, hs, q scale, dtype
    ("B=2 H=2, 3 tokens a chunk", (2, 2), 3, 4, 1.0, "float64"),
    ("B=1 H=1, 1 token a chunk", (1, 1), 1, 8, 1.0, "float64"),
    ("B=1 H=2, 2 tokens a chunk, scores in the hundreds", (1, 2), 2, 4, 300.0, "float64"),
    ("B=2 H=1, 2 tokens a chunk, float32", (2, 1), 2, 4, 1.0, "float32"),
)


def ring_full(p, i):
    """The whole sequence's q, k, v (B, H, T, hs) of RING_CASES[i] on p ranks."""
    _, lead, c, hs, scale, dtype = RING_CASES[i]
    r = rng_for(13, 3, p, i)
    T = 2 * p * c
    q = r.standard_normal((*lead, T, hs)) * scale
    k, v = r.standard_normal((2, *lead, T, hs))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


class Counted:
    """Counts the sub-blocks a forward computes: calls of the student's block_attention (and, for
    minipar's own reference, of ring_attention._scores), by kind, with the shapes they had."""

    def __init__(self, fn, mask_at):
        self.fn, self.mask_at, self.full, self.diagonal, self.shapes = fn, mask_at, 0, 0, set()

    def __call__(self, q, k, *args, **kwargs):
        mask = args[self.mask_at] if len(args) > self.mask_at else kwargs.get("mask")
        if mask is None:
            self.full += 1
        else:
            self.diagonal += 1
        self.shapes.add((int(np.shape(q)[-2]), int(np.shape(k)[-2])))
        return self.fn(q, k, *args, **kwargs)


# --- what the child runs ----------------------------------------------------------------------

def returned(got):
    """What a call returned, its arrays copied as they are now."""
    if type(got) is tuple:
        return tuple(np.array(x) if type(x) is np.ndarray else x for x in got)
    return got


def split_run(student, out):
    for layout in LAYOUTS:
        for C, T in split_cases():
            for r in range(C):
                out.case(f"positions({r}, {C}, {T}, {layout!r})")
                got = student.positions(r, C, T, layout)
                out.put(key("pos", layout, C, T, r), np.array(got) if isinstance(got, np.ndarray) else got)
        for C, T in bad_split_cases():
            out.case(f"positions(0, {C}, {T}, {layout!r}): 2C = {2 * C} does not divide T")
            try:
                got = student.positions(0, C, T, layout)
            except NotImplementedError:
                raise
            except Exception as e:                  # noqa: BLE001 - what it raised is the answer
                out.put(key("bad", layout, C, T), f"raised {type(e).__name__}")
            else:
                out.put(key("bad", layout, C, T), f"returned {type(got).__name__} {got!r:.80}")


def block_run(student, out):
    for i, case in enumerate(BLOCK_CASES):
        q, k, v, mask = block_input(i)
        out.case(f"block_attention, {case[0]}: q {q.shape}, k {k.shape} {case[-1]}")
        got = student.block_attention(q, k, v, mask)
        out.put(key("block", i), returned(got))
        out.put(key("block", i, "inputs after"), [q, k, v] + ([] if mask is None else [mask]))


def tree_merge(student, tree, pieces):
    if isinstance(tree, int):
        return pieces[tree]
    a, b = (tree_merge(student, t, pieces) for t in tree)
    if not (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 2):
        raise TypeError(f"merge returned {type(a).__name__}, {type(b).__name__}: want a tuple (o, lse)")
    return student.merge(a[0], a[1], b[0], b[1])


def merge_run(student, out):
    for i, case in enumerate(MERGE_CASES):
        pieces = merge_pieces(i)
        for j, (name, tree) in enumerate(merge_orders(len(pieces))):
            out.case(f"merge, {case[0]}: {name}")
            inputs = [np.array(x) for p in pieces for x in p]
            got = tree_merge(student, tree, pieces)
            out.put(key("merge", i, j), returned(got))
            changed = [n for n, (a, b) in enumerate(zip(inputs, [x for p in pieces for x in p]))
                       if not np.array_equal(a, b, equal_nan=True)]
            out.put(key("merge", i, j, "changed"), changed)


def plan_run(student, out):
    for layout in LAYOUTS:
        for C in range(1, C_MAX + 1):
            for r in range(C):
                for owner in range(C):
                    out.case(f"plan({r}, {owner}, {C}, {layout!r})")
                    out.put(key("plan", layout, C, r, owner), student.plan(r, owner, C, layout))


def ring_run(student, out):
    mine = Counted(student.block_attention, 1)          # (q, k, v, mask)
    student.block_attention = mine
    scores = ra._scores                                         # noqa: SLF001 - the reference's sub-blocks
    theirs = ra._scores = Counted(scores, 0)                    # noqa: SLF001 - (q, k, mask, scale)
    try:
        for p, g in rank_groups(range(1, P_MAX + 1)):
            r = g.rank
            for layout in LAYOUTS:
                for i, case in enumerate(RING_CASES):
                    out.case(f"p={p} rank {r} {layout}: {case[0]}")
                    q, k, v = (x[..., split(r, p, x.shape[-2], layout), :].copy() for x in ring_full(p, i))
                    before = [q.copy(), k.copy(), v.copy()]
                    for c in (mine, theirs):
                        c.full, c.diagonal, c.shapes = 0, 0, set()
                    comm.reset_traffic()
                    got = student.ring_attention(g, q, k, v, layout)
                    t = comm.traffic()
                    k_ = key("ring", p, r, layout, i)
                    out.put(k_, returned(got))
                    out.put(key(k_, "changed"), [n for n, (a, b) in enumerate(zip(before, (q, k, v)))
                                                 if not np.array_equal(a, b)])
                    out.put(key(k_, "blocks"), [mine.full + theirs.full, mine.diagonal + theirs.diagonal,
                                                sorted(mine.shapes | theirs.shapes)])
                    out.put(key(k_, "traffic"), {op: [int(e["calls"]), int(e["bytes_sent"])] for op, e in t.items()})
    finally:
        ra._scores = scores                                     # noqa: SLF001


# --- the seam ---------------------------------------------------------------------------------

def install(student):
    """The trainer's ring attention (--cp C, --cp-impl ring) becomes the student's forward, and its
    split of every sequence the student's positions; the backward is minipar's
    (RingAttention.backward), from the q, k, v, o and lse the student's forward gives it."""
    calls = [0]

    class StudentRing(ra.RingAttention):
        def forward(self, q, k, v, group, layout="zigzag", overlap=True):
            calls[0] += 1
            self.group, self.layout, self.T = group, layout, q.shape[-2] * group.size
            self.scale = 1.0 / math.sqrt(q.shape[-1])
            o, lse = student.ring_attention(group, q, k, v, layout)
            o, lse = np.asarray(o), np.asarray(lse)
            if o.shape != q.shape or lse.shape != q.shape[:-1]:
                raise ValueError(f"ring_attention returned o {o.shape} and lse {lse.shape} for q {q.shape}: "
                                 f"want o {q.shape} and lse {q.shape[:-1]}")
            self.save(q, k, v, o, lse)
            return o

    packed.RingSelfAttention.core = StudentRing

    def split_positions(rank, C, T, layout="zigzag"):
        return np.asarray(student.positions(rank, C, T, layout))

    context_parallel.positions = split_positions
    return lambda: calls[0]
