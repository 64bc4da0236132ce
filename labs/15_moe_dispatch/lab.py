"""Lab 15's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): minipar.model.moe.top_k, capacity, claim_slots, assignments and combine
become the student's (the router's choice and weights, the capacity and its drops in every
routing group, the dispatch order, the weighted combine, forward; the combine's backward is
the adjoint of the student's scatter), and with --ep expert_parallel.run_experts sends the
kept rows by the student's dispatch and brings the outputs home by the student's send_back
(forward, and in backward the two again the other way round).
Oracle: the plain loops below (oracle_top_k, oracle_kept, oracle_assignments, the dense
combine, what each rank receives), written from the rules of docs/moe.md, never the
student's code nor minipar's; every input rebuilt from the cases' seeds (drive.py). The
trainer criterion: the grader's own single-process twin (labs/twin.py).
"""
import math
import os

import numpy as np

from labs.framework import Criterion, expect, load_drive, trainer_flags
from labs.results import key
from labs.scan import Allowed

TITLE = "a mixture of experts' routing, capacity, dispatch and combine"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
OWN_REASON = "minipar's own routing and dispatch: this lab grades yours"
ALLOWED = Allowed(
    modules={"minipar.comm": {"all_to_all", "traffic", "reset_traffic", "CommTimeout"}},
    refused={f"minipar.comm.{n}": "use comm.all_to_all, as the handout says"
             for n in ("all_to_all_async", "alltoall", "hierarchical_alltoall")})
TOL = 1e-12


def kind(v) -> str:
    return getattr(v, "typename", type(v).__name__)


def ints(v, what: str) -> np.ndarray:
    """v as an int64 array, or AssertionError: an array of an integer dtype is wanted."""
    assert isinstance(v, np.ndarray), f"{what}: got a {kind(v)}, want an int64 array"
    assert v.dtype.kind in "iu", f"{what}: got an array of {v.dtype}, want int64"
    return v.astype(np.int64)


def pair(got, what: str, names=("choice", "weights"), n=2):
    assert isinstance(got, tuple) and len(got) == n, \
        f"{what}: return a tuple ({', '.join(names)}), got a {kind(got)}" + \
        (f" of {len(got)}" if isinstance(got, (tuple, list)) else "")
    return got


def untouched(res, r, k, want, what, name):
    after = res.get(r, k)
    assert isinstance(after, np.ndarray) and after.shape == want.shape and np.array_equal(after, want), \
        f"{what}: the input {name} was modified"


# --- the oracles ---------------------------------------------------------------------------------

def oracle_top_k(z, k, router):
    """Token by token: p by the softmax, the experts sorted by (-p, id), the weights."""
    N, E = z.shape
    choice, weights = np.zeros((N, k), dtype=np.int64), np.zeros((N, k))
    for n in range(N):
        m = max(z[n])
        e = [math.exp(v - m) for v in z[n]]
        p = [v / sum(e) for v in e]
        top = sorted(range(E), key=lambda j: (-p[j], j))[:k]
        total = sum(p[j] for j in top)
        choice[n] = top
        weights[n] = [p[j] / total if (k > 1 or router == "mixtral") else p[j] for j in top]
    return choice, weights


def oracle_capacity(tokens, k, experts, factor):
    return None if factor == 0 else math.ceil(factor * tokens * k / experts)


def oracle_kept(choice, experts, cap):
    """First choices in token order, then second choices, ...: a slot while the expert has one."""
    N, K = choice.shape
    kept = np.zeros((N, K), dtype=bool)
    used = {e: 0 for e in range(experts)}
    for j in range(K):
        for n in range(N):
            e = int(choice[n, j])
            if cap is None or used[e] < cap:
                used[e] += 1
                kept[n, j] = True
    return kept


def oracle_assignments(choice, kept, experts):
    """Expert by expert, then choice by choice, then token by token."""
    N, K = choice.shape
    found = [(n, n * K + j, e) for e in range(experts) for j in range(K) for n in range(N)
             if kept[n, j] and choice[n, j] == e]
    rows = np.array([sum(1 for f in found if f[2] == e) for e in range(experts)], dtype=np.int64)
    return (np.array([f[0] for f in found], dtype=np.int64), np.array([f[1] for f in found], dtype=np.int64),
            rows)


def oracle_dense(choice, kept, weights, dense):
    """y[n] = sum over the kept j of weights[n, j] * (expert choice[n, j]'s output for token n)."""
    N, K = choice.shape
    y = np.zeros((N, dense.shape[2]))
    for n in range(N):
        for j in range(K):
            if kept[n, j]:
                y[n] += weights[n, j] * dense[n, choice[n, j]]
    return y


def oracle_received(p, r, case):
    """What rank r's experts receive: (xe expert-major, counts (p, E/p))."""
    inputs = [drive.dispatch_input(p, s, case) for s in range(p)]
    E = len(inputs[0][2])
    El = E // p
    parts, counts = [], np.zeros((p, El), dtype=np.int64)
    for i in range(El):
        e = r * El + i
        for s, (x, tokens, rows) in enumerate(inputs):
            start = int(sum(rows[:e]))
            parts.append(x[tokens[start:start + rows[e]]])
            counts[s, i] = rows[e]
    return np.concatenate(parts), counts, inputs[r][0].dtype


def oracle_back(p, s, case):
    """What rank s gets back: for each of its dispatched rows (expert by expert), the row its
    expert's rank computed for it, in that rank's out (expert-major, sources in order)."""
    x, tokens, rows = drive.dispatch_input(p, s, case)
    E = len(rows)
    El = E // p
    parts = []
    for e in range(E):
        j, i = divmod(e, El)
        out, counts = drive.back_input(p, j, case)
        start = int(counts[:, :i].sum() + counts[:s, i].sum())
        parts.append(out[start:start + counts[s, i]])
    return np.concatenate(parts) if parts else np.zeros((0, drive.C_EP), dtype=x.dtype)


# --- the judges --------------------------------------------------------------------------------

def judge_topk(res):
    for i, (name, z, k, router) in enumerate(drive.topk_cases()):
        what = f"top_k: {name}"
        choice, weights = pair(res.get(0, key("topk", i)), what)
        want_c, want_w = oracle_top_k(z, k, router)
        expect(ints(choice, f"{what}: choice"), want_c, f"{what}: choice (expert ids, largest p first)")
        assert isinstance(weights, np.ndarray), f"{what}: weights is a {kind(weights)}, want a float64 array"
        expect(weights, want_w, f"{what}: weights", rtol=TOL)
        untouched(res, 0, key("topk", i, "logits after"), z, what, "logits")


def judge_capacity(res):
    for i, (tokens, k, E, F) in enumerate(drive.CAPACITY):
        what = f"capacity(tokens={tokens}, k={k}, experts={E}, factor={F})"
        got, want = res.get(0, key("cap", i)), oracle_capacity(tokens, k, E, F)
        if want is None:
            assert got is None, f"{what}: got {got!r}, want None (factor 0: no capacity)"
        else:
            assert isinstance(got, (int, np.integer)) and not isinstance(got, bool) and got == want, \
                f"{what}: got {got!r}, want {want} = ceil({F} x {tokens} x {k} / {E}), an int"
    for i, (name, choice, E, cap) in enumerate(drive.claim_cases()):
        what = f"claim_slots: {name}"
        got, want = res.get(0, key("claim", i)), oracle_kept(choice, E, cap)
        assert isinstance(got, np.ndarray), f"{what}: got a {kind(got)}, want a bool array (N, k)"
        assert got.dtype == bool, f"{what}: got an array of {got.dtype}, want bool"
        if got.shape == want.shape and not np.array_equal(got, want):
            bad = np.argwhere(got != want)[0]
            n, j = int(bad[0]), int(bad[1])
            raise AssertionError(
                f"{what}: token {n}'s choice {j} (expert {choice[n, j]}) is "
                f"{'kept' if got[n, j] else 'dropped'}, want {'kept' if want[n, j] else 'dropped'}; "
                f"dropped: got {np.argwhere(~got).tolist()}, want {np.argwhere(~want).tolist()} ([token, choice])")
        expect(got, want, what)
        untouched(res, 0, key("claim", i, "choice after"), choice, what, "choice")


def judge_assignments(res):
    for i, (name, choice, kept, E) in enumerate(drive.assignment_cases()):
        what = f"assignments: {name}"
        tokens, slots, rows = pair(res.get(0, key("asg", i)), what, ("tokens", "slots", "rows"), 3)
        want_t, want_s, want_r = oracle_assignments(choice, kept, E)
        expect(ints(rows, f"{what}: rows"), want_r, f"{what}: rows (the kept assignments of each expert)")
        expect(ints(tokens, f"{what}: tokens"), want_t, f"{what}: tokens (by expert, then choice, then token)")
        expect(ints(slots, f"{what}: slots"), want_s, f"{what}: slots (token * k + choice)")
        untouched(res, 0, key("asg", i, "choice after"), choice, what, "choice")
        untouched(res, 0, key("asg", i, "kept after"), kept, what, "kept")


def judge_combine(res):
    for i, (name, choice, kept, weights, dense, order) in enumerate(drive.combine_cases()):
        what = f"combine: {name}"
        y = res.get(0, key("comb", i))
        assert isinstance(y, np.ndarray), f"{what}: got a {kind(y)}, want an array (n, C)"
        expect(y, oracle_dense(choice, kept, weights, dense), f"{what}: y", rtol=TOL, atol=1e-14)
        rows, _, _ = drive.combine_inputs(choice, kept, dense, order, i)
        untouched(res, 0, key("comb", i, "rows after"), rows, what, "rows")
        untouched(res, 0, key("comb", i, "weights after"), weights, what, "weights")
        assert res.get(0, key("comb", i, "aliases")) is False, f"{what}: y shares memory with an input"


def judge_ledger(res, which, p, r, case, what, nbytes_rows_out, counts_exchange):
    """The bytes the ledger counted for one call of `which` ("disp" or "back") on rank r."""
    sent, calls = res.get(r, key("ledger", which, p, r, case))
    assert isinstance(sent, int) and isinstance(calls, dict), f"{what}: the ledger's record is damaged"
    assert set(calls) <= {"all_to_all"}, f"{what}: the ledger holds {sorted(calls)}; communicate only by " \
                                         f"comm.all_to_all"
    want = 0 if p == 1 else 8 * (p - 1) + nbytes_rows_out + counts_exchange
    assert sent == want, f"{what}: the ledger counted {sent} B sent, want {want} B: the rows for other ranks " \
                         f"({nbytes_rows_out} B) and 8 B of count per peer" + \
                         (f", and the {counts_exchange} B of one int64 per expert of each other rank"
                          if counts_exchange else "")


def judge_dispatch_and_back(res):
    """Case by case, p by p: the dispatch on every rank, then the send-back."""
    for p in range(1, drive.P_MAX + 1):
        for case, name in enumerate(drive.DISPATCH):
            for r in range(p):
                judge_dispatch(res, p, case, name, r)
            for r in range(p):
                judge_send_back(res, p, case, name, r)


def judge_dispatch(res, p, case, name, r):
    x, tokens, rows = drive.dispatch_input(p, r, case)
    what = f"p={p} rank {r} dispatch: {name}, E={len(rows)}, rows per expert {rows.tolist()}"
    xe, counts = pair(res.get(r, key("disp", p, r, case)), what, ("xe", "counts"))
    want_x, want_c, dtype = oracle_received(p, r, case)
    expect(ints(counts, f"{what}: counts"), want_c, f"{what}: counts (rows from each source for "
                                                     f"each of this rank's experts)")
    assert isinstance(xe, np.ndarray), f"{what}: xe is a {kind(xe)}, want an array"
    expect(xe, want_x.astype(dtype), f"{what}: xe (the rows received, expert-major)")
    untouched(res, r, key("disp", p, r, case, "x after"), x, what, "x")
    El = len(rows) // p
    out_rows = int(rows.sum() - rows[r * El:(r + 1) * El].sum())
    judge_ledger(res, "disp", p, r, case, what, out_rows * drive.C_EP * x.itemsize, 8 * El * (p - 1))


def judge_send_back(res, p, case, name, r):
    out, counts = drive.back_input(p, r, case)
    what = f"p={p} rank {r} send_back: {name}, counts from each source {counts.tolist()}"
    back = res.get(r, key("back", p, r, case))
    assert isinstance(back, np.ndarray), f"{what}: got a {kind(back)}, want an array (M, C)"
    expect(back, oracle_back(p, r, case), f"{what}: the rows back home, in dispatch order")
    untouched(res, r, key("back", p, r, case, "out after"), out, what, "out")
    others = int(counts.sum() - counts[r].sum())
    judge_ledger(res, "back", p, r, case, what, others * drive.C_EP * out.itemsize, 0)


TRAINER = trainer_flags("--dp", "4", "--ep", "4", "--moe-experts", "8", "--moe-top-k", "2",
                        "--moe-capacity-factor", "1.0")

CRITERIA = [
    Criterion("top-k and weights against the oracle", run="topk", judge=judge_topk, timeout=30, uses=("top_k",),
              hint="a stable argsort of -p keeps the lower id first on ties; subtract each row's max before exp; "
                   "Switch's k = 1 keeps p, Mixtral's renormalises (minipar.model.moe.top_k's docstring)"),
    Criterion("capacity and the drops in the claim order", run="capacity_and_drops", judge=judge_capacity,
              timeout=30, uses=("capacity", "claim_slots"),
              hint="ceil, not floor (math.ceil); loop over the choices outside, the tokens inside, and count "
                   "each expert's slots used; docs/moe.md works an example (minipar.model.moe.claim_slots)"),
    Criterion("dispatch order and load per expert", run="dispatch_order", judge=judge_assignments, timeout=30,
              uses=("assignments",),
              hint="only kept assignments; experts outside, then choices, then tokens; slot = token * k + "
                   "choice; rows[e] counts what expert e keeps (minipar.model.moe.assignments)"),
    Criterion("combine against a dense oracle", run="combine", judge=judge_combine, timeout=30, uses=("combine",),
              hint="y[tokens] += ... with a repeated token adds once: loop, or np.add.at; each row's weight "
                   "once, weights.flat[slot] (minipar.model.moe.combine)"),
    Criterion("dispatch and send back under MPI", ranks=4, run="dispatch_and_back", judge=judge_dispatch_and_back,
              timeout=60, uses=("dispatch", "send_back"),
              hint="rank j owns experts j E/p .. (j+1) E/p - 1: the rows for rank j are the sum of their rows; "
                   "the counts go by one equal comm.all_to_all of int64; then reorder expert-major "
                   "(minipar.parallel.expert.expert_parallel.expert_major); send_back undoes that order"),
    Criterion("trainer --dp 4 --ep 4 --moe-experts 8 --moe-top-k 2 --moe-capacity-factor 1.0", ranks=4,
              trainer=TRAINER, timeout=120,
              uses=("top_k", "capacity", "claim_slots", "assignments", "dispatch", "send_back", "combine"),
              hint="every MoE layer routes, drops, dispatches, sends back and combines with your functions, "
                   "forward and backward; the grader compares the run with its own single process"),
]
