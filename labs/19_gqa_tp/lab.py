"""Lab 19's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): a tensor-parallel model's q_proj, k_proj and v_proj shards are the columns
of the packed [Wq | Wk | Wv] that the student's qkv_columns picks (at init, in load_state_dict,
and back again in the checkpoint's consolidation), and each key/value shard's gradient is summed
by the student's sum_kv_grad over the ranks kv_groups gives for the key/value head rank_heads
says the rank holds. `--arch llama --tp T` then runs the student's layout and sum.
Oracle, written here plainly: rank r holds query heads r H/tp .. (r+1) H/tp - 1 and the
key/value heads those read (query head h reads key/value head h // (H/Hkv)); a head's group is
the ranks that hold it; grouped-query attention as loops over sequences and heads, with its
gradients; the sum in float64 of every group member's gradient, which the grader draws itself.
The child hands back what the student's code returned (or the exception it raised, for a split
that must be refused) and the inputs as they were afterwards.
"""
import math
import os

import numpy as np

from labs.framework import Criterion, first_difference, load_drive, trainer_flags
from labs.results import key, typename
from labs.scan import Allowed

TITLE = "grouped-query attention under tensor parallelism: which heads each rank holds, and the shared key/value heads' gradient sum"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
ALLOWED = Allowed(
    modules={"minipar.comm": {"CommTimeout", "traffic", "reset_traffic"}},
    refused={**{f"minipar.comm.{n}": "sum on point-to-point messages (a Call on g), as the handout says"
                for n in ("all_reduce", "all_reduce_async", "reduce", "broadcast", "all_gather", "reduce_scatter",
                          "untracked")}})


# --- the oracle -------------------------------------------------------------------------------

def refusal(H, Hkv, tp, rank=0) -> str | None:
    """Why (H, Hkv, tp) cannot be split (or rank is not in the group), None when it can."""
    if Hkv < 1 or H % Hkv:
        return f"n_kv_head {Hkv} does not divide n_head {H}"
    if H % tp:
        return f"tp {tp} does not divide n_head {H} (each rank holds n_head/tp whole query heads)"
    if Hkv % tp and tp % Hkv:
        return (f"tp {tp} does not divide n_kv_head {Hkv}, and n_kv_head does not divide tp (a key/value head is "
                f"held whole, by one rank or by tp/n_kv_head ranks alike)")
    if not 0 <= rank < tp:
        return f"rank {rank} is not in a tp group of {tp}"
    return None


def oracle_heads(H, Hkv, tp, r):
    """(query heads, key/value heads) of rank r: its H/tp consecutive query heads, and the
    key/value heads they read."""
    q = [h for h in range(H) if h * tp // H == r]
    return q, sorted({h * Hkv // H for h in q})


def oracle_columns(H, Hkv, hs, tp, r) -> np.ndarray:
    q, kv = oracle_heads(H, Hkv, tp, r)
    blocks = [h * hs for h in q] + [(H + j) * hs for j in kv] + [(H + Hkv + j) * hs for j in kv]
    return np.array([b + c for b in blocks for c in range(hs)], dtype=np.int64)


def oracle_groups(H, Hkv, tp):
    return [[r for r in range(tp) if j in oracle_heads(H, Hkv, tp, r)[1]] for j in range(Hkv)]


def column_name(H, Hkv, hs, c) -> str:
    """What packed column c is: 'query head 3, channel 1', 'K of key/value head 0, channel 2'."""
    head, ch = divmod(int(c), hs)
    if head < H:
        return f"query head {head}, channel {ch}"
    if head < H + Hkv:
        return f"K of key/value head {head - H}, channel {ch}"
    if head < H + 2 * Hkv:
        return f"V of key/value head {head - H - Hkv}, channel {ch}"
    return "outside the packed projection"


def oracle_attention(qkv, dy, H, Hkv):
    """Causal grouped-query attention written plainly, one sequence and one query head at a
    time: y (B, T, H hs) and the gradient of the packed projection (B, T, (H + 2 Hkv) hs)."""
    B, T, W = qkv.shape
    hs, g = W // (H + 2 * Hkv), H // Hkv

    def heads(a, n):
        return a.reshape(B, T, n, hs).transpose(0, 2, 1, 3)

    q, k, v = heads(qkv[..., :H * hs], H), heads(qkv[..., H * hs:(H + Hkv) * hs], Hkv), \
        heads(qkv[..., (H + Hkv) * hs:], Hkv)
    d = heads(dy, H)
    y, dq, dk, dv = np.zeros(q.shape), np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    later = np.triu(np.ones((T, T), dtype=bool), 1)             # key j after query i
    for b in range(B):
        for h in range(H):
            j = h // g
            s = q[b, h] @ k[b, j].T / math.sqrt(hs)
            s[later] = -np.inf
            p = np.exp(s - s.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            y[b, h] = p @ v[b, j]
            dp = d[b, h] @ v[b, j].T
            ds = p * (dp - (dp * p).sum(axis=1, keepdims=True))
            dq[b, h] = ds @ k[b, j] / math.sqrt(hs)
            dk[b, j] += ds.T @ q[b, h] / math.sqrt(hs)          # every query head that reads head j
            dv[b, j] += p.T @ d[b, h]

    def merge(a):
        return a.transpose(0, 2, 1, 3).reshape(B, T, -1)

    return merge(y), np.concatenate([merge(dq), merge(dk), merge(dv)], axis=-1)


# --- reading what came back -------------------------------------------------------------------

def int_list(v):
    """v as a list of ints (a list, tuple or 1-D array of whole numbers), else None."""
    if isinstance(v, np.ndarray):
        if v.ndim != 1 or v.dtype.kind not in "iu":
            return None
        return [int(x) for x in v]
    if isinstance(v, (list, tuple)) and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool)
                                            for x in v):
        return [int(x) for x in v]
    return None


def returned(res, k, what, reason):
    """The value the call returned; AssertionError when it raised but should not have, or
    returned but should have raised (reason: why the split is impossible, or None)."""
    got = res.get(0, k)
    if not (isinstance(got, tuple) and got and got[0] in ("returned", "raised")):
        raise AssertionError(f"{what}: the record is damaged ({typename(got)})")
    if reason is not None:
        if got[0] == "returned":
            raise AssertionError(f"{what}: returned {got[1]!r:.200}; want a ValueError: {reason}")
        if got[1] != "ValueError" or not str(got[2]).strip():
            raise AssertionError(f"{what}: raised {got[1]}({got[2]!r:.200}); want a ValueError with a message "
                                 f"saying why: {reason}")
        return None
    if got[0] == "raised":
        raise AssertionError(f"{what}: raised {got[1]}: {got[2]:.300}; this split is valid")
    return got[1]


# --- the judges -------------------------------------------------------------------------------

def judge_heads(res):
    for H, Hkv, tp, r in drive.head_cases():
        what = f"rank_heads(n_head={H}, n_kv_head={Hkv}, tp={tp}, rank={r})"
        reason = refusal(H, Hkv, tp, r)
        got = returned(res, key("heads", H, Hkv, tp, r), what, reason)
        if reason is not None:
            continue
        q, kv = oracle_heads(H, Hkv, tp, r)
        pair = got if isinstance(got, (tuple, list)) and len(got) == 2 else None
        if pair is None:
            raise AssertionError(f"{what}: returned {typename(got)} {got!r:.200}; want a pair (query heads, "
                                 f"key/value heads), e.g. ({q}, {kv})")
        got_q, got_kv = int_list(pair[0]), int_list(pair[1])
        assert got_q == q, f"{what}: query heads {pair[0]!r:.200}, want {q} (rank r holds H/tp consecutive " \
                           f"query heads, r*H/tp onwards)"
        g = H // Hkv
        assert got_kv == kv, f"{what}: key/value heads {pair[1]!r:.200}, want {kv} (query head h reads key/value " \
                             f"head h // {g}, {g} = H/Hkv query heads per key/value head; a rank holds those its " \
                             f"query heads read, ascending)"


def judge_columns(res):
    for H, Hkv, tp in drive.shapes():
        for hs in drive.HEAD_SIZES:
            for r in drive.ranks_tried(H, tp):
                what = f"qkv_columns(n_head={H}, n_kv_head={Hkv}, head_size={hs}, tp={tp}, rank={r})"
                reason = refusal(H, Hkv, tp, r)
                got = returned(res, key("cols", H, Hkv, hs, tp, r), what, reason)
                if reason is not None:
                    continue
                want = oracle_columns(H, Hkv, hs, tp, r)
                cols = int_list(got)
                if cols is None:
                    raise AssertionError(f"{what}: returned {typename(got)} {got!r:.200}; want a 1-D int64 array of "
                                         f"{want.size} packed column indices")
                if not (isinstance(got, np.ndarray) and got.dtype == np.int64):
                    raise AssertionError(f"{what}: returned {typename(got)}"
                                         f"{' of ' + str(got.dtype) if isinstance(got, np.ndarray) else ''}; want a "
                                         f"1-D NumPy array of int64")
                if len(cols) != want.size:
                    raise AssertionError(f"{what}: {len(cols)} columns, want {want.size} ({H // tp} query and "
                                         f"{len(oracle_heads(H, Hkv, tp, r)[1])} key/value head(s) of {hs}: "
                                         f"[q | k | v])")
                bad = [i for i in range(want.size) if cols[i] != want[i]]
                if bad:
                    i = bad[0]
                    raise AssertionError(f"{what}: local column {i} is packed column {cols[i]} "
                                         f"({column_name(H, Hkv, hs, cols[i])}), want {int(want[i])} "
                                         f"({column_name(H, Hkv, hs, want[i])}); {len(bad)} of {want.size} "
                                         f"differ; want {want.tolist()[:48]}")


def judge_groups(res):
    for H, Hkv, tp in drive.shapes():
        what = f"kv_groups(n_head={H}, n_kv_head={Hkv}, tp={tp})"
        reason = refusal(H, Hkv, tp)
        got = returned(res, key("groups", H, Hkv, tp), what, reason)
        if reason is not None:
            continue
        want = oracle_groups(H, Hkv, tp)
        rows = [int_list(x) for x in got] if isinstance(got, (list, tuple)) else None
        if rows is None or any(x is None for x in rows):
            raise AssertionError(f"{what}: returned {typename(got)} {got!r:.200}; want a list of {Hkv} lists of "
                                 f"tp ranks, e.g. {want}")
        assert len(rows) == Hkv, f"{what}: {len(rows)} groups, want one per key/value head ({Hkv}): {want}"
        for j, (a, b) in enumerate(zip(rows, want)):
            assert a == b, f"{what}: key/value head {j} is held by ranks {a}, want {b} (every rank whose query " \
                           f"heads read it, ascending); all groups want {want}"


def judge_attention(res):
    hs = drive.ATT_HS
    for i, (H, Hkv, tp) in enumerate(drive.ATTENTION):
        qkv, dy = drive.attention_inputs(i)
        y_want, d_want = oracle_attention(qkv, dy, H, Hkv)
        y, d = np.zeros_like(y_want), np.zeros_like(d_want)
        case = f"attention H={H} Hkv={Hkv} tp={tp} (B={drive.ATT_B} T={drive.ATT_T} head size {hs})"
        for r in range(tp):
            cols = oracle_columns(H, Hkv, hs, tp, r)
            nq = H // tp * hs
            y_r, d_r = res.get(0, key("att", i, r, "y")), res.get(0, key("att", i, r, "dqkv"))
            diff = first_difference(y_r, y_want[..., cols[:nq]], rtol=1e-12, atol=1e-12)
            assert diff is None, f"{case}: rank {r}'s output (its query heads {oracle_heads(H, Hkv, tp, r)[0]}): {diff}"
            assert isinstance(d_r, np.ndarray) and d_r.shape == (*qkv.shape[:2], cols.size), \
                f"{case}: rank {r}'s gradient of its columns is {typename(d_r)} {getattr(d_r, 'shape', '')}"
            y[..., cols[:nq]] = y_r
            np.add.at(d, (Ellipsis, cols), d_r)        # a shared key/value head: every holder's part
        diff = first_difference(y, y_want, rtol=1e-12, atol=1e-12)
        assert diff is None, f"{case}: the ranks' outputs side by side against the full attention: {diff}"
        nq = H * hs
        diff = first_difference(d[..., :nq], d_want[..., :nq], rtol=1e-12, atol=1e-12)
        assert diff is None, f"{case}: the query columns' gradient against the full attention's: {diff}"
        diff = first_difference(d[..., nq:], d_want[..., nq:], rtol=1e-12, atol=1e-12)
        assert diff is None, f"{case}: the key and value columns' gradient, summed over the ranks that hold each " \
                             f"head, against the full attention's: {diff}"


def judge_sum(res):
    for p in range(1, drive.P_MAX + 1):
        for li, layout in enumerate(drive.layouts(p)):
            for i, (shape, dtype) in enumerate(drive.GRADS):
                for grp in layout:
                    grads = {r: drive.grad_input(p, li, r, i) for r in grp}
                    total = np.sum([grads[r].astype(np.float64) for r in grp], axis=0)
                    want = total.astype(dtype)
                    scale = float(np.abs(total).max()) if total.size else 1.0
                    tol = 1e-12 if dtype == "float64" else 4e-6
                    got_by = {}
                    for r in grp:
                        k = key("sum", p, li, r, i)
                        what = f"sum_kv_grad on a group of {p} rank(s), rank {r}, ranks={grp} (key/value groups " \
                               f"{layout}): grad {shape} {dtype}"
                        got = res.get(r, k)
                        if not isinstance(got, np.ndarray):
                            raise AssertionError(f"{what}: returned {typename(got)}, want a NumPy array")
                        diff = first_difference(got, want, rtol=tol, atol=tol * scale)
                        if diff is not None:
                            alone = float(np.abs(got.astype(np.float64) - grads[r]).max()) if got.shape == shape \
                                and got.size else None
                            note = " (it is this rank's own gradient: nothing added)" if alone == 0.0 and len(grp) > 1 \
                                else ""
                            raise AssertionError(f"{what}: {diff}{note}; want the sum of the {len(grp)} gradients of "
                                                 f"ranks {grp}, once each")
                        after = res.get(r, key(k, "grad after"))
                        if not (isinstance(after, np.ndarray) and after.shape == shape and np.array_equal(after, grads[r])):
                            raise AssertionError(f"{what}: the gradient given was modified in place "
                                                 f"({first_difference(after, grads[r], rtol=0.0)}): the caller still "
                                                 f"needs it")
                        assert res.get(r, key(k, "aliases grad")) is False, \
                            f"{what}: the result shares memory with grad (return a new array, even alone)"
                        got_by[r] = got
                    first = grp[0]
                    for r in grp[1:]:
                        if not np.array_equal(got_by[r], got_by[first]):
                            diff = first_difference(got_by[r], got_by[first], rtol=0.0)
                            raise AssertionError(f"sum_kv_grad on a group of {p} rank(s), ranks={grp}: grad {shape} "
                                                 f"{dtype}: rank {r}'s sum is not rank {first}'s bit for bit ({diff}); "
                                                 f"add the copies in one order on every rank (the group's), or the "
                                                 f"copies of a shared head drift apart")


FLAGS_MQA = trainer_flags("--arch", "llama", "--n-kv-head", "1", "--tp", "2")
FLAGS_GQA = trainer_flags("--arch", "llama", "--n-kv-head", "2", "--tp", "4", n_head=4)

CRITERIA = [
    Criterion("heads of each rank against the oracle", run="heads", judge=judge_heads, timeout=60,
              uses=("rank_heads",),
              hint="rank r holds query heads r*H/tp .. (r+1)*H/tp - 1 and the key/value heads h // (H/Hkv) they "
                   "read; refuse with ValueError what parallel.tensor.tensor_parallel.kv_share refuses"),
    Criterion("qkv columns against the oracle", run="columns", judge=judge_columns, timeout=60,
              uses=("qkv_columns",),
              hint="the packed width is (H + 2 Hkv) hs: K starts at column H hs, V at (H + Hkv) hs; a head's "
                   "columns are hs consecutive ones; model.llama's forward reads [q_r | k_r | v_r]"),
    Criterion("key/value groups against the oracle", run="groups", judge=judge_groups, timeout=60,
              uses=("kv_groups",),
              hint="a key/value head's group is every rank whose query heads read it: one rank when tp <= Hkv, "
                   "tp/Hkv consecutive ranks when tp > Hkv (the last head's group ends at rank tp - 1)"),
    Criterion("sliced attention equals the full attention", run="attention", judge=judge_attention, timeout=60,
              uses=("qkv_columns",),
              hint="each rank's columns go through minipar's own grouped-query attention (autograd.attention."
                   "CausalSelfAttention) with H/tp query heads; a shared key/value head's gradient is the sum of "
                   "its holders' parts"),
    Criterion("key/value gradient sum against NumPy", ranks=4, run="kv_sum", judge=judge_sum, timeout=90,
              uses=("sum_kv_grad",),
              hint="exchange with every other rank of `ranks` in one Call (comm.Group.begin), add the copies in "
                   "the group's order into a new array; a group of one returns a copy; MINIPAR_TRACE=1 prints "
                   "every message"),
    Criterion("trainer --arch llama --n-kv-head 1 --tp 2", ranks=2, trainer=FLAGS_MQA, timeout=120,
              uses=("rank_heads", "qkv_columns", "kv_groups", "sum_kv_grad"),
              hint="multi-query attention: both ranks hold the one key/value head, whose gradient is summed over "
                   "both; the grader compares the run with one process"),
    Criterion("trainer --arch llama --n-head 4 --n-kv-head 2 --tp 4", ranks=4, trainer=FLAGS_GQA, timeout=120,
              uses=("rank_heads", "qkv_columns", "kv_groups", "sum_kv_grad"),
              hint="each key/value head on 2 of the 4 ranks: its gradient is summed over those 2 only (ranks 0+1, "
                   "2+3), not over the whole tp group; the grader compares the run with one process"),
]
