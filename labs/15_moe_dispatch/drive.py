"""Lab 15, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's routing, capacity, dispatch order, expert-parallel dispatch and combine, and
the seam. Nothing here judges; lab.py does, in the grader.

Every case's inputs are drawn from its own seed (rng_for), so the grader rebuilds them
without being told: the router's logits, the choices and the kept mask, the rows of x each
rank sends and the expert outputs it sends back.
"""
import os

import numpy as np

from labs.framework import extra_cases, rank_groups
from labs.results import key
from minipar import comm
from minipar.autograd import ops
from minipar.autograd.dtypes import compute, store
from minipar.autograd.tensor import Function, is_grad_enabled
from minipar.model import moe
from minipar.parallel.expert import expert_parallel

HERE = os.path.dirname(os.path.abspath(__file__))
P_MAX = 4
# minipar's own routing, capacity, dispatch order, combine and expert-parallel dispatch:
# reached from the student's file, each raises (labs/child.py)
OWN = [f"minipar.model.moe:{n}" for n in ("top_k", "probabilities", "capacity", "claim_slots", "assignments",
                                          "combine", "moe_mlp")] + \
      ["minipar.model.moe:Router.forward", "minipar.model.moe:ScatterRows.forward"] + \
      [f"minipar.parallel.expert.expert_parallel:{n}" for n in ("expert_major", "run_experts")]


def rng_for(*parts):
    """A case's random numbers; a teacher's "seed" ($MINIPAR_LAB_EXTRA/15_moe_dispatch/cases.json)
    draws other values for every case."""
    seed = int(extra_cases(HERE).get("seed", 0))
    return np.random.default_rng([*parts, seed])


# --- top-k ------------------------------------------------------------------------------------

def topk_cases():
    """(name, logits (N, E) float64, k, router)."""
    out = []
    r = rng_for(1)
    z = r.standard_normal((9, 6))
    for k in (1, 2, 6):
        for router in ("switch", "mixtral"):
            out.append((f"9 tokens x 6 experts, k={k}, {router}", z, k, router))
    ties = np.array([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 2.0, 1.0, 2.0, 0.0],
                     [3.0, -1.0, 3.0, 3.0, 0.5, 0.5], [0.25, 0.25, 0.0, 0.25, 0.0, 0.25]])
    for k in (1, 2, 3, 6):
        out.append((f"ties (equal logits) k={k}, switch", ties, k, "switch"))
    out.append(("ties (equal logits) k=2, mixtral", ties, 2, "mixtral"))
    out.append(("logits of +-1e3 (softmax overflows without the max), k=2", r.standard_normal((5, 4)) * 1e3, 2,
                "switch"))
    out.append(("logits of +-1e3, k=1, switch", r.standard_normal((5, 4)) * 1e3, 1, "switch"))
    out.append(("one expert, k=1, switch", r.standard_normal((3, 1)), 1, "switch"))
    out.append(("no tokens (0 x 5), k=2", np.zeros((0, 5)), 2, "switch"))
    return out


# --- capacity and the claim order ------------------------------------------------------------

CAPACITY = [(10, 2, 4, 1.0), (10, 2, 4, 1.25), (6, 2, 4, 1.25), (7, 1, 4, 1.0), (5, 1, 8, 1.0), (7, 2, 3, 1.5),
            (16, 2, 4, 1.0), (9, 3, 5, 0.5), (0, 2, 4, 1.25), (10, 2, 4, 0.0), (1, 1, 1, 2.0)]


def choices(r, N, E, K, bias=None):
    """N distinct-expert choices of K (the router's top-k never repeats an expert), drawn with
    `bias` (probabilities over the experts) to make some experts popular."""
    out = np.zeros((N, K), dtype=np.int64)
    for n in range(N):
        out[n] = r.choice(E, K, replace=False, p=bias)
    return out


DOC_EXAMPLE = np.array([[0, 1], [1, 0], [1, 0], [2, 1], [3, 1], [2, 1]])     # docs/moe.md's worked example


def claim_cases():
    """(name, choice (N, K) int64, experts, cap or None)."""
    r = rng_for(2)
    skew4 = np.array([0.55, 0.25, 0.15, 0.05])
    return [
        ("docs/moe.md's example: 6 tokens, E=4, k=2, cap 4", DOC_EXAMPLE, 4, 4),
        ("11 tokens, E=4, k=2, cap 7 (skewed to expert 0)", choices(r, 11, 4, 2, skew4), 4, 7),
        ("13 tokens, E=3, k=1, cap 5 (skewed)", choices(r, 13, 3, 1, [0.6, 0.3, 0.1]), 3, 5),
        ("9 tokens, E=5, k=3, cap 4", choices(r, 9, 5, 3, [0.4, 0.3, 0.1, 0.1, 0.1]), 5, 4),
        ("10 tokens, E=4, k=4 (k = E), cap 6", choices(r, 10, 4, 4), 4, 6),
        ("8 tokens, E=4, k=2, experts 3 never chosen, cap 4", choices(r, 8, 4, 2, [0.5, 0.3, 0.2, 0.0]), 4, 4),
        ("12 tokens, E=4, k=2, no capacity (None)", choices(r, 12, 4, 2, skew4), 4, None),
        ("7 tokens, E=4, k=2, cap 0: every assignment dropped", choices(r, 7, 4, 2), 4, 0),
        ("no tokens (0 x 2), E=4, cap 3", np.zeros((0, 2), dtype=np.int64), 4, 3),
    ]


# --- the dispatch order and the load per expert -------------------------------------------------

def assignment_cases():
    """(name, choice (N, K) int64, kept (N, K) bool, experts)."""
    r = rng_for(3)
    c1 = choices(r, 10, 5, 2, [0.3, 0.3, 0.2, 0.2, 0.0])
    c2 = choices(r, 7, 3, 3)
    c3 = choices(r, 9, 4, 1)
    return [
        ("docs/moe.md's example, t16 and t17's second choices dropped", DOC_EXAMPLE, np.array(
            [[True, True]] * 4 + [[True, False]] * 2), 4),
        ("10 tokens, E=5 (expert 4 never chosen), k=2, a third dropped", c1, r.random((10, 2)) > 0.33, 5),
        ("7 tokens, E=3, k=3 (k = E), some dropped", c2, r.random((7, 3)) > 0.25, 3),
        ("9 tokens, E=4, k=1, nothing dropped", c3, np.ones((9, 1), dtype=bool), 4),
        ("7 tokens, E=3, k=3, every assignment dropped", c2, np.zeros((7, 3), dtype=bool), 3),
        ("no tokens (0 x 2), E=4", np.zeros((0, 2), dtype=np.int64), np.zeros((0, 2), dtype=bool), 4),
    ]


# --- the combine -------------------------------------------------------------------------------

def combine_cases():
    """(name, choice (N, K), kept (N, K), weights (N, K), dense (N, E, C): what expert e's MLP
    gives token n, and the order the kept assignments come in (a permutation of them, the
    expert-major one or any other: the combine must not care))."""
    out = []
    r = rng_for(4)
    for name, N, E, K, C, drop, order in (
            ("8 tokens, E=4, k=2, C=3, some dropped, expert-major order", 8, 4, 2, 3, 0.3, "expert"),
            ("8 tokens, E=4, k=2, C=3, some dropped, shuffled order", 8, 4, 2, 3, 0.3, "shuffled"),
            ("6 tokens, E=3, k=3 (k = E), C=2, nothing dropped", 6, 3, 3, 2, 0.0, "expert"),
            ("5 tokens, E=4, k=1, C=4, token 2 dropped", 5, 4, 1, 4, None, "expert"),
            ("4 tokens, E=4, k=2, C=3, every assignment dropped", 4, 4, 2, 3, 1.0, "expert"),
            ("1 token, E=2, k=2, C=5", 1, 2, 2, 5, 0.0, "shuffled")):
        choice = choices(r, N, E, K)
        kept = r.random((N, K)) >= drop if drop is not None else np.arange(N)[:, None] != 2
        w = r.random((N, K)) + 0.1
        weights = w / w.sum(1, keepdims=True) if K > 1 else w
        dense = r.standard_normal((N, E, C))
        out.append((name, choice, kept, weights, dense, order))
    return out


def combine_inputs(choice, kept, dense, order, salt):
    """The combine's rows, tokens and slots: one per kept (token, choice), in `order`."""
    K = choice.shape[1]
    pairs = [(n, k) for k in range(K) for n in range(choice.shape[0]) if kept[n, k]]
    pairs.sort(key=lambda nk: choice[nk[0], nk[1]])                # by expert (stable: choice, token)
    if order == "shuffled":
        perm = rng_for(5, salt).permutation(len(pairs))
        pairs = [pairs[i] for i in perm]
    tokens = np.array([n for n, _ in pairs], dtype=np.int64)
    slots = np.array([n * K + k for n, k in pairs], dtype=np.int64)
    C = dense.shape[2]
    rows = np.array([dense[n, choice[n, k]] for n, k in pairs]).reshape(len(pairs), C)
    return rows, tokens, slots


# --- the expert-parallel dispatch and send-back ---------------------------------------------------

DISPATCH = ("random rows per expert, zeros among them", "rank 0 sends nothing",
            "expert 1 gets no row from anyone", "one token per rank (m < p), rows of 0 or 1",
            "E = p: one expert per rank", "nothing for the last rank's experts", "float32 rows")
C_EP = 3


def experts_of(case: int, p: int) -> int:
    return p if case == 4 else 12                    # 12: 12, 6, 4 and 3 experts per rank for p = 1..4


def dispatch_input(p, s, case):
    """Rank s's (x (N, C), tokens (M,), rows (E,)) in dispatch case `case` (an index into DISPATCH):
    its kept assignments' tokens grouped by expert, rows[e] of them for expert e."""
    r = rng_for(6, p, s, case)
    E = experts_of(case, p)
    N = 1 if case == 3 else 5
    rows = r.integers(0, 3 if case != 3 else 2, E)
    if case == 1 and s == 0:
        rows[:] = 0
    if case == 2:
        rows[1] = 0
    if case == 5:
        rows[E - E // p:] = 0
    tokens = np.concatenate([np.sort(r.choice(N, min(n, N), replace=False)) for n in rows]).astype(np.int64) \
        if rows.sum() else np.zeros(0, dtype=np.int64)
    rows = np.array([min(n, N) for n in rows], dtype=np.int64)
    dtype = np.float32 if case == 6 else np.float64
    x = r.integers(-99, 99, (N, C_EP)).astype(dtype) / 4
    return x, tokens, rows


def received_counts(p, r, case):
    """counts (p, E/p): the rows rank r's experts get from each source (built from every rank's seed)."""
    E = experts_of(case, p)
    El = E // p
    return np.array([dispatch_input(p, s, case)[2][r * El:(r + 1) * El] for s in range(p)], dtype=np.int64)


def back_input(p, r, case):
    """Rank r's experts' outputs (sum of its counts, C): the rows send_back returns to their sources."""
    counts = received_counts(p, r, case)
    dtype = np.float32 if case == 6 else np.float64
    return (rng_for(7, p, r, case).integers(-99, 99, (int(counts.sum()), C_EP)) / 8).astype(dtype), counts


def ledger_of():
    t = comm.traffic()
    return int(sum(v["bytes_sent"] for v in t.values())), {op: int(v["calls"]) for op, v in t.items()}


# --- what the child runs ----------------------------------------------------------------------

def copy(v):
    if type(v) is tuple:
        return tuple(np.array(a) if isinstance(a, np.ndarray) else a for a in v)
    return np.array(v) if isinstance(v, np.ndarray) else v


def topk(student, out):
    for i, (name, z, k, router) in enumerate(topk_cases()):
        out.case(f"top_k: {name}")
        logits = z.copy()
        out.put(key("topk", i), copy(student.top_k(logits, k, router)))
        out.put(key("topk", i, "logits after"), logits)


def capacity_and_drops(student, out):
    for i, (tokens, k, E, F) in enumerate(CAPACITY):
        out.case(f"capacity(tokens={tokens}, k={k}, experts={E}, factor={F})")
        out.put(key("cap", i), student.capacity(tokens, k, E, F))
    for i, (name, choice, E, cap) in enumerate(claim_cases()):
        out.case(f"claim_slots: {name}")
        c = choice.copy()
        out.put(key("claim", i), copy(student.claim_slots(c, E, cap)))
        out.put(key("claim", i, "choice after"), c)


def dispatch_order(student, out):
    for i, (name, choice, kept, E) in enumerate(assignment_cases()):
        out.case(f"assignments: {name}")
        c, m = choice.copy(), kept.copy()
        out.put(key("asg", i), copy(student.assignments(c, m, E)))
        out.put(key("asg", i, "choice after"), c)
        out.put(key("asg", i, "kept after"), m)


def combine(student, out):
    for i, (name, choice, kept, weights, dense, order) in enumerate(combine_cases()):
        out.case(f"combine: {name}")
        rows, tokens, slots = combine_inputs(choice, kept, dense, order, i)
        w, rs = weights.copy(), rows.copy()
        y = student.combine(rs, tokens.copy(), slots.copy(), w, choice.shape[0])
        out.put(key("comb", i), copy(y))
        out.put(key("comb", i, "aliases"), bool(isinstance(y, np.ndarray) and (np.shares_memory(y, rs)
                                                                                or np.shares_memory(y, w))))
        out.put(key("comb", i, "rows after"), rs)
        out.put(key("comb", i, "weights after"), w)


def groups():
    """(p, Group) for p = 1..4 that hold this rank: ranks 0..p-1 of the world."""
    return rank_groups(range(1, P_MAX + 1))


def dispatch_and_back(student, out):
    """Each case: the student's dispatch of this rank's rows, then (from inputs of their own, so
    that a wrong dispatch does not spoil them) its send_back of this rank's experts' outputs."""
    for p, g in groups():
        r = g.rank
        for case, name in enumerate(DISPATCH):
            x, tokens, rows = dispatch_input(p, r, case)
            out.case(f"p={p} rank {r} dispatch: {name}, E={len(rows)}, rows per expert {rows.tolist()}")
            xc = x.copy()
            comm.reset_traffic()
            got = student.dispatch(g, xc, tokens.copy(), rows.copy())
            out.put(key("ledger", "disp", p, r, case), ledger_of())
            out.put(key("disp", p, r, case), copy(got))
            out.put(key("disp", p, r, case, "x after"), xc)

            rows_out, counts = back_input(p, r, case)
            out.case(f"p={p} rank {r} send_back: {name}, counts from each source {counts.tolist()}")
            oc = rows_out.copy()
            comm.reset_traffic()
            got = student.send_back(g, oc, counts.copy())
            out.put(key("ledger", "back", p, r, case), ledger_of())
            out.put(key("back", p, r, case), copy(got))
            out.put(key("back", p, r, case, "out after"), oc)


# --- the seam ---------------------------------------------------------------------------------

class StudentCombine(Function):
    """y = the student's combine(rows, tokens, slots, weights, n); backward: each row's gradient
    w g[token], each slot's weight gradient <g[token], row> (the adjoint of a weighted scatter)."""

    def forward(self, rows, tokens, slots, weights, n, student):
        self.save(compute(rows), compute(weights), tokens, slots)
        self.dtypes = rows.dtype, weights.dtype
        return store(np.asarray(student.combine(rows, tokens, slots, weights, n)), rows.dtype)

    def backward(self, g):
        rows, weights, tokens, slots = self.saved
        g = compute(g)
        gt = g[tokens]
        d_rows = gt * weights.reshape(-1)[slots][:, None]
        d_weights = np.zeros(weights.size, dtype=g.dtype)
        d_weights[slots] = (gt * rows).sum(1)
        return store(d_rows, self.dtypes[0]), None, None, store(d_weights.reshape(weights.shape), self.dtypes[1]), \
            None, None


class StudentDispatch(Function):
    """xe = the student's dispatch(g, x, tokens, rows); backward: the gradient rows sent back
    by the student's send_back and added at their tokens."""

    def forward(self, x, g, tokens, rows, holder, student):
        xe, counts = student.dispatch(g, x, tokens, rows)
        self.g, self.tokens, self.n, self.student = g, tokens, x.shape[0], student
        self.counts = holder["counts"] = np.asarray(counts, dtype=np.int64).reshape(g.size, -1)
        return np.asarray(xe)

    def backward(self, gy):
        back = np.asarray(self.student.send_back(self.g, np.ascontiguousarray(gy), self.counts))
        dx = np.zeros((self.n, gy.shape[1]), dtype=gy.dtype)
        np.add.at(dx, self.tokens, back)
        return dx, None, None, None, None, None


class StudentSendBack(Function):
    """back = the student's send_back(g, out, counts); backward: the gradient rows dispatched
    again (tokens 0..M-1: they are already in the dispatch order)."""

    def forward(self, out, g, counts, rows, student):
        self.g, self.rows, self.student = g, rows, student
        back = np.asarray(student.send_back(g, out, counts))
        self.m = back.shape[0]
        return back

    def backward(self, gb):
        xe, _ = self.student.dispatch(self.g, np.ascontiguousarray(gb), np.arange(self.m, dtype=np.int64),
                                      self.rows)
        return np.asarray(xe), None, None, None, None


def install(student):
    """minipar's routing, capacity, dispatch order and combine become the student's (moe.top_k,
    moe.capacity, moe.claim_slots, moe.assignments, moe.combine), and with --ep a MoE layer's
    dispatch and the way back are the student's dispatch and send_back (expert_parallel.run_experts:
    the kept rows only, with or without a capacity)."""
    calls = [0]

    def counted(fn):
        def wrapped(*a, **kw):
            calls[0] += 1
            return fn(*a, **kw)
        return wrapped

    moe.top_k = counted(student.top_k)
    moe.capacity = counted(student.capacity)
    moe.claim_slots = counted(student.claim_slots)
    def assignments(decisions, experts):
        calls[0] += 1
        tokens, slots, rows = student.assignments(decisions.choice, decisions.kept, experts)
        return tuple(np.asarray(a, dtype=np.int64) for a in (tokens, slots, rows))

    moe.assignments = assignments

    def combine_(out, tokens, slots, weights, n):
        calls[0] += 1
        return StudentCombine.apply(out, tokens, slots, weights, n, student)

    def run_experts(placement, P, i, x2, tokens, rows, cap, family):
        calls[0] += 1
        g, El = placement.group, placement.per_rank
        rows = np.asarray(rows, dtype=np.int64)
        holder = {}
        xe = StudentDispatch.apply(x2, g, np.asarray(tokens, dtype=np.int64), rows, holder, student)
        counts = holder["counts"]
        per_expert = counts.sum(0)
        parts = ops.split(xe, list(np.cumsum(per_expert)[:-1]), axis=0) if El > 1 else [xe]
        out = ops.concat([family.expert_mlp(P, family.expert_prefix(i, e), part)
                          for e, part in zip(placement.local, parts)], axis=0)
        # what the all-to-alls send, as minipar counts them without a capacity (the summary's line)
        Pn, C = placement.P, x2.shape[1]
        passes = 2 if is_grad_enabled() and x2.requires_grad else 1
        placement.theory_bytes += expert_parallel.ep_bytes(
            expert_parallel.Sent(g), C * x2.dtype.itemsize, passes, None,
            int(rows.sum() - rows.reshape(Pn, El)[placement.rank].sum()),
            int(counts.sum() - counts[placement.rank].sum()), rows)
        if passes == 2:          # the backward's dispatch exchanges the row counts again
            placement.theory_bytes += expert_parallel.Sent(g).all_to_all(rows)
        return StudentSendBack.apply(out, g, counts, rows, student)

    moe.combine = combine_
    expert_parallel.run_experts = run_experts
    return lambda: calls[0]
