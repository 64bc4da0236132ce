"""Lab 20's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): minipar.parallel.context.ulysses's heads_of, to_heads and to_tokens, so
that every attention layer of a --cp-impl ulysses run takes its head lists from the student's
heads_of and runs its four all-to-alls (forward: q, k, v to heads, the output back; backward:
the output's gradient to heads, the q, k, v gradients back) through the student's exchanges.
Oracle: written here. A rank's heads are derived afresh, as the query heads j H/C .. and
the KV heads those queries read (h // (H/Hkv)), which is what Ulysses must keep together;
the exchanges are slices and sums of every rank's array, which the grader draws itself from
the cases' seeds (drive.case_input); the bytes are the pieces' sizes; a run's bytes are
ulysses' formula, written out again here.
"""
import os
import re

import numpy as np

from labs.framework import Criterion, expect, load_drive, trainer_flags
from labs.results import key
from labs.scan import Allowed

TITLE = "Ulysses: the sequence-to-head all-to-all and back"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
OWN_REASON = "minipar's own Ulysses: this lab grades yours"
ALLOWED = Allowed(
    modules={"minipar.comm": {"traffic", "reset_traffic", "CommTimeout"}},
    refused={**{f"minipar.parallel.context.ulysses.{n}": OWN_REASON
                for n in ("heads_of", "kv_heads_of", "head_split", "to_heads", "to_tokens", "UlyssesAttention")},
             **{f"minipar.comm.{n}": "minipar's own collective: send your pieces with g.begin and call.sendrecv"
                for n in ("all_to_all", "all_to_all_async", "alltoall", "hierarchical_alltoall")}})


def want_heads(j, H, Hkv, C):
    """Rank j's packed head list: its query heads, then the keys and the values of the KV
    heads those queries read."""
    queries = [h for h in range(H) if h // (H // C) == j]
    kv = sorted({q // (H // Hkv) for q in queries})
    return queries + [H + h for h in kv] + [H + Hkv + h for h in kv]


def servable(H, Hkv, C):
    return H % C == 0 and (Hkv % C == 0 or C % Hkv == 0)


def as_ints(got):
    """A list of ints from a list, tuple or 1-D array of whole numbers; None otherwise."""
    if isinstance(got, np.ndarray) and got.ndim == 1:
        got = list(got)
    if not isinstance(got, (list, tuple)):
        return None
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in got):
        return None
    return [int(v) for v in got]


def judge_heads(res):
    for H, Hkv, C in drive.HEAD_CASES:
        assert servable(H, Hkv, C)
        for j in range(C):
            got = res.get(0, key("heads", H, Hkv, C, j))
            want = want_heads(j, H, Hkv, C)
            what = f"heads_of(j={j}, H={H}, Hkv={Hkv}, C={C})"
            ints = as_ints(got)
            assert ints is not None, f"{what}: returned {got!r:.200}, want a list of ints {want}"
            assert ints == want, f"{what}: {ints}, want {want} (query heads, then H + each KV head, " \
                                 f"then H + Hkv + each)"
    for H, Hkv, C in drive.REFUSED:
        assert not servable(H, Hkv, C)
        kind, value = res.get(0, key("refused", H, Hkv, C))
        what = f"heads_of(j=0, H={H}, Hkv={Hkv}, C={C})"
        assert kind == "ValueError", f"{what}: returned {value!r:.200}; no split gives each of {C} ranks whole " \
                                     f"heads here: raise ValueError"
        numbers = set(re.findall(r"\d+", value))
        missing = [f"{n}={v}" for n, v in (("H", H), ("Hkv", Hkv), ("C", C)) if str(v) not in numbers]
        assert not missing, f"{what}: the ValueError's message {value!r:.200} does not name {', '.join(missing)}"
        assert "\n" not in value.strip(), f"{what}: the ValueError's message is more than one line"


def judge_result(res, r, k, want, arg, what):
    got = res.get(r, k)
    assert isinstance(got, np.ndarray), f"{what}: returned {getattr(got, 'typename', type(got).__name__)}, " \
                                        f"want an array"
    expect(got, want, what)
    after = res.get(r, key(k, "arg after"))
    assert isinstance(after, np.ndarray) and after.shape == arg.shape and np.array_equal(after, arg), \
        f"{what}: the input was modified"
    assert res.get(r, key(k, "aliases")) is False, f"{what}: the result shares memory with the input (return a " \
                                                   f"new array)"


def judge_forward(res):
    for p in range(1, drive.P_MAX + 1):
        for i, (name, B, t, n, hs, hl, dtype) in enumerate(drive.exchange_cases(p)):
            xs = [drive.case_input(p, s, (B, t, n, hs), dtype, 1) for s in range(p)]
            for r in range(p):
                want = np.concatenate([x[:, :, hl[r]] for x in xs], axis=1)
                judge_result(res, r, key("fwd", p, r, i), want, xs[r],
                             f"p={p} rank {r} to_heads, {name}: x {(B, t, n, hs)} {dtype}, heads {hl}")


def judge_backward(res):
    for p in range(1, drive.P_MAX + 1):
        for i, (name, B, t, n, hs, hl, dtype) in enumerate(drive.exchange_cases(p)):
            ys = [drive.case_input(p, s, (B, p * t, len(hl[s]), hs), dtype, 2) for s in range(p)]
            for r in range(p):
                want = np.zeros((B, t, n, hs), dtype)
                for j in range(p):
                    for c, h in enumerate(hl[j]):
                        want[:, :, h] += ys[j][:, r * t:(r + 1) * t, c]
                judge_result(res, r, key("bwd", p, r, i), want, ys[r],
                             f"p={p} rank {r} to_tokens, {name}: y {ys[r].shape} {dtype}, heads {hl}, n={n}")


def judge_ledger(res):
    """One call named all_to_all sending the other ranks' pieces and nothing else: (p-1) B t m
    hs itemsize bytes both ways (every size is known on both sides: no counts travel)."""
    for p in range(1, drive.P_MAX + 1):
        for i, (name, B, t, n, hs, hl, dtype) in enumerate(drive.exchange_cases(p)):
            for r in range(p):
                m = len(hl[r])
                for which in ("to_heads", "to_tokens"):
                    sent, calls = res.get(r, key("sent", which, p, r, i)), res.get(r, key("calls", which, p, r, i))
                    what = f"p={p} rank {r} {which}, {name} ({dtype})"
                    assert isinstance(sent, int) and isinstance(calls, dict), f"{what}: the ledger's record is damaged"
                    want = (p - 1) * B * t * m * hs * np.dtype(dtype).itemsize
                    assert sent == want, f"{what}: sent {sent} B, want {want} B = (p-1) x B t m hs x itemsize: " \
                                         f"each other rank's piece once, and nothing else"
                    if p == 1 or want == 0:
                        assert set(calls) <= {"all_to_all"} and calls.get("all_to_all", 0) <= 1, \
                            f"{what}: the ledger holds {calls}; at most one call, named all_to_all"
                        continue
                    assert calls == {"all_to_all": 1}, f"{what}: the ledger holds {calls}; want one call, " \
                                                       f"g.begin('all_to_all', steps) ... call.done()"


def flag(flags, name, default):
    return int(flags[flags.index(name) + 1]) if name in flags else default


def run_bytes(flags):
    """A --cp-impl ulysses run's all-to-all bytes per step and rank: per layer, forward q, k, v
    to heads ((Hq + 2 kv) hs a token) and the output back (Hq hs), backward the output's
    gradient and the q, k, v gradients: (C-1) B t itemsize x 2 ((Hq + 2 kv) hs + Hq hs)."""
    C, H = flag(flags, "--cp", 1), flag(flags, "--n-head", 4)
    Hkv, hs = flag(flags, "--n-kv-head", H), flag(flags, "--n-embd", 128) // H
    rows = flag(flags, "--batch-size", 8) * flag(flags, "--block-size", 64) // C
    Hq, kv = H // C, max(1, Hkv // C)
    return flag(flags, "--n-layer", 4) * (C - 1) * rows * 8 * 2 * ((Hq + 2 * kv) * hs + Hq * hs)


def judge_trainer(run):
    cp = run.summary.get("context_parallel") if isinstance(run.summary, dict) else None
    assert isinstance(cp, dict), f"the run's summary holds no context_parallel figures: {str(run.summary)[:200]}"
    want = run_bytes(run.flags)
    got = cp.get("bytes_per_step")
    assert isinstance(got, (int, float)) and got == want, \
        f"the run's Ulysses all-to-alls sent {got!r} B per step and rank, want {want} B (4 all-to-alls a layer, " \
        f"(C-1)/C of each); {run.figures.get('line', '')}"


CP3 = trainer_flags("--cp", "3", "--cp-impl", "ulysses", n_head=3, n_embd=24, block_size=12)
CP4_GQA = trainer_flags("--cp", "4", "--cp-impl", "ulysses", "--arch", "llama", "--n-kv-head", "2", n_head=4)

CRITERIA = [
    Criterion("heads of each rank", run="heads", judge=judge_heads, timeout=30, uses=("heads_of",),
              hint="query heads j H/C .. (j+1) H/C - 1; the KV heads are the ones those queries read, "
                   "h // (H/Hkv): Hkv/C of them, or one copied to C/Hkv ranks; keys at H + h, values at "
                   "H + Hkv + h"),
    Criterion("to_heads against NumPy", ranks=4, run="forward", judge=judge_forward, timeout=60, uses=("to_heads",),
              hint="round k sends x[:, :, heads[r+k]] to rank r+k and receives rank r-k's piece, which "
                   "goes to tokens (r-k) t .. of the result (the source's slot); MINIPAR_TRACE=1 prints "
                   "every message"),
    Criterion("to_tokens against NumPy", ranks=4, run="backward", judge=judge_backward, timeout=60,
              uses=("to_tokens",),
              hint="rank j gets y[:, j t:(j+1) t]; what rank s sends back belongs to heads[s] of my tokens: "
                   "add it there (+=), since a copied KV head comes back from several ranks"),
    Criterion("bytes in the ledger", ranks=4, run="ledger", judge=judge_ledger, timeout=60,
              uses=("to_heads", "to_tokens"),
              hint="one call (g.begin once) per exchange; send each peer only its own piece; the sizes are "
                   "known on both sides, so no counts travel; comm.traffic() after a call shows what was counted"),
    Criterion("trainer --cp 3 --cp-impl ulysses", ranks=3, trainer=CP3, judge=judge_trainer, timeout=120,
              uses=("heads_of", "to_heads", "to_tokens"),
              hint="3 cp ranks (zig-zag), one head each: every attention layer runs your four all-to-alls; "
                   "the grader compares the run with one process and its bytes with the formula"),
    Criterion("trainer --cp 4 --cp-impl ulysses --arch llama --n-kv-head 2", ranks=4, trainer=CP4_GQA,
              judge=judge_trainer, timeout=120, uses=("heads_of", "to_heads", "to_tokens"),
              hint="4 cp ranks, 4 query heads and 2 KV heads: each KV head is copied to 2 ranks, and its "
                   "gradient is the sum of what both send back"),
]
