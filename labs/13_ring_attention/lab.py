"""Lab 13's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): packed.RingSelfAttention.core becomes a RingAttention whose forward is the
student's ring_attention, and context_parallel.positions the student's positions, so the
trainer's --cp split of every sequence and each layer's attention forward are the student's;
the backward is minipar's RingAttention.backward, fed the student's o and lse.
Oracle (written here, plainly, not minipar's ring_attention): the chunks each rank keeps, the
causal plan from the chunks' order, one softmax over all the keys with its log-sum-exp, the
causal attention over the whole sequence on one process, the work and the bytes by formula.
The child only hands back what the student's functions returned, their inputs afterwards, the
sub-blocks its forward computed, and the ledger.
"""
import os

import numpy as np

from labs.framework import Criterion, expect, load_drive, trainer_flags
from labs.results import key
from labs.scan import Allowed

TITLE = "ring attention: the zig-zag split, the merge, the causal skip and the K, V ring"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
P2P_REASON = "minipar's own point-to-point messages: the ring is one Call, g.begin('ring_attention', C - 1)"
ALLOWED = Allowed(   # minipar.parallel.context (the ring, the split, the merge) is refused as any module not given
    modules={"minipar.comm": {"CommTimeout"}},
    refused={f"minipar.comm.{n}": P2P_REASON for n in ("send", "recv", "send_async", "recv_async")})
HEADER_BYTES = 128          # minipar's point-to-point send puts a 128-byte header before each array


# --- the oracle -----------------------------------------------------------------------------------

def chunks_kept(rank, C, layout):
    """The two chunks of 2C that rank `rank` keeps, in its order."""
    return (rank, 2 * C - 1 - rank) if layout == "zigzag" else (2 * rank, 2 * rank + 1)


def oracle_positions(rank, C, T, layout):
    c = T // (2 * C)
    return np.concatenate([np.arange(j * c, (j + 1) * c, dtype=np.int64) for j in chunks_kept(rank, C, layout)])


def oracle_plan(rank, owner, C, layout):
    """Query chunk i against key chunk j: keys all before (j < i) full, the same chunk diagonal,
    all after skipped."""
    return [["full" if j < i else "diagonal" if j == i else "skip" for j in chunks_kept(owner, C, layout)]
            for i in chunks_kept(rank, C, layout)]


def work(rank, C, layout):
    """(computed, diagonal, skipped) c x c sub-blocks of rank `rank` in one pass over the C blocks:
    zig-zag 2C + 1 (2C - 1 full, 2 diagonal) of 4C on every rank; contiguous 4 rank + 3, rank r's
    chunks 2r, 2r+1 seeing the 4r chunks before them whole, then themselves (2 diagonal, 1 full)."""
    computed = 2 * C + 1 if layout == "zigzag" else 4 * rank + 3
    return computed, 2, 4 * C - computed


def ring_bytes(n, C, itemsize):
    """What one rank's forward sends: its K and V (2n elements, n = B H t hs) to the next rank at
    each of C - 1 steps (the block it holds at the last step goes nowhere). minipar's
    ring_attention.ring_traffic counts the same 2n(C-1) for the forward, plus a header a message
    and the backward's passes."""
    return 2 * n * (C - 1) * itemsize


def softmax_attention(q, k, v, mask=None):
    """softmax(q k^T / sqrt(hs)) v and its log-sum-exp, in float64, over the keys a row may see
    (mask True: hidden); a row that sees none: o = 0, lse = -inf."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    seen = np.ones(s.shape, bool) if mask is None else np.broadcast_to(~np.asarray(mask), s.shape)
    o, lse = np.zeros(q.shape), np.full(q.shape[:-1], -np.inf)
    for idx in np.ndindex(*s.shape[:-1]):
        row = s[idx][seen[idx]]
        if row.size:
            top = row.max()
            w = np.exp(row - top)
            lse[idx] = top + np.log(w.sum())
            o[idx] = (w / w.sum()) @ v[idx[:-1]][seen[idx]]
    return o, lse


def tolerance(dtype):
    return {"rtol": 1e-12, "atol": 1e-12} if np.dtype(dtype) == np.float64 else {"rtol": 2e-5, "atol": 2e-5}


def judge_result(got, o_want, lse_want, dtype, what):
    """got must be (o, lse) of the dtype, equal to the oracle's at the dtype's tolerance."""
    if not (isinstance(got, tuple) and len(got) == 2):
        kind = getattr(got, "typename", type(got).__name__)
        raise AssertionError(f"{what}: return a tuple (o, lse), got a {kind}")
    o, lse = got
    for name, x, want in (("o", o, o_want), ("lse", lse, lse_want)):
        assert isinstance(x, np.ndarray), f"{what}: {name} is {getattr(x, 'typename', type(x).__name__)}, " \
                                          f"not an array"
        assert x.dtype == np.dtype(dtype), f"{what}: {name} is {x.dtype}, want {np.dtype(dtype)} (the inputs')"
        expect(x.astype(np.float64), want, f"{what}: {name}", **tolerance(dtype))


# --- the judges -----------------------------------------------------------------------------------

def judge_split(res):
    for layout in drive.LAYOUTS:
        for C, T in drive.split_cases():
            for r in range(C):
                what = f"positions({r}, {C}, {T}, {layout!r})"
                got = res.get(0, key("pos", layout, C, T, r))
                assert isinstance(got, np.ndarray) and got.dtype.kind in "iu", \
                    f"{what}: got {getattr(got, 'typename', type(got).__name__)} {got!r:.100}, want a 1-D array " \
                    f"of integers"
                expect(got.astype(np.int64), oracle_positions(r, C, T, layout), what)
        for C, T in drive.bad_split_cases():
            got = res.get(0, key("bad", layout, C, T))
            assert got == "raised ValueError", \
                f"positions(0, {C}, {T}, {layout!r}): {got}; 2C = {2 * C} does not divide T = {T}: raise ValueError"


def judge_block(res):
    for i, case in enumerate(drive.BLOCK_CASES):
        q, k, v, mask = drive.block_input(i)
        what = f"block_attention, {case[0]}: q {q.shape}, k {k.shape} {case[-1]}"
        o, lse = softmax_attention(q, k, v, mask)
        judge_result(res.get(0, key("block", i)), o, lse, q.dtype, what)
        after = res.get(0, key("block", i, "inputs after"))
        for name, x, y in zip(("q", "k", "v", "mask"), after, [q, k, v] + ([] if mask is None else [mask])):
            assert isinstance(x, np.ndarray) and np.array_equal(x, y), f"{what}: {name} was modified"


def judge_merge(res):
    for i, case in enumerate(drive.MERGE_CASES):
        q, k, v, mask, _ = drive.merge_keys(i)
        o, lse = softmax_attention(q, k, v, mask)                   # one softmax over the union
        for j, (name, _) in enumerate(drive.merge_orders(len(drive.MERGE_CASES[i][2]))):
            what = f"merge, {case[0]}: {name}"
            judge_result(res.get(0, key("merge", i, j)), o, lse, q.dtype, what + " against one softmax over all keys")
            changed = res.get(0, key("merge", i, j, "changed"))
            assert changed == [], f"{what}: an input was modified (o1, lse1, o2, lse2 = {changed} of the pieces' " \
                                  f"arrays in order): return new arrays"


def judge_plan(res):
    for layout in drive.LAYOUTS:
        for C in range(1, drive.C_MAX + 1):
            for r in range(C):
                kinds = []
                for owner in range(C):
                    want = oracle_plan(r, owner, C, layout)
                    got = res.get(0, key("plan", layout, C, r, owner))
                    mine, theirs = chunks_kept(r, C, layout), chunks_kept(owner, C, layout)
                    assert got == want, f"plan({r}, {owner}, {C}, {layout!r}): got {got!r:.200}, want {want} " \
                                        f"(rank {r} holds chunks {mine}, rank {owner} chunks {theirs} of {2 * C})"
                    kinds += [x for row in got for x in row]
                counts = (4 * C - kinds.count("skip"), kinds.count("diagonal"), kinds.count("skip"))
                assert counts == work(r, C, layout), f"C={C} rank {r} {layout}: computes, diagonal, skips {counts} " \
                                                     f"sub-blocks a pass, want {work(r, C, layout)}"


def ring_cases(res):
    """(p, rank, layout, case index, key, what, the whole sequence's q, k, v) of the ring's records."""
    for p in range(1, drive.P_MAX + 1):
        for layout in drive.LAYOUTS:
            for i, case in enumerate(drive.RING_CASES):
                full = drive.ring_full(p, i)
                for r in range(p):
                    yield p, r, layout, i, key("ring", p, r, layout, i), f"p={p} rank {r} {layout}: {case[0]}", full


def judge_ring(res):
    wanted = {}
    for p, r, layout, i, k, what, (q, kk, v) in ring_cases(res):
        T = q.shape[-2]
        if (p, layout, i) not in wanted:
            wanted[(p, layout, i)] = softmax_attention(q, kk, v, np.triu(np.ones((T, T), bool), 1))
        o, lse = wanted[(p, layout, i)]
        mine = oracle_positions(r, p, T, layout)
        judge_result(res.get(r, k), o[..., mine, :], lse[..., mine], q.dtype,
                     f"{what} (positions {mine.tolist()} of {T}) against one process")
        changed = res.get(r, key(k, "changed"))
        assert changed == [], f"{what}: {', '.join('qkv'[n] for n in changed)} modified (receive into new arrays)"


def judge_blocks(res):
    for p, r, layout, i, k, what, (q, _, _) in ring_cases(res):
        c = q.shape[-2] // (2 * p)
        full, diagonal, shapes = res.get(r, key(k, "blocks"))
        computed, want_diagonal, skipped = work(r, p, layout)
        assert full + diagonal > 0, f"{what}: block_attention was called 0 times; compute each sub-block with it"
        if c == 1:                                # a 1 x 1 diagonal sub-block hides nothing: a mask or none
            want_diagonal = diagonal
        assert (full + diagonal, diagonal) == (computed, want_diagonal), \
            f"{what}: computed {full + diagonal} sub-blocks ({diagonal} with a mask), want {computed} " \
            f"({want_diagonal} diagonal, {computed - want_diagonal} full) and {skipped} skipped of {4 * p}"
        assert [list(s) for s in shapes] == [[c, c]], \
            f"{what}: block_attention saw (queries, keys) {shapes}, want only c x c = {c} x {c} sub-blocks"


def judge_bytes(res):
    for p, r, layout, i, k, what, (q, _, _) in ring_cases(res):
        n = q[..., :q.shape[-2] // p, :].size
        want = ring_bytes(n, p, q.dtype.itemsize)
        t = res.get(r, key(k, "traffic"))
        assert isinstance(t, dict), f"{what}: the ledger's record is damaged"
        if "send" in t:                           # minipar's own ring (reference.py): header + array a message
            calls, sent = t["send"]
            assert (calls, sent - HEADER_BYTES * calls) == (p - 1, want), \
                f"{what}: {calls} sends of {sent} B; want {p - 1} of {want} B in all and their headers"
            continue
        sent = sum(v[1] for v in t.values())
        if p == 1:
            assert sent == 0 and set(t) <= {"ring_attention"}, f"{what}: sent {sent} B ({t}); alone it sends nothing"
            continue
        assert set(t) == {"ring_attention"} and t["ring_attention"][0] == 1, \
            f"{what}: the ledger holds {t}; one call, g.begin('ring_attention', C - 1)"
        assert sent == want, f"{what}: sent {sent} B; want {want} B: K and V of {n} elements each, " \
                             f"{q.dtype.itemsize} B an element, to the next rank at C - 1 = {p - 1} steps"


RING_USES = ("ring_attention", "block_attention", "merge", "plan")   # the forward calls all four

CRITERIA = [
    Criterion("the split: positions", run="split_run", judge=judge_split, timeout=60, uses=("positions",),
              hint="zig-zag: chunk r and chunk 2C-1-r of 2C, contiguous: chunks 2r and 2r+1; raise ValueError "
                   "when 2C does not divide T (T = C, say); the handout's chunk table draws both splits"),
    Criterion("one block of attention against one softmax", run="block_run", judge=judge_block, timeout=60,
              uses=("block_attention",),
              hint="scale by 1/sqrt(hs) once; subtract each row's max before exp; a row that sees no key gets "
                   "o = 0 and lse = -inf, never NaN"),
    Criterion("the merge against one softmax", run="merge_run", judge=judge_merge, timeout=60, uses=("merge",),
              hint="lse = m + log(e^(lse1-m) + e^(lse2-m)) with m the larger; where m is -inf use 0 instead; "
                   "return new arrays"),
    Criterion("the causal plan and its work", run="plan_run", judge=judge_plan, timeout=60, uses=("plan",),
              hint="compare the chunks' indices: key chunk before query chunk is full, the same chunk "
                   "diagonal, after it skip; zig-zag gives every rank 2C + 1 sub-blocks a pass"),
    Criterion("ring attention against one process", ranks=4, run="ring_run", judge=judge_ring, timeout=90,
              uses=RING_USES,
              hint="step 0 is the rank's own block; at step j it holds rank (r - j) mod C's; send to r + 1 and "
                   "receive from r - 1 into a new buffer; MINIPAR_TRACE=1 prints every message"),
    Criterion("sub-blocks the forward computed", ranks=4, run="ring_run", judge=judge_blocks, timeout=90,
              uses=RING_USES,
              hint="call block_attention once per c x c sub-block that plan does not skip, with the causal mask "
                   "only on diagonal ones"),
    Criterion("bytes in the ledger", ranks=4, run="ring_run", judge=judge_bytes, timeout=90,
              uses=RING_USES,
              hint="one g.begin('ring_attention', C - 1), one sendrecv of K and V together per step, none after "
                   "the last block; comm.traffic() after a call shows what was counted"),
    Criterion("trainer --cp 2", ranks=2, trainer=trainer_flags("--cp", "2"), timeout=120,
              uses=RING_USES + ("positions",),
              hint="every layer's attention forward is your ring_attention (minipar's backward uses your o and "
                   "lse); the grader compares the run with one process"),
    Criterion("trainer --cp 3 --cp-layout contiguous", ranks=3,
              trainer=trainer_flags("--cp", "3", "--cp-layout", "contiguous", block_size=12), timeout=120,
              uses=RING_USES + ("positions",),
              hint="three ranks, the contiguous split of 12 tokens; the grader compares the run with one process"),
]
