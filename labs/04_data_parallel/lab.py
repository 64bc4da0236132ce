"""Lab 04's seam and criteria (labs/framework.py says what a lab is).

Seam: minipar.parallel.data_parallel.make, which the trainer calls to build its gradient
synchroniser for dp > 1: it returns the student's DataParallelNaive or DataParallelBucketed,
their finish() counted.
Oracle: the single-process twin, on every rank (a tiny float64 GPT, L=1 C=16, no messages),
run through minipar.train's own step loop with the same weights and data; and for the bytes,
minipar.plan.all_reduce_sent over data_parallel.bucket_members' buckets. The dp groups are
cut from 4 ranks: dp = 2 (ranks 0-1 and 2-3, both halves run) and dp = 4.
"""
import numpy as np
from mpi4py import MPI

from labs.framework import Criterion, first_difference, trainer_flags
from minipar import comm, data, plan, tensor, train
from minipar.model import GPT, GPTConfig
from minipar.parallel import data_parallel

TITLE = "data parallelism: naive, then bucketed all-reduce started from gradient hooks"

BATCH = 16                                  # 8 rows per rank at dp = 2, 4 at dp = 4: M up to 4
SEED = 0
MODEL = "float64 GPT L=1 C=16"
# bucket_mb for the 61,312 gradient bytes of the L=1 C=16 model, and the buckets that
# bucket_members' reverse walk makes of them:
BUCKET_CASES = {1e3: "1 bucket", 0.015: "2 buckets", 0.004: "4 buckets", 1e-9: "16 buckets, one each"}
_tokens, _twins, _groups = {}, {}, {}


def config(n_embd=16):
    return GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=n_embd)


def flags(micro_batches, steps, n_embd=16):
    return train.build_parser().parse_args(
        ["--batch-size", str(BATCH), "--steps", str(steps), "--warmup", "1", "--lr", "1e-2",
         "--grad-clip", "0", "--dtype", "float64", "--seed", str(SEED), "--n-layer", "1",
         "--n-head", "2", "--n-embd", str(n_embd), "--block-size", "16",
         "--micro-batches", str(micro_batches)])


def tokens():
    if "t" not in _tokens:
        _tokens["t"] = data.load_tokens(None, 16)
    return _tokens["t"]


def group(dp):
    """The dp group of this rank: dp = 4 is the world, dp = 2 its halves (ranks 0-1, 2-3)."""
    if dp not in _groups:
        world = MPI.COMM_WORLD
        sub = world.Split(world.Get_rank() // dp, world.Get_rank())
        _groups[dp] = comm.Group(sub, axis="dp")
        sub.Free()
    return _groups[dp]


class Observer:
    """What a criterion watches in a Run: attach(run) once the synchroniser exists, then
    after_step(run, step) after each step."""

    def attach(self, run):
        pass

    def after_step(self, run, step):
        pass


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


class Run:
    """One short training run: the losses of its steps, then its model (grads and params)."""

    def __init__(self, make_sync=None, g=None, micro_batches=1, steps=2, n_embd=16, freeze=(),
                 observer=None):
        args = flags(micro_batches, steps, n_embd)
        self.model = model = GPT(config(n_embd), seed=SEED, dtype=np.float64)
        for name in freeze:
            model.params[name].requires_grad = False
        opt = train.build_optimizer(model, args)
        sampler = data.Sampler(tokens(), 16, BATCH, SEED)
        self.sync = make_sync(model.parameters(), g) if make_sync is not None else None
        observer = observer or Observer()
        if self.sync is not None:
            observer.attach(self)
        rows = (0, BATCH) if g is None else (g.rank * BATCH // g.size, (g.rank + 1) * BATCH // g.size)
        session = train.Session(args, model, opt, sampler, sync=self.sync, rows=rows,
                                dp_group=g)
        self.losses = []
        for step, row in enumerate(train.train_steps(session, 0, steps)):
            self.losses.append(row["loss"])
            observer.after_step(self, step)


def twin(micro_batches=1, steps=2, n_embd=16, freeze=()):
    key = (micro_batches, steps, n_embd, freeze)
    if key not in _twins:
        _twins[key] = Run(None, None, micro_batches, steps, n_embd, freeze)
    return _twins[key]


def same_as_twin(got: Run, want: Run, what: str):
    """Losses at 1e-12, each gradient at 1e-12 of its largest entry, each parameter at 1e-12."""
    diff = first_difference(got.losses, want.losses, rtol=1e-12, atol=0)
    assert diff is None, f"{what}: losses of the steps {diff} (step = index)"
    for (name, p), q in zip(got.model.named_parameters(), want.model.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{what}: {name} is frozen (requires_grad False), its .grad " \
                                   f"should stay None, got an array"
            continue
        assert p.grad is not None, f"{what}: {name}.grad is None after the step"
        scale = max(float(np.abs(q.grad).max()), 1e-30)
        diff = first_difference(p.grad, q.grad, rtol=0, atol=1e-12 * scale)
        assert diff is None, f"{what}: gradient of {name} after the last step: {diff}"
    for (name, p), q in zip(got.model.named_parameters(), want.model.parameters()):
        diff = first_difference(p.data, q.data, rtol=1e-12, atol=1e-14)
        assert diff is None, f"{what}: parameter {name} after the steps: {diff}"


def naive(student):
    return lambda params, g: student.DataParallelNaive(params, g)


def bucketed(student, bucket_mb):
    return lambda params, g: student.DataParallelBucketed(params, g, bucket_mb)


def address(a):
    return a.__array_interface__["data"][0]


# --- the criteria ---------------------------------------------------------------------------

class Addresses(Observer):
    """After each step: where every trainable gradient lives in memory."""

    def __init__(self):
        self.seen = []

    def after_step(self, run, step):
        self.seen.append({p.name: p.grad for p in trainable(run.model)})


def check_buffers(student):
    """One process (a group of 1): the buckets' buffers are allocated once, and a single bucket
    holds every gradient in one flat run of memory; the gradients equal the twin's."""
    g = comm.Group(MPI.COMM_SELF, axis="dp")
    for bucket_mb, label in BUCKET_CASES.items():
        what = f"{MODEL}, group of 1 rank, bucket_mb={bucket_mb:g} ({label}), micro-batches 2"
        seen = Addresses()
        run = Run(bucketed(student, bucket_mb), g, micro_batches=2, steps=3, observer=seen)
        for step, grads in enumerate(seen.seen):
            for name, grad in grads.items():
                assert isinstance(grad, np.ndarray), \
                    f"{what}: {name}.grad is {type(grad).__name__} after step {step}, not an array"
                at, first = address(grad), address(seen.seen[0][name])
                assert at == first, \
                    f"{what}: {name}.grad lives at a new address after step {step} ({at:#x}, after " \
                    f"step 0 {first:#x}): a buffer allocated again each step"
        grads = seen.seen[0]
        spans = sorted((address(a), address(a) + a.nbytes, name) for name, a in grads.items())
        for (a0, a1, n0), (b0, b1, n1) in zip(spans, spans[1:]):
            assert a1 <= b0, f"{what}: the gradients of {n0} and {n1} overlap in memory"
        if bucket_mb >= 1e3:                            # one bucket: one flat buffer, all views
            total = sum(a.nbytes for a in grads.values())
            owners = {id(_owner(a)) for a in grads.values()}
            lo, hi = spans[0][0], max(s[1] for s in spans)
            assert len(owners) == 1 and hi - lo == total, \
                f"{what}: one bucket must be one flat buffer of {total} B with every gradient a view " \
                f"of it; the gradients are views of {len(owners)} array(s) spread over {hi - lo} B"
        same_as_twin(run, twin(2, 3), what)
        assert isinstance(run.sync.exposed_seconds, float) and run.sync.exposed_seconds >= 0, \
            f"{what}: exposed_seconds = {run.sync.exposed_seconds!r}, want the seconds finish() waited"


def _owner(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def check_naive(student):
    for dp in (2, 4):
        g = group(dp)
        for m in (1, 2, 4):
            what = f"{MODEL}, naive, dp={dp} rank {g.rank}, micro-batches {m}"
            run = Run(naive(student), g, micro_batches=m)
            same_as_twin(run, twin(1), what)


def check_bucketed(student):
    for dp in (2, 4):
        g = group(dp)
        for bucket_mb, label in BUCKET_CASES.items():
            for m in (1, 2, 4) if dp == 2 else (1, 4):
                what = f"{MODEL}, bucketed, dp={dp} rank {g.rank}, bucket_mb={bucket_mb:g} ({label}), " \
                       f"micro-batches {m}"
                same_as_twin(Run(bucketed(student, bucket_mb), g, micro_batches=m), twin(1), what)


class Ledger(Observer):
    """The all-reduces a synchroniser makes in each step, from start_step to finish's return,
    read from minipar's ledger (comm.traffic)."""

    def __init__(self):
        self.steps = []

    def attach(self, run):
        sync = run.sync
        start, finish = sync.start_step, sync.finish

        def counted_start():
            self.before = comm.traffic().get("all_reduce", {"calls": 0, "bytes_sent": 0})
            return start()

        def counted_finish():
            out = finish()
            now = comm.traffic().get("all_reduce", {"calls": 0, "bytes_sent": 0})
            self.steps.append((now["calls"] - self.before["calls"], now["bytes_sent"] - self.before["bytes_sent"]))
            return out

        sync.start_step, sync.finish = counted_start, counted_finish


def check_bytes(student):
    """Per step: one all-reduce per bucket (per parameter for naive), whatever the number of
    micro-batches, and exactly the bytes minipar's formula gives for those all-reduces."""
    # C=32 holds 171,776 B in one bucket (direct exchange, 2(p-1)/p n); at C=16 every bucket is
    # <= 64 KiB (recursive doubling, log2(p) n). 0.0272 MiB cuts C=16 into wte and the rest.
    cases = [("naive", None, 16), ("bucketed", 1e3, 32), ("bucketed", 0.0272, 16), ("bucketed", 1e-9, 16)]
    for dp in (2, 4):
        g = group(dp)
        for mode, bucket_mb, n_embd in cases:
            for m in (4,):
                make = naive(student) if mode == "naive" else bucketed(student, bucket_mb)
                ledger = Ledger()
                run = Run(make, g, micro_batches=m, n_embd=n_embd, observer=ledger)
                sizes = [p.size for p in trainable(run.model)]
                if mode == "naive":
                    buckets = [[i] for i in range(len(sizes))]
                    label = f"naive ({len(buckets)} parameters)"
                else:
                    buckets = data_parallel.bucket_members([8 * n for n in sizes], bucket_mb)
                    label = f"bucketed, bucket_mb={bucket_mb:g} ({len(buckets)} bucket(s))"
                sent = [plan.all_reduce_sent(sum(sizes[i] for i in b), 8, g.size, g.rank) for b in buckets]
                what = f"{label}, L=1 C={n_embd} float64, dp={dp} rank {g.rank}, micro-batches {m}"
                for step, (calls, nbytes) in enumerate(ledger.steps):
                    assert calls == len(buckets), \
                        f"{what}, step {step}: {calls} all-reduces, want {len(buckets)}: one per " \
                        f"{'parameter' if mode == 'naive' else 'bucket (the reverse walk of bucket_mb)'} per step, " \
                        f"on the last micro-batch only"
                    assert nbytes == sum(sent), \
                        f"{what}, step {step}: the ledger counted {nbytes} B sent, want {sum(sent)} B " \
                        f"(plan.all_reduce_sent of each all-reduce: {sent[:6]}{' ...' if len(sent) > 6 else ''})"
                assert len(ledger.steps) == 2, f"{what}: finish() ran {len(ledger.steps)} times in 2 steps"


class Watch(Observer):
    """Events of the bucketed synchroniser: every comm.all_reduce_async and comm.all_reduce it
    starts, the gradients that arrive (a hook registered after the student's own), and the
    backward passes around them."""

    def __init__(self):
        self.backwards = 0                  # backward passes begun in this step
        self.inside = False                 # in a backward now?
        self.arrived = []                   # parameter indices, in arrival order, this backward
        self.starts = []                    # one dict per all_reduce_async of the step
        self.blocking = []
        self.open = False                   # between start_step and finish's return
        self.steps = []                     # (arrived on the last backward, starts, blocking, backwards)

    def attach(self, run):
        params = trainable(run.model)
        index = {id(p): i for i, p in enumerate(params)}
        self.params = params
        for p in params:
            p.register_grad_hook(lambda p: self.arrived.append(index[id(p)]) if self.open else None)
        sync, start, finish = run.sync, run.sync.start_step, run.sync.finish

        def start_step():
            self.open, self.backwards, self.starts, self.blocking = True, 0, [], []
            return start()

        def finished():
            self.inside = False
            out = finish()
            self.steps.append((list(self.arrived), self.starts, self.blocking, self.backwards))
            self.open = False
            return out

        sync.start_step, sync.finish = start_step, finished

    def members(self, x):
        return [i for i, p in enumerate(self.params) if p.grad is not None and np.shares_memory(x, p.grad)]

    def on_start(self, x, blocking=False):
        if not self.open:
            return None
        event = {"backward": self.backwards, "inside": self.inside, "arrived": len(self.arrived),
                 "members": self.members(x), "nbytes": x.nbytes, "tests": 0}
        (self.blocking if blocking else self.starts).append(event)
        return event


class Pushed:
    """A Handle that counts the test() calls made on it during backward."""

    def __init__(self, handle, event, watch):
        self._handle, self._event, self._watch = handle, event, watch

    def test(self):
        if self._event is not None and self._watch.inside:
            self._event["tests"] += 1
        return self._handle.test()

    def wait(self):
        return self._handle.wait()

    @property
    def done(self):
        return self._handle.done

    def __getattr__(self, name):
        return getattr(self._handle, name)


def watching(watch):
    """Patch comm.all_reduce_async, comm.all_reduce and tensor.backward to report to watch;
    -> a function that undoes it."""
    saved = comm.all_reduce_async, comm.all_reduce, tensor.backward

    def all_reduce_async(g, x, op="sum", *, out=None):
        event = watch.on_start(np.asarray(x))
        return Pushed(saved[0](g, x, op, out=out), event, watch)

    def all_reduce(g, x, op="sum", *, out=None):
        watch.on_start(np.asarray(x), blocking=True)
        return saved[1](g, x, op, out=out)

    def backward(root, grad, retain_graph=False):
        watch.backwards += 1
        watch.arrived = []
        watch.inside = True
        try:
            return saved[2](root, grad, retain_graph=retain_graph)
        finally:
            watch.inside = False

    comm.all_reduce_async, comm.all_reduce, tensor.backward = all_reduce_async, all_reduce, backward

    def undo():
        comm.all_reduce_async, comm.all_reduce, tensor.backward = saved
    return undo


def check_events(student):
    """dp = 4, bucket_mb = 0.004 (4 buckets), micro-batches 1 and 2: every bucket's all-reduce
    is a comm.all_reduce_async of the gradients' own memory, started from the hook of its
    last gradient during the last backward, the buckets those of the reverse walk; and every
    bucket in flight while gradients still arrive is pushed with test()."""
    g, bucket_mb = group(4), 0.004
    for m in (1, 2):
        watch = Watch()
        undo = watching(watch)
        try:
            Run(bucketed(student, bucket_mb), g, micro_batches=m, observer=watch)
        finally:
            undo()
        params = watch.params
        names = [p.name for p in params]
        want = data_parallel.bucket_members([p.data.nbytes for p in params], bucket_mb)
        def show(ids):                  # names in reverse model order, the last parameter first
            ids = sorted(ids, reverse=True)
            return "[" + ", ".join(names[i] for i in ids[:3]) + (", ..." if len(ids) > 3 else "") + "]"

        for step, (arrived, starts, blocking, backwards) in enumerate(watch.steps):
            what = f"{MODEL}, bucketed, dp=4 rank {g.rank}, bucket_mb={bucket_mb:g} ({len(want)} buckets), " \
                   f"micro-batches {m}, step {step}"
            grads = [e for e in blocking if e["members"]]
            assert not grads, f"{what}: a blocking comm.all_reduce of {show(grads[0]['members'])}'s " \
                              f"gradients; start each bucket with comm.all_reduce_async"
            assert starts, f"{what}: no comm.all_reduce_async in the step"
            for e in starts:
                assert e["backward"] == backwards and e["inside"], \
                    f"{what}: an all-reduce of {show(e['members'])} started " + \
                    (f"during the backward of micro-batch {e['backward'] - 1}, not the last ({m - 1})"
                     if e["inside"] and e["backward"] < backwards else "after backward returned") + \
                    "; start each bucket from the hook of its last gradient, during the last backward"
                assert e["members"], f"{what}: an all-reduce of {e['nbytes']} B that holds no parameter's " \
                                     f".grad: the gradients must be views of the bucket (set_grad_buffer)"
                covered = sum(params[i].data.nbytes for i in e["members"])
                assert covered == e["nbytes"], \
                    f"{what}: the all-reduce of {show(e['members'])} sends {e['nbytes']} B, " \
                    f"their gradients hold {covered} B"
            got = [sorted(e["members"]) for e in starts]
            for k, bucket in enumerate(got):
                expected = next((sorted(b) for b in want if set(b) & set(bucket)), [])
                held = lambda ids: sum(params[i].data.nbytes for i in ids)  # noqa: E731
                assert bucket == expected, \
                    f"{what}: all-reduce {k} held {len(bucket)} gradient(s), {held(bucket)} B: " \
                    f"{show(bucket)}; the reverse walk (close a bucket at >= " \
                    f"{max(1, int(bucket_mb * 1024 * 1024))} B) puts {len(expected)}, {held(expected)} B, " \
                    f"in that bucket: {show(expected)}; bucket 0 is {show(want[0])}"
            assert len(got) == len(want), f"{what}: {len(got)} all-reduces started, want {len(want)} (one per bucket)"
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
        assert len(watch.steps) == 2, f"micro-batches {m}: finish() ran {len(watch.steps)} times in 2 steps"


def check_frozen(student):
    """wpe.weight frozen (requires_grad False) and wte.weight tied (the model's default):
    no hang, wpe untouched with .grad None, every other gradient and parameter the twin's."""
    g = group(4)
    freeze = ("wpe.weight",)
    cases = [("bucketed", 1e3), ("bucketed", 0.004), ("bucketed", 1e-9), ("naive", None)]
    for mode, bucket_mb in cases:
        make = naive(student) if mode == "naive" else bucketed(student, bucket_mb)
        label = "naive" if mode == "naive" else f"bucketed, bucket_mb={bucket_mb:g}"
        what = f"{MODEL}, {label}, wpe.weight frozen, wte.weight tied, dp=4 rank {g.rank}, micro-batches 2"
        run = Run(make, g, micro_batches=2, freeze=freeze)
        same_as_twin(run, twin(1, freeze=freeze), what)


def install(student):
    """The trainer's data-parallel synchroniser becomes the student's; finish() counted."""
    calls = [0]

    def make(params, group, mode="bucketed", bucket_mb=1.0):
        if mode == "naive":
            sync = student.DataParallelNaive(params, group)
        elif mode == "bucketed":
            sync = student.DataParallelBucketed(params, group, bucket_mb)
            if not hasattr(sync, "buckets"):        # the start-up line and summary count them
                sync.buckets = data_parallel.bucket_members(
                    [p.data.nbytes for p in params if p.requires_grad], bucket_mb)
        else:
            raise ValueError(f"unknown data-parallel mode {mode!r} (bucketed, naive)")
        finish = sync.finish

        def counted():
            calls[0] += 1
            return finish()
        sync.finish = counted
        return sync

    data_parallel.make = make
    return lambda: calls[0]



CRITERIA = [
    Criterion("buffers allocated once", check=check_buffers, timeout=30,
              hint="allocate each bucket's flat buffer once in __init__; in zero_grad point p.grad at "
                   "its view with p.set_grad_buffer(view) (minipar.tensor.Tensor.set_grad_buffer)"),
    Criterion("naive matches one process", ranks=4, check=check_naive, timeout=60,
              hint="sum, don't average: each rank's loss is already divided by the global token count "
                   "B*T (minipar.train.train_step); one comm.all_reduce per gradient in finish()"),
    Criterion("bucketed matches one process", ranks=4, check=check_bucketed, timeout=60,
              hint="start_step must reset every bucket's count of missing gradients and its handle; "
                   "minipar.parallel.data_parallel.DataParallelBucketed shows the whole mechanism"),
    Criterion("one all-reduce per bucket, bytes", ranks=4, check=check_bytes, timeout=60,
              hint="communicate only while sync_now(True), i.e. on the last micro-batch; comm.traffic() "
                   "counts the calls and bytes, minipar.plan.all_reduce_sent gives the formula"),
    Criterion("buckets start in backward, reverse", ranks=4, check=check_events, timeout=60,
              hint="walk the parameters from the last to the first when filling buckets "
                   "(minipar.parallel.data_parallel.bucket_members); start a bucket in the hook of its "
                   "last gradient and h.test() the ones in flight from every hook"),
    Criterion("frozen wpe, tied wte", ranks=4, check=check_frozen, timeout=60,
              hint="keep only the parameters with requires_grad True: a frozen one never calls its hook, "
                   "so its bucket would never be ready"),
    Criterion("trainer --dp 4 bucketed --verify", ranks=4,
              trainer=trainer_flags("--dp", "4", "--dp-mode", "bucketed", "--bucket-mb", "0.05",
                                    "--micro-batches", "2"), timeout=90,
              hint="the real trainer on 4 ranks with your buckets of 0.05 MiB and 2 micro-batches; "
                   "the twin is one process"),
    Criterion("trainer --dp 2 naive --verify", ranks=2, trainer=trainer_flags("--dp", "2", "--dp-mode", "naive"),
              timeout=90, hint="the real trainer on 2 ranks with your naive all-reduce"),
]
