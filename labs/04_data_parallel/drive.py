"""Lab 04, the student's side (labs/framework.py says what a lab is): short training runs
through minipar.train's own step loop with the student's synchroniser, the observers that
watch them, and the seam. Nothing here judges; lab.py does, in the grader, against the
single-process twin it runs itself (Run with no synchroniser: minipar's own code only).

Every run is a tiny GPT (L=1, C=16 or 32, float64 or float32) on the same weights and data
(SEED), so the grader rebuilds the twin and the parameter list without being told. For each
run the child records the losses, every gradient and parameter after the last step, and per
step exposed_seconds and how long finish() took; the observers add the gradients' addresses
and the set_grad_buffer calls (Addresses), the ledger's all-reduces (Ledger), and every
all-reduce started with its members, bytes, backward and arrivals (Watch). The dp groups are
cut from 4 ranks: dp = 2 (ranks 0-1 and 2-3, both halves run), dp = 4, and a group of one.
"""
import time

import numpy as np
from mpi4py import MPI

from labs.results import key
from minipar import comm
from minipar.train import data, trainer as train
from minipar.autograd import tensor
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel import data_parallel

BATCH = 16                                  # 8 rows per rank at dp = 2, 4 at dp = 4: M up to 4
SEED = 0
MiB = 1024 * 1024
# bucket_mb for the 61,312 gradient bytes of the L=1 C=16 float64 model, and the buckets that
# bucket_members' reverse walk makes of them:
BUCKET_CASES = {1e3: "1 bucket", 0.015: "2 buckets", 0.004: "4 buckets", 1e-9: "16 buckets, one each"}
# a limit equal, to the byte, to the first 7 gradients of the reverse walk (ln_f.bias ..
# h.0.ln_2.bias): 17,408 B in float64, 8,704 B in float32; bucket_mb * 2**20 is exact
EXACT_64 = 17408 / MiB
EXACT_32 = 8704 / MiB
# minipar's own synchronisers and bucket plan: reached from the student's file, each raises
# (labs/child.py)
OWN = ["minipar.parallel.data_parallel:bucket_members", "minipar.parallel.data_parallel:make",
       "minipar.parallel.data_parallel:Bucket.__init__",
       *[f"minipar.parallel.data_parallel:DataParallelNaive.{m}" for m in ("__init__", "finish")],
       *[f"minipar.parallel.data_parallel:DataParallelBucketed.{m}"
         for m in ("__init__", "zero_grad", "sync_now", "start_step", "_on_grad_ready", "finish", "grad_norm_sq")]]
_tokens, _groups = {}, {}


def model_text(n_embd=16, dtype="float64"):
    return f"{dtype} GPT L=1 C={n_embd}"


def config(n_embd=16):
    return GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=n_embd)


def flags(micro_batches, steps, n_embd=16, dtype="float64"):
    return train.build_parser().parse_args(
        ["--batch-size", str(BATCH), "--steps", str(steps), "--warmup", "1", "--lr", "1e-2",
         "--grad-clip", "0", "--dtype", dtype, "--seed", str(SEED), "--n-layer", "1",
         "--n-head", "2", "--n-embd", str(n_embd), "--block-size", "16",
         "--micro-batches", str(micro_batches)])


def tokens():
    if "t" not in _tokens:
        _tokens["t"] = data.load_tokens(None, 16)
    return _tokens["t"]


def new_model(n_embd=16, freeze=(), dtype="float64"):
    model = GPT(config(n_embd), seed=SEED, dtype=np.dtype(dtype))
    for name in freeze:
        model.params[name].requires_grad = False
    return model


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def trainable_meta(n_embd=16, freeze=(), dtype="float64"):
    """(name, gradient bytes) of every trainable parameter, in model order: what the grader
    rebuilds to read the observers' parameter indices."""
    return [(p.name, p.data.nbytes) for p in trainable(new_model(n_embd, freeze, dtype))]


def group(dp):
    """The dp group of this rank: dp = 4 is the world, dp = 2 its halves (ranks 0-1, 2-3),
    dp = 1 this rank alone."""
    if dp not in _groups:
        if dp == 1:
            _groups[dp] = comm.Group(MPI.COMM_SELF, axis="dp")
        else:
            world = MPI.COMM_WORLD
            sub = world.Split(world.Get_rank() // dp, world.Get_rank())
            _groups[dp] = comm.Group(sub, axis="dp")
            sub.Free()
    return _groups[dp]


def address(a):
    return a.__array_interface__["data"][0]


def owner(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


class Observer:
    """What a criterion watches in a Run: attach(run) once the synchroniser exists, then
    after_step(run, step) after each step."""

    def attach(self, run):
        pass

    def after_step(self, run, step):
        pass


class Run:
    """One short training run through minipar.train's own step loop: the losses of its steps,
    then its model (grads and params); with a synchroniser, exposed_seconds after each
    finish() and how long that finish() took."""

    def __init__(self, make_sync=None, g=None, micro_batches=1, steps=2, n_embd=16, freeze=(),
                 observer=None, dtype="float64"):
        args = flags(micro_batches, steps, n_embd, dtype)
        self.model = model = new_model(n_embd, freeze, dtype)
        opt = train.build_optimizer(model, args)
        sampler = data.Sampler(tokens(), 16, BATCH, SEED)
        self.sync = make_sync(model.parameters(), g) if make_sync is not None else None
        self.exposed, self.finish_seconds = [], []
        observer = observer or Observer()
        if self.sync is not None:
            observer.attach(self)
            self.time_finish()
        rows = (0, BATCH) if g is None else (g.rank * BATCH // g.size, (g.rank + 1) * BATCH // g.size)
        session = train.Session(args, model, opt, sampler, sync=self.sync, rows=rows, dp_group=g)
        self.losses = []
        for step, row in enumerate(train.train_steps(session, 0, steps)):
            self.losses.append(row["loss"])
            observer.after_step(self, step)

    def time_finish(self):
        sync, finish = self.sync, self.sync.finish

        def timed():
            t0 = time.perf_counter()
            result = finish()
            self.finish_seconds.append(time.perf_counter() - t0)
            self.exposed.append(getattr(sync, "exposed_seconds", None))
            return result
        sync.finish = timed


def naive(student):
    return lambda params, g: student.DataParallelNaive(params, g)


def bucketed(student, bucket_mb):
    return lambda params, g: student.DataParallelBucketed(params, g, bucket_mb)


def maker(student, mode, bucket_mb):
    return naive(student) if mode == "naive" else bucketed(student, bucket_mb)


def kept(a):
    """An array as it is now (a copy: the buffers change later), or the odd value itself."""
    return np.array(a, copy=True) if isinstance(a, np.ndarray) else a


def record_run(out, k, run):
    """What the grader compares with its twin: losses, every .grad and parameter after the
    last step, and per step exposed_seconds and finish()'s own duration."""
    out.put(key(k, "losses"), list(run.losses))
    out.put(key(k, "grads"), {name: kept(p.grad) for name, p in run.model.params.items()})
    out.put(key(k, "params"), {name: kept(p.data) for name, p in run.model.params.items()})
    out.put(key(k, "exposed"), list(run.exposed))
    out.put(key(k, "finish seconds"), list(run.finish_seconds))


# --- the observers --------------------------------------------------------------------------

class Addresses(Observer):
    """After each step: where every trainable gradient lives in memory (address, bytes, and
    the array that owns the memory); and the set_grad_buffer calls from the start of
    zero_grad to the end of start_step, each with the address of its buffer."""

    def __init__(self):
        self.seen = []                      # per step: {name: [address, nbytes, id of owner]} or a type name
        self.calls = []                     # per step: [[name, address of buf], ...]
        self.armed = False

    def attach(self, run):
        sync, zero_grad, start_step = run.sync, run.sync.zero_grad, run.sync.start_step

        def zero():
            self.calls.append([])
            self.armed = True
            return zero_grad()

        def start():
            try:
                return start_step()
            finally:
                self.armed = False
        sync.zero_grad, sync.start_step = zero, start

    def set_grad_buffer_seen(self, p, buf):
        if self.armed and self.calls:
            self.calls[-1].append([str(p.name), address(buf) if isinstance(buf, np.ndarray) else None])

    def after_step(self, run, step):
        seen = {}
        for p in trainable(run.model):
            a = p.grad
            seen[p.name] = [address(a), int(a.nbytes), id(owner(a))] if isinstance(a, np.ndarray) \
                else type(a).__name__
        self.seen.append(seen)


def watching_set_grad_buffer(observer):
    """Tensor.set_grad_buffer reports to the observer; -> a function that undoes it."""
    saved = tensor.Tensor.set_grad_buffer

    def set_grad_buffer(self, buf):
        observer.set_grad_buffer_seen(self, buf)
        return saved(self, buf)

    tensor.Tensor.set_grad_buffer = set_grad_buffer

    def undo():
        tensor.Tensor.set_grad_buffer = saved
    return undo


class Ledger(Observer):
    """The all-reduces a synchroniser makes in each step, from start_step to finish's return,
    read from minipar's ledger (comm.traffic): [calls, bytes sent] per step."""

    def __init__(self):
        self.steps = []

    def attach(self, run):
        sync = run.sync
        start, finish = sync.start_step, sync.finish

        def counted_start():
            self.before = comm.traffic().get("all_reduce", {"calls": 0, "bytes_sent": 0})
            return start()

        def counted_finish():
            result = finish()
            now = comm.traffic().get("all_reduce", {"calls": 0, "bytes_sent": 0})
            self.steps.append([now["calls"] - self.before["calls"], now["bytes_sent"] - self.before["bytes_sent"]])
            return result

        sync.start_step, sync.finish = counted_start, counted_finish


class Watch(Observer):
    """Events of a synchroniser: every comm.all_reduce_async and comm.all_reduce it makes, the
    gradients that arrive (a hook registered after the student's own), and the backward
    passes around them."""

    def __init__(self):
        self.backwards = 0                  # backward passes begun in this step
        self.inside = False                 # in a backward now?
        self.in_finish = False              # in finish() now?
        self.arrived = []                   # parameter indices, in arrival order, this backward
        self.starts = []                    # one dict per all_reduce_async of the step
        self.blocking = []
        self.open = False                   # between start_step and finish's return
        self.steps = []                     # per step: {arrived (last backward), starts, blocking, backwards}

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
            self.inside, self.in_finish = False, True
            try:
                result = finish()
            finally:
                self.in_finish = False
            self.steps.append({"arrived": list(self.arrived), "starts": self.starts, "blocking": self.blocking,
                               "backwards": self.backwards})
            self.open = False
            return result

        sync.start_step, sync.finish = start_step, finished

    def members(self, x):
        return [i for i, p in enumerate(self.params) if isinstance(p.grad, np.ndarray) and np.shares_memory(x, p.grad)]

    def on_start(self, x, out, blocking=False):
        if not self.open:
            return None
        in_place = isinstance(out, np.ndarray) and address(out) == address(x) and out.nbytes == x.nbytes
        event = {"backward": self.backwards, "inside": self.inside, "in_finish": self.in_finish,
                 "arrived": len(self.arrived), "members": self.members(x), "nbytes": int(x.nbytes),
                 "dtype": str(x.dtype), "in_place": bool(in_place), "tests": 0}
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
        event = watch.on_start(np.asarray(x), out)
        return Pushed(saved[0](g, x, op, out=out), event, watch)

    def all_reduce(g, x, op="sum", *, out=None):
        watch.on_start(np.asarray(x), out, blocking=True)
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


# --- the cases (the grader reads them too) ----------------------------------------------------

# naive: (dp, micro-batches, dtype)
NAIVE = [(dp, m, "float64") for dp in (2, 4) for m in (1, 2, 4)] + [(2, 2, "float32"), (4, 4, "float32")]
# bucketed: (dp, bucket_mb, micro-batches, dtype)
BUCKETED = [(dp, mb, m, "float64") for dp in (2, 4) for mb in BUCKET_CASES
            for m in ((1, 2, 4) if dp == 2 else (1, 4))] + \
           [(2, 1e3, 2, "float32"), (4, 0.004, 1, "float32"), (4, EXACT_32, 4, "float32")]
# bytes: (mode, bucket_mb, n_embd, micro-batches, dtype). C=32 float64 holds 171,776 B in one
# bucket (direct exchange, 2(p-1)/p n); at C=16 every bucket is <= 64 KiB (recursive
# doubling, log2(p) n). 0.0272 MiB cuts C=16 into wte and the rest. C=32 float32: 85,888 B.
BYTES = [("naive", None, 16, 4, "float64"), ("bucketed", 1e3, 32, 4, "float64"),
         ("bucketed", 0.0272, 16, 4, "float64"), ("bucketed", 1e-9, 16, 4, "float64"),
         ("bucketed", 0.004, 16, 1, "float64"), ("bucketed", 1e3, 32, 2, "float32"),
         ("bucketed", EXACT_32, 16, 4, "float32"), ("naive", None, 16, 2, "float32")]
# events, at dp = 4: (mode, bucket_mb, micro-batches, dtype, n_embd). At C=16, wte (32 KiB, the
# walk's last gradient) closes the last bucket of every limit below the whole model; at C=32,
# 0.08 MiB (83,886 B) makes 2 buckets, the last (wpe .. wte, 70,144 B) below the limit
EVENTS = [("bucketed", 0.004, 1, "float64", 16), ("bucketed", 0.004, 2, "float64", 16),
          ("bucketed", EXACT_64, 1, "float64", 16), ("bucketed", EXACT_32, 2, "float32", 16),
          ("naive", None, 2, "float64", 16), ("bucketed", 0.08, 2, "float64", 32)]
# frozen wpe, tied wte, dp = 4, micro-batches 2: (mode, bucket_mb)
FROZEN = [("bucketed", 1e3), ("bucketed", 0.004), ("bucketed", 1e-9), ("naive", None)]
FREEZE = ("wpe.weight",)


def mb_text(bucket_mb):
    return f"{bucket_mb:.10g}" + (f" = {round(bucket_mb * MiB)}/2**20" if bucket_mb in (EXACT_64, EXACT_32) else "")


# --- what the child runs ----------------------------------------------------------------------

def buffers(student, out):
    """A group of one rank: the bucketed synchroniser's gradients after each step, the
    set_grad_buffer calls, and the run against the twin (3 steps, micro-batches 2)."""
    g = group(1)
    for bucket_mb, label in [*BUCKET_CASES.items(), (EXACT_32, "2 buckets, float32")]:
        dtype = "float32" if bucket_mb == EXACT_32 else "float64"
        out.case(f"{model_text(16, dtype)}, bucketed, a group of 1 rank (world rank {MPI.COMM_WORLD.Get_rank()}), "
                 f"bucket_mb={mb_text(bucket_mb)} ({label}), micro-batches 2, 3 steps")
        seen = Addresses()
        undo = watching_set_grad_buffer(seen)
        try:
            run = Run(bucketed(student, bucket_mb), g, micro_batches=2, steps=3, observer=seen, dtype=dtype)
        finally:
            undo()
        k = key("buffers", bucket_mb)
        record_run(out, k, run)
        out.put(key(k, "addresses"), seen.seen)
        out.put(key(k, "set_grad_buffer"), seen.calls)


def naive_runs(student, out):
    for dp, m, dtype in NAIVE:
        g = group(dp)
        out.case(f"{model_text(16, dtype)}, naive, dp={dp} rank {g.rank}, micro-batches {m}")
        record_run(out, key("naive", dp, m, dtype), Run(naive(student), g, micro_batches=m, dtype=dtype))


def bucketed_runs(student, out):
    for dp, bucket_mb, m, dtype in BUCKETED:
        g = group(dp)
        out.case(f"{model_text(16, dtype)}, bucketed, dp={dp} rank {g.rank}, bucket_mb={mb_text(bucket_mb)}, "
                 f"micro-batches {m}")
        record_run(out, key("bucketed", dp, bucket_mb, m, dtype),
                   Run(bucketed(student, bucket_mb), g, micro_batches=m, dtype=dtype))


def bytes_runs(student, out):
    """Per step: the all-reduces in the ledger (calls, bytes sent), from start_step to the
    end of finish."""
    for dp in (2, 4):
        g = group(dp)
        for mode, bucket_mb, n_embd, m, dtype in BYTES:
            out.case(f"{model_text(n_embd, dtype)}, {mode}" + (f", bucket_mb={mb_text(bucket_mb)}" if bucket_mb else "")
                     + f", dp={dp} rank {g.rank}, micro-batches {m}, counting the ledger's all-reduces")
            ledger = Ledger()
            run = Run(maker(student, mode, bucket_mb), g, micro_batches=m, n_embd=n_embd, observer=ledger, dtype=dtype)
            k = key("bytes", dp, mode, bucket_mb, n_embd, m, dtype)
            out.put(key(k, "steps"), ledger.steps)
            out.put(key(k, "exposed"), list(run.exposed))
            out.put(key(k, "finish seconds"), list(run.finish_seconds))


def events(student, out):
    """dp = 4: every all-reduce of each step (async or blocking) with its members, bytes,
    dtype, whether it is in place, the backward it started in, how many gradients had arrived,
    and the test() calls on it during backward; and the order the gradients arrived in."""
    g = group(4)
    for mode, bucket_mb, m, dtype, n_embd in EVENTS:
        out.case(f"{model_text(n_embd, dtype)}, {mode}" + (f", bucket_mb={mb_text(bucket_mb)}" if bucket_mb else "")
                 + f", dp=4 rank {g.rank}, micro-batches {m}, watching every all-reduce")
        watch = Watch()
        undo = watching(watch)
        try:
            Run(maker(student, mode, bucket_mb), g, micro_batches=m, n_embd=n_embd, observer=watch, dtype=dtype)
        finally:
            undo()
        out.put(key("events", mode, bucket_mb, m, dtype, n_embd), watch.steps)


def frozen(student, out):
    g = group(4)
    for mode, bucket_mb in FROZEN:
        out.case(f"{model_text()}, {mode}" + (f", bucket_mb={bucket_mb:g}" if bucket_mb else "")
                 + f", wpe.weight frozen, wte.weight tied, dp=4 rank {g.rank}, micro-batches 2")
        record_run(out, key("frozen", mode, bucket_mb), Run(maker(student, mode, bucket_mb), g, micro_batches=2,
                                                             freeze=FREEZE))


# --- the seam ---------------------------------------------------------------------------------

def install(student):
    """The trainer's data-parallel synchroniser becomes the student's; finish() counted."""
    calls = [0]
    plan = data_parallel.bucket_members

    def make(params, group, mode="bucketed", bucket_mb=1.0):
        if mode == "naive":
            sync = student.DataParallelNaive(params, group)
        elif mode == "bucketed":
            sync = student.DataParallelBucketed(params, group, bucket_mb)
            if not hasattr(sync, "buckets"):        # the start-up line and summary count them
                sync.buckets = plan([p.data.nbytes for p in params if p.requires_grad], bucket_mb)
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
