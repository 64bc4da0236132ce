"""Lab 04's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam (drive.install): minipar.parallel.data_parallel.make, which the trainer calls to build
its gradient synchroniser for dp > 1: it returns the student's DataParallelNaive or
DataParallelBucketed, their finish() counted.
Oracles, computed here: the single-process twin (drive.Run with no synchroniser: a tiny GPT,
L=1 C=16, float64 or float32, through minipar.train's own step loop with the same weights and
data, no messages); for the buckets, minipar.parallel.data_parallel.bucket_members; for the
bytes, minipar.plan.comm_bytes.all_reduce_sent of each bucket. The child hands back each run's losses,
gradients and parameters, exposed_seconds, and what its observers saw (addresses, the
ledger's all-reduces per step, every all-reduce started with its members and timing).
"""
import math
import os

import numpy as np

from labs.framework import Criterion, first_difference, load_drive, trainer_flags
from labs.results import key, typename
from labs.scan import Allowed
from minipar.plan import comm_bytes
from minipar.parallel import data_parallel

TITLE = "data parallelism: naive, then bucketed all-reduce started from gradient hooks"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
OWN_SYNC = "minipar's own synchroniser: this lab grades yours"
ALLOWED = Allowed(
    # "minipar" and "minipar.parallel" listed so that after `import minipar.parallel.data_parallel`
    # the dotted path minipar.parallel.data_parallel.X is checked name by name too
    modules={"minipar": {"comm", "parallel"}, "minipar.parallel": {"data_parallel"},
             "minipar.comm": {"all_reduce", "all_reduce_async", "traffic", "reset_traffic", "CommTimeout"},
             "minipar.parallel.data_parallel": {"GradSyncBase"}},
    refused={"minipar.parallel.data_parallel.DataParallelNaive": OWN_SYNC,
             "minipar.parallel.data_parallel.DataParallelBucketed": OWN_SYNC,
             "minipar.parallel.data_parallel.Bucket": "minipar's own bucket: this lab grades yours",
             "minipar.parallel.data_parallel.make": OWN_SYNC,
             "minipar.parallel.data_parallel.bucket_members":
                 "minipar's own bucket plan: walk the parameters yourself (the handout's rule)"})
# float32 runs on dp ranks add their rows in another order than one process: measured within
# 1e-5 of the largest gradient, 4e-6 on the parameters after AdamW's steps
F32 = {"loss": 1e-5, "grad": 1e-4, "param": 1e-4}
SLACK_SECONDS = 1e-3                # exposed_seconds measured with another clock than the drive's
_twins = {}


def twin(micro_batches=1, steps=2, n_embd=16, freeze=(), dtype="float64"):
    """The single-process run (no synchroniser), computed here once per case."""
    k = (micro_batches, steps, n_embd, freeze, dtype)
    if k not in _twins:
        _twins[k] = drive.Run(None, None, micro_batches, steps, n_embd, freeze, dtype=dtype)
    return _twins[k]


def hexa(v) -> str:
    return f"{v:#x}" if isinstance(v, int) else f"{v!r:.40}"


def where(dp, r) -> str:
    """'dp=2 rank 1 (world rank 3)'."""
    return f"dp={dp} rank {r % dp}" + (f" (world rank {r})" if dp < 4 else "")


def mode_text(mode, bucket_mb) -> str:
    return "naive" if mode == "naive" else f"bucketed, bucket_mb={drive.mb_text(bucket_mb)}"


def a_list(v, n, what, of="values") -> list:
    assert isinstance(v, (list, tuple)), f"{what}: the {of} came back as {typename(v)} (tampered with?)"
    assert len(v) == n, f"{what}: {len(v)} {of}, want one per step ({n})"
    return list(v)


# --- the run against its twin ---------------------------------------------------------------

def same_as_twin(res, rank, k, want, what, dtype="float64"):
    """Losses, every .grad and every parameter after the steps, against the twin: float64 at
    1e-12 (each gradient at 1e-12 of its largest entry), float32 at F32."""
    f32 = dtype == "float32"
    losses = res.get(rank, key(k, "losses"))
    a_list(losses, len(want.losses), what, "losses")
    diff = first_difference(losses, want.losses, rtol=F32["loss"] if f32 else 1e-12, atol=0)
    assert diff is None, f"{what}: losses of the steps {diff} (step = index)"
    grads = res.get(rank, key(k, "grads"))
    params = res.get(rank, key(k, "params"))
    for got, name in ((grads, "gradients"), (params, "parameters")):
        assert isinstance(got, dict), f"{what}: the {name} came back as {typename(got)} (tampered with?)"
    for name, q in want.model.params.items():
        g = grads.get(name)
        if q.grad is None:
            assert g is None, f"{what}: {name} is frozen (requires_grad False), its .grad should stay None, " \
                              f"got {typename(g)}"
            continue
        assert g is not None, f"{what}: {name}.grad is None after the step"
        scale = max(float(np.abs(q.grad).max()), 1e-30)
        tol = F32["grad"] if f32 else 1e-12
        diff = first_difference(g, q.grad, rtol=0, atol=tol * scale)
        assert diff is None, f"{what}: gradient of {name} after the last step: {diff}"
    for name, q in want.model.params.items():
        diff = first_difference(params.get(name), q.data, rtol=F32["param"] if f32 else 1e-12,
                                atol=F32["param"] if f32 else 1e-14)
        assert diff is None, f"{what}: parameter {name} after the steps: {diff}"


def exposed_ok(res, rank, k, steps, what):
    """exposed_seconds after each finish(): a float, >= 0, no more than finish() itself took
    (the drive timed it around the call), and > 0 in some step (set, not GradSyncBase's 0.0)."""
    exposed = a_list(res.get(rank, key(k, "exposed")), steps, what, "exposed_seconds readings")
    took = a_list(res.get(rank, key(k, "finish seconds")), steps, what, "finish() timings")
    for step, (e, t) in enumerate(zip(exposed, took)):
        assert isinstance(e, float) and math.isfinite(e) and e >= 0, \
            f"{what}, step {step}: exposed_seconds = {e!r} after finish(), want the seconds finish() waited (a float)"
        assert isinstance(t, float) and e <= t + SLACK_SECONDS, \
            f"{what}, step {step}: exposed_seconds = {e:.6f} s, but finish() took only {t:.6f} s: time only " \
            f"what finish() waits, from its start to its end"
    assert any(e > 0 for e in exposed), \
        f"{what}: exposed_seconds stayed 0.0 in every step: set it in finish() to the seconds it waited"


# --- the judges -----------------------------------------------------------------------------

def judge_buffers(res):
    """A group of one rank: every trainable .grad at the same address each step, no two
    overlapping; one bucket is one flat buffer; set_grad_buffer points each .grad at its
    view every step; the run equals the twin (3 steps, micro-batches 2)."""
    for bucket_mb, label in [*drive.BUCKET_CASES.items(), (drive.EXACT_32, "2 buckets, float32")]:
        dtype = "float32" if bucket_mb == drive.EXACT_32 else "float64"
        what = f"{drive.model_text(16, dtype)}, a group of 1 rank, bucket_mb={drive.mb_text(bucket_mb)} ({label}), " \
               f"micro-batches 2"
        k = key("buffers", bucket_mb)
        names = [n for n, _ in drive.trainable_meta(16, (), dtype)]
        seen = a_list(res.get(0, key(k, "addresses")), 3, what, "address records")
        for step, grads in enumerate(seen):
            assert isinstance(grads, dict) and sorted(grads) == sorted(names), \
                f"{what}: the addresses after step {step} came back as {typename(grads)} (tampered with?)"
            for name in names:
                a, first = grads[name], seen[0][name]
                assert isinstance(a, list) and len(a) == 3 and all(isinstance(x, int) for x in a), \
                    f"{what}: {name}.grad is {a!r:.60} after step {step}, not an array"
                assert a[0] == first[0], \
                    f"{what}: {name}.grad lives at a new address after step {step} ({a[0]:#x}, after step 0 " \
                    f"{first[0]:#x}): a buffer allocated again each step"
        grads = seen[0]
        spans = sorted((v[0], v[0] + v[1], name) for name, v in grads.items())
        for (_, a1, n0), (b0, _, n1) in zip(spans, spans[1:]):
            assert a1 <= b0, f"{what}: the gradients of {n0} and {n1} overlap in memory"
        if bucket_mb >= 1e3:                            # one bucket: one flat buffer, all views
            total = sum(v[1] for v in grads.values())
            owners = {v[2] for v in grads.values()}
            lo, hi = spans[0][0], max(s[1] for s in spans)
            assert len(owners) == 1 and hi - lo == total, \
                f"{what}: one bucket must be one flat buffer of {total} B with every gradient a view " \
                f"of it; the gradients are views of {len(owners)} array(s) spread over {hi - lo} B"
        calls = a_list(res.get(0, key(k, "set_grad_buffer")), 3, what, "set_grad_buffer records")
        for step, made in enumerate(calls):
            assert isinstance(made, list), f"{what}: the set_grad_buffer calls came back as {typename(made)}"
            pointed = {c[0]: c[1] for c in made if isinstance(c, list) and len(c) == 2}
            for name in names:
                assert pointed.get(name) == seen[step][name][0], \
                    f"{what}, step {step}: " + \
                    (f"zero_grad never called {name}.set_grad_buffer(view)" if name not in pointed else
                     f"{name}.set_grad_buffer got a buffer at {hexa(pointed[name])}, not its view at "
                     f"{seen[step][name][0]:#x}") + \
                    ": point every .grad at its view with p.set_grad_buffer(view) in zero_grad, so the first " \
                    "backward overwrites it (no memset, no new array)"
        same_as_twin(res, 0, k, twin(2, 3, dtype=dtype), what, dtype)
        exposed_ok(res, 0, k, 3, what)


def judge_naive(res):
    for dp, m, dtype in drive.NAIVE:
        for r in range(4):
            what = f"{drive.model_text(16, dtype)}, naive, {where(dp, r)}, micro-batches {m}"
            k = key("naive", dp, m, dtype)
            same_as_twin(res, r, k, twin(1, dtype=dtype), what, dtype)
            exposed_ok(res, r, k, 2, what)


def judge_bucketed(res):
    for dp, bucket_mb, m, dtype in drive.BUCKETED:
        for r in range(4):
            what = f"{drive.model_text(16, dtype)}, bucketed, {where(dp, r)}, bucket_mb={drive.mb_text(bucket_mb)}, " \
                   f"micro-batches {m}"
            k = key("bucketed", dp, bucket_mb, m, dtype)
            same_as_twin(res, r, k, twin(1, dtype=dtype), what, dtype)
            exposed_ok(res, r, k, 2, what)


def judge_bytes(res):
    """Per step: one all-reduce per bucket (per parameter for naive), whatever the number of
    micro-batches, and exactly the bytes of comm_bytes.all_reduce_sent for those all-reduces."""
    for dp in (2, 4):
        for mode, bucket_mb, n_embd, m, dtype in drive.BYTES:
            itemsize = np.dtype(dtype).itemsize
            nbytes = [b for _, b in drive.trainable_meta(n_embd, (), dtype)]
            if mode == "naive":
                buckets = [[i] for i in range(len(nbytes))]
                label = f"naive ({len(buckets)} parameters)"
            else:
                buckets = data_parallel.bucket_members(nbytes, bucket_mb)
                label = f"bucketed, bucket_mb={drive.mb_text(bucket_mb)} ({len(buckets)} bucket(s))"
            k = key("bytes", dp, mode, bucket_mb, n_embd, m, dtype)
            for r in range(4):
                sent = [comm_bytes.all_reduce_sent(sum(nbytes[i] for i in b) // itemsize, itemsize, dp, r % dp)
                        for b in buckets]
                what = f"{label}, L=1 C={n_embd} {dtype}, {where(dp, r)}, micro-batches {m}"
                steps = res.get(r, key(k, "steps"))
                assert isinstance(steps, list), f"{what}: the ledger's counts came back as {typename(steps)}"
                assert len(steps) == 2, f"{what}: finish() ran {len(steps)} times in 2 steps"
                for step, counted in enumerate(steps):
                    assert isinstance(counted, list) and len(counted) == 2, \
                        f"{what}, step {step}: the ledger's counts came back as {typename(counted)}"
                    calls, got = counted
                    assert calls == len(buckets), \
                        f"{what}, step {step}: {calls} all-reduces, want {len(buckets)}: one per " \
                        f"{'parameter' if mode == 'naive' else 'bucket (the reverse walk of bucket_mb)'} per step, " \
                        f"on the last micro-batch only"
                    assert got == sum(sent), \
                        f"{what}, step {step}: the ledger counted {got} B sent, want {sum(sent)} B " \
                        f"(comm_bytes.all_reduce_sent of each all-reduce of {dtype} gradients: " \
                        f"{sent[:6]}{' ...' if len(sent) > 6 else ''})"
                exposed_ok(res, r, k, 2, what)


def event_list(v, what) -> list:
    assert isinstance(v, list) and all(isinstance(e, dict) for e in v), \
        f"{what}: the events came back as {typename(v)} (tampered with?)"
    for e in v:
        ok = isinstance(e.get("members"), list) and all(isinstance(i, int) for i in e["members"]) and \
            all(isinstance(e.get(f), int) for f in ("backward", "arrived", "nbytes", "tests"))
        assert ok, f"{what}: an event came back damaged (tampered with?)"
    return v


def judge_events(res):
    """dp = 4. Bucketed: every bucket's all-reduce is a comm.all_reduce_async of the
    gradients' own memory, in place, in the parameters' dtype, started from the hook of its
    last gradient during the last backward, the buckets those of the reverse walk (on the
    exact limit too); every bucket in flight while gradients still arrive is pushed with
    test(). Naive: one blocking comm.all_reduce per parameter, of its gradient, in finish()."""
    for mode, bucket_mb, m, dtype, n_embd in drive.EVENTS:
        meta = drive.trainable_meta(n_embd, (), dtype)
        names = [n for n, _ in meta]
        nbytes = [b for _, b in meta]
        want = data_parallel.bucket_members(nbytes, bucket_mb) if mode == "bucketed" else []

        def show(ids):                  # names in reverse model order, the last parameter first
            ids = sorted(ids, reverse=True)
            return "[" + ", ".join(names[i] for i in ids[:3]) + (", ..." if len(ids) > 3 else "") + "]"

        def held(ids):
            return sum(nbytes[i] for i in ids)

        for r in range(4):
            steps = res.get(r, key("events", mode, bucket_mb, m, dtype, n_embd))
            assert isinstance(steps, list) and all(isinstance(s, dict) for s in steps), \
                f"the events came back as {typename(steps)} (tampered with?)"
            assert len(steps) == 2, f"{mode}, micro-batches {m}, rank {r}: finish() ran {len(steps)} times in 2 steps"
            for step, s in enumerate(steps):
                label = f"{len(want)} buckets" if mode == "bucketed" else f"{len(names)} parameters"
                what = f"{drive.model_text(n_embd, dtype)}, {mode_text(mode, bucket_mb)} ({label}), dp=4 rank {r}, " \
                       f"micro-batches {m}, step {step}"
                starts, blocking = event_list(s.get("starts"), what), event_list(s.get("blocking"), what)
                arrived, backwards = s.get("arrived"), s.get("backwards")
                assert isinstance(arrived, list) and all(isinstance(i, int) for i in arrived) and \
                    isinstance(backwards, int), f"{what}: the events came back damaged (tampered with?)"
                if mode == "naive":
                    judge_naive_events(starts, blocking, names, nbytes, show, what)
                    continue
                grads = [e for e in blocking if e["members"]]
                assert not grads, f"{what}: a blocking comm.all_reduce of {show(grads[0]['members'])}'s " \
                                  f"gradients; start each bucket with comm.all_reduce_async"
                assert starts, f"{what}: no comm.all_reduce_async in the step"
                for e in starts:
                    assert e["backward"] == backwards and e.get("inside") is True, \
                        f"{what}: an all-reduce of {show(e['members'])} started " + \
                        (f"during the backward of micro-batch {e['backward'] - 1}, not the last ({m - 1})"
                         if e.get("inside") and e["backward"] < backwards else "after backward returned") + \
                        "; start each bucket from the hook of its last gradient, during the last backward"
                    assert e["members"], f"{what}: an all-reduce of {e['nbytes']} B that holds no parameter's " \
                                         f".grad: the gradients must be views of the bucket (set_grad_buffer)"
                    assert all(0 <= i < len(names) for i in e["members"]), f"{what}: an event came back damaged"
                    covered = held(e["members"])
                    assert covered == e["nbytes"], \
                        f"{what}: the all-reduce of {show(e['members'])} sends {e['nbytes']} B, " \
                        f"their gradients hold {covered} B"
                    assert e.get("dtype") == dtype, \
                        f"{what}: the bucket of {show(e['members'])} is a {e.get('dtype')} buffer, the gradients " \
                        f"are {dtype}: allocate each bucket in the parameters' dtype"
                    assert e.get("in_place") is True, \
                        f"{what}: the all-reduce of {show(e['members'])} is not in place: start it as " \
                        f"comm.all_reduce_async(group, flat, out=flat), so the sum lands in the gradients' " \
                        f"own memory (no copy)"
                got = [sorted(e["members"]) for e in starts]
                limit = max(1, int(bucket_mb * drive.MiB))
                for j, bucket in enumerate(got):
                    expected = next((sorted(b) for b in want if set(b) & set(bucket)), [])
                    assert bucket == expected, \
                        f"{what}: all-reduce {j} held {len(bucket)} gradient(s), {held(bucket)} B: " \
                        f"{show(bucket)}; the reverse walk (close a bucket as soon as it holds >= {limit} B " \
                        f"= int(bucket_mb * 1024 * 1024)) puts {len(expected)}, {held(expected)} B, in that bucket: " \
                        f"{show(expected)}; bucket 0 is {show(want[0])}, {held(want[0])} B"
                assert len(got) == len(want), \
                    f"{what}: {len(got)} all-reduces started, want {len(want)} (one per bucket)"
                order = {i: pos for pos, i in enumerate(arrived)}
                for e in starts:
                    last = max(order.get(i, len(arrived)) for i in e["members"])
                    assert last <= e["arrived"] <= last + 1, \
                        f"{what}: the bucket {show(e['members'])} started after " \
                        f"{e['arrived']} gradient(s) had arrived; its last one was gradient {last + 1} of " \
                        f"{len(arrived)}: start it from that gradient's hook"
                    if e["arrived"] + 1 < len(arrived):
                        assert e["tests"] > 0, \
                            f"{what}: the bucket {show(e['members'])} was never " \
                            f"pushed (h.test()) while {len(arrived) - e['arrived'] - 1} more gradient(s) " \
                            f"arrived: test every bucket in flight from each hook"


def judge_naive_events(starts, blocking, names, nbytes, show, what):
    """One blocking comm.all_reduce per parameter, of its own gradient, made in finish()."""
    assert not starts, f"{what}: a comm.all_reduce_async in the naive synchroniser; it all-reduces each " \
                       f"gradient with a blocking comm.all_reduce in finish()"
    grads = [e for e in blocking if e["members"]]
    for e in grads:
        assert e.get("in_finish") is True and e.get("inside") is False, \
            f"{what}: the all-reduce of {show(e['members'])} ran " + \
            ("during backward" if e.get("inside") else "outside finish()") + \
            "; the naive synchroniser communicates in finish(), after the last backward"
        assert len(e["members"]) == 1 and e["nbytes"] == nbytes[e["members"][0]], \
            f"{what}: an all-reduce of {e['nbytes']} B holding the gradients of {show(e['members'])}: one " \
            f"comm.all_reduce per parameter, of its own gradient"
    got = sorted(e["members"][0] for e in grads)
    assert got == list(range(len(names))), \
        f"{what}: {len(got)} all-reduces of gradients in finish(), want one per parameter ({len(names)})" + \
        (f"; {names[min(set(range(len(names))) - set(got))]} has none" if set(range(len(names))) - set(got) else "")


def judge_frozen(res):
    for mode, bucket_mb in drive.FROZEN:
        for r in range(4):
            what = f"{drive.model_text()}, {mode_text(mode, bucket_mb)}, wpe.weight frozen, wte.weight tied, " \
                   f"dp=4 rank {r}, micro-batches 2"
            k = key("frozen", mode, bucket_mb)
            same_as_twin(res, r, k, twin(1, freeze=drive.FREEZE), what)
            exposed_ok(res, r, k, 2, what)


CRITERIA = [
    Criterion("buffers allocated once", run="buffers", judge=judge_buffers, timeout=30,
              uses=("DataParallelBucketed",),
              hint="allocate each bucket's flat buffer once in __init__, in the parameters' dtype; in zero_grad "
                   "point p.grad at its view with p.set_grad_buffer(view) (minipar.tensor.Tensor.set_grad_buffer)"),
    Criterion("naive matches one process", ranks=4, run="naive_runs", judge=judge_naive, timeout=60,
              uses=("DataParallelNaive",),
              hint="sum, don't average: each rank's loss is already divided by the global token count "
                   "B*T (minipar.train.trainer.train_step); one comm.all_reduce per gradient in finish(), and "
                   "exposed_seconds the seconds finish() took"),
    Criterion("bucketed matches one process", ranks=4, run="bucketed_runs", judge=judge_bucketed, timeout=60,
              uses=("DataParallelBucketed",),
              hint="start_step must reset every bucket's count of missing gradients and its handle; the "
                   "buffers hold the parameters' dtype (float32 too)"),
    Criterion("one all-reduce per bucket, bytes", ranks=4, run="bytes_runs", judge=judge_bytes, timeout=60,
              uses=("DataParallelNaive", "DataParallelBucketed"),
              hint="communicate only while sync_now(True), i.e. on the last micro-batch; comm.traffic() "
                   "counts the calls and bytes, minipar.plan.comm_bytes.all_reduce_sent gives the formula"),
    Criterion("buckets start in backward, reverse", ranks=4, run="events", judge=judge_events, timeout=60,
              uses=("DataParallelNaive", "DataParallelBucketed"),
              hint="walk the parameters from the last to the first, closing a bucket at >= "
                   "int(bucket_mb * 1024 * 1024) bytes of gradient (p.data.nbytes); start a bucket in place "
                   "in the hook of its last gradient and h.test() the ones in flight from every hook"),
    Criterion("frozen wpe, tied wte", ranks=4, run="frozen", judge=judge_frozen, timeout=60,
              uses=("DataParallelNaive", "DataParallelBucketed"),
              hint="keep only the parameters with requires_grad True: a frozen one never calls its hook, "
                   "so its bucket would never be ready"),
    Criterion("trainer --dp 4 bucketed", ranks=4,
              trainer=trainer_flags("--dp", "4", "--dp-mode", "bucketed", "--bucket-mb", "0.05",
                                    "--micro-batches", "2"), timeout=90,
              uses=("DataParallelBucketed",),
              hint="the real trainer on 4 ranks with your buckets of 0.05 MiB and 2 micro-batches; "
                   "the grader compares it with its own single-process run"),
    Criterion("trainer --dp 2 naive", ranks=2, trainer=trainer_flags("--dp", "2", "--dp-mode", "naive"),
              timeout=90, uses=("DataParallelNaive",),
              hint="the real trainer on 2 ranks with your naive all-reduce; the grader compares it with "
                   "its own single-process run"),
]
