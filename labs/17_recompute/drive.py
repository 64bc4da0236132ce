"""Lab 17, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's checkpoint, and the seam. Nothing here judges; lab.py does, in the grader.

Every case is a function of `ckpt`, the checkpoint it runs its blocks through: in the child
the student's `checkpoint`, in the grader the plain call `run(x)` (the oracle: the same blocks,
the same inputs, drawn from the same seeds, without recomputation). A case builds its blocks
(an MLP of odd widths, blocks of a tiny minipar GPT, a block without parameters), runs
forward and backward, and returns what came out: the output, the inputs' gradients, every
parameter's gradient, the inputs and the output gradients as they are afterwards, and, for
every block, whether a graph was being recorded each time it ran.
"""
import gc
import os
import tracemalloc
import zlib

import numpy as np

from labs.framework import extra_cases
from labs.results import key
from minipar.autograd import attention, ops, recompute
from minipar.autograd.tensor import Tensor, is_grad_enabled, no_grad
from minipar.model.contract import whole_attention
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel import parallelize
from minipar.parallel.parallelize import parts

HERE = os.path.dirname(os.path.abspath(__file__))
TEACHER_SEED = int(extra_cases(HERE).get("seed", 0))
# minipar's own checkpoint: reached from the student's file, each raises (labs/child.py)
OWN = ["minipar.autograd.recompute:Recompute.forward", "minipar.autograd.recompute:Recompute.backward",
       "minipar.autograd.recompute:block", "minipar.autograd.recompute:runner"]

CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16)
B, T = 3, 5                     # T below the block size, odd: nothing divides
MLP_C, MLP_H = 7, 11            # the MLP's widths


def rng_for(*k):
    """A case's random numbers; a teacher's "seed" ($MINIPAR_LAB_EXTRA/17_recompute/cases.json)
    draws others."""
    parts = [zlib.crc32(p.encode()) if isinstance(p, str) else int(p) for p in k]
    return np.random.default_rng([17, *parts] + ([TEACHER_SEED] if TEACHER_SEED else []))


def plain(run, x):
    """The oracle's "checkpoint": the block itself, its graph recorded as usual."""
    return run(x)


class Case:
    """What one case hands back: arrays and flags by name, and the blocks' runs."""

    def __init__(self):
        self.params = {}                # name -> Tensor, every parameter of the case's blocks
        self.runs = {}                  # block label -> [is_grad_enabled() at each call]
        self.out = {}

    def counted(self, label, fn):
        """fn, noting whether a graph was being recorded each time it runs."""
        calls = self.runs.setdefault(label, [])

        def run(t):
            calls.append(bool(is_grad_enabled()))
            return fn(t)
        return run

    def mlp(self, seed, C=MLP_C, H=MLP_H):
        """x -> gelu(x W1 + b1) W2 + b2, of widths C -> H -> C."""
        r = rng_for(1, seed)
        w = {f"mlp{seed}.w1": r.standard_normal((C, H)) / np.sqrt(C), f"mlp{seed}.b1": r.standard_normal(H),
             f"mlp{seed}.w2": r.standard_normal((H, C)) / np.sqrt(H), f"mlp{seed}.b2": r.standard_normal(C)}
        p = {k: Tensor(v, requires_grad=True, name=k) for k, v in w.items()}
        self.params.update(p)
        w1, b1, w2, b2 = p.values()
        return self.counted(f"mlp{seed}", lambda t: ops.linear(ops.gelu(ops.linear(t, w1, b1)), w2, b2))

    def gpt(self):
        """The tiny GPT whose blocks the cases run: block(i) -> its run."""
        model = GPT(CFG, seed=5 + TEACHER_SEED, dtype=np.float64)
        self.params.update({n: p for n, p in model.params.items() if n.startswith("h.")})
        return lambda i: self.counted(f"block{i}", lambda t: model.block(i, t))

    def x(self, name, shape, requires_grad=True):
        a = rng_for(2, name, *shape).standard_normal(shape)
        t = Tensor(a, requires_grad=requires_grad, name=name)
        self.out[f"{name} before"] = a.copy()
        self.inputs = getattr(self, "inputs", []) + [t]
        return t

    def backward(self, y, name="g"):
        g = rng_for(3, name, *y.shape).standard_normal(y.shape)
        self.out[f"{name} before"] = g.copy()
        y.backward(g)
        self.out[f"{name} after"] = g
        return g

    def finish(self, y=None):
        """The record: the output, each input's gradient and value afterwards, every
        parameter's gradient, the runs."""
        if y is not None:
            self.out["y"] = y.data
            self.out["y requires grad"] = bool(y.requires_grad)
        for t in getattr(self, "inputs", []):
            self.out[f"{t.name} grad"] = t.grad
            self.out[f"{t.name} after"] = t.data
        self.out["params"] = {n: p.grad for n, p in self.params.items()}
        self.out["runs"] = {k: list(v) for k, v in self.runs.items()}
        return self.out


# --- the cases: name -> (what it is, the function of ckpt) ------------------------------------

def one_mlp(ckpt):
    c = Case()
    run, x = c.mlp(0), c.x("x", (B, T, MLP_C))
    y = ckpt(run, x)
    c.backward(y)
    return c.finish(y)


def one_gpt_block(ckpt):
    c = Case()
    block, x = c.gpt(), c.x("x", (B, T, CFG.n_embd))
    y = ckpt(block(0), x)
    c.backward(y)
    return c.finish(y)


def no_parameters(ckpt):
    c = Case()
    run = c.counted("gelu(x) x", lambda t: ops.mul(ops.gelu(t), t))
    x = c.x("x", (B, T, MLP_C))
    y = ckpt(run, x)
    c.backward(y)
    return c.finish(y)


def empty_batch(ckpt):
    c = Case()
    run, x = c.mlp(0), c.x("x", (0, T, MLP_C))
    y = ckpt(run, x)
    c.backward(y)
    return c.finish(y)


def under_no_grad(ckpt):
    c = Case()
    run, x = c.mlp(0), c.x("x", (B, T, MLP_C))
    with no_grad():
        y = ckpt(run, x)
    return c.finish(y)


def output_used_twice(ckpt):
    c = Case()
    run, x = c.mlp(0), c.x("x", (B, T, MLP_C))
    y = ckpt(run, x)
    a = rng_for(4).standard_normal(y.shape)
    z = ops.add(ops.mul(y, y), ops.mul(y, a))               # y reaches the loss by two paths
    c.backward(z)
    return c.finish(z)


def block_used_twice(ckpt):
    c = Case()
    block, x = c.gpt(), c.x("x", (B, T, CFG.n_embd))
    b0 = block(0)
    y = ckpt(b0, ckpt(b0, x))                               # the same parameters, two inputs
    c.backward(y)
    return c.finish(y)


def two_graphs_in_flight(ckpt):
    c = Case()
    run = c.mlp(0)
    x1, x2 = c.x("x1", (B, T, MLP_C)), c.x("x2", (2, T, MLP_C))
    y1, y2 = ckpt(run, x1), ckpt(run, x2)                   # two micro-batches, as a pipeline holds them
    c.backward(y2, "g2")                                    # the later one first
    c.backward(y1, "g1")
    c.out["y1"], c.out["y2"] = y1.data, y2.data
    return c.finish()


def chain(ckpt):
    c = Case()
    block, x = c.gpt(), c.x("x", (B, T, CFG.n_embd))
    y = x
    for i in range(CFG.n_layer):
        y = ckpt(block(i), y)
    c.backward(y)
    return c.finish(y)


def last_of_a_chain(ckpt):
    c = Case()
    block, x = c.gpt(), c.x("x", (B, T, CFG.n_embd))
    y = block(1)(block(0)(x))                               # two plain blocks
    y = ckpt(block(2), y)                                   # the last one checkpointed
    c.backward(y)
    return c.finish(y)


def data_input(ckpt):
    c = Case()
    block, x = c.gpt(), c.x("x", (B, T, CFG.n_embd), requires_grad=False)
    y = ckpt(block(1), ckpt(block(0), x))                   # the first input: data, no gradient
    c.backward(y)
    return c.finish(y)


def nested(ckpt):
    c = Case()
    block, x = c.gpt(), c.x("x", (B, T, CFG.n_embd))
    b0, b1, b2 = block(0), block(1), block(2)
    outer = c.counted("outer", lambda t: ckpt(b1, b0(t)))  # a checkpoint inside a checkpoint
    y = b2(ckpt(outer, x))
    c.backward(y)
    return c.finish(y)


def accumulated(ckpt):
    c = Case()
    run = c.mlp(0)
    for n, p in c.params.items():                           # a micro-batch before left its gradient
        p.grad = rng_for(5, n).standard_normal(p.shape)
    x1, x2 = c.x("x1", (B, T, MLP_C)), c.x("x2", (1, T, MLP_C))
    c.backward(ckpt(run, x1), "g1")                         # then two more micro-batches
    c.backward(ckpt(run, x2), "g2")
    return c.finish()


ONE = {"one_mlp": ("an MLP 7 -> 11 -> 7 on x (3, 5, 7)", one_mlp),
       "one_gpt_block": ("block 0 of a GPT (C=16, 2 heads) on x (3, 5, 16)", one_gpt_block),
       "no_parameters": ("a block without parameters, gelu(x) * x", no_parameters),
       "empty_batch": ("the MLP on an empty batch, x (0, 5, 7)", empty_batch),
       "under_no_grad": ("the MLP under no_grad() (evaluation: no graph, no gradient)", under_no_grad)}
MANY = {"output_used_twice": ("the MLP's output used twice, z = y*y + y*a", output_used_twice),
        "block_used_twice": ("GPT block 0 used twice, y = b0(b0(x)), both checkpointed", block_used_twice),
        "two_graphs_in_flight": ("two micro-batches through the MLP, the later one's backward first",
                                 two_graphs_in_flight),
        "chain": ("a chain of the GPT's 3 blocks, every one checkpointed", chain),
        "last_of_a_chain": ("a chain of 3 GPT blocks, only the last checkpointed", last_of_a_chain),
        "data_input": ("2 checkpointed GPT blocks on data x (no requires_grad): the first block's "
                       "parameters still need their gradients", data_input),
        "nested": ("a checkpoint inside a checkpoint: outer(x) = ckpt(b1, b0(x)), then b2", nested),
        "accumulated": ("the MLP's parameters holding a gradient already, then two micro-batches",
                        accumulated)}
CASES = {**ONE, **MANY}


def run_cases(student, out, cases):
    for name, (what, fn) in cases.items():
        out.case(f"{name}: {what}")
        out.put(key("case", name), fn(student.checkpoint))


def gradients(student, out):
    """Every case of ONE, then of MANY (two criteria judge this one record)."""
    run_cases(student, out, ONE)
    run_cases(student, out, MANY)


# --- memory: what the graph keeps between forward and backward ------------------------------

MEM_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)
MEM_B, MEM_T = 4, 16


def held_by_chain(ckpt):
    """Bytes allocated during the forward of a chain of MEM_CFG's blocks (each through ckpt)
    and still alive before its backward (tracemalloc: every array and object, wherever it is
    kept), and the graph's Tensor.saved_bytes."""
    model = GPT(MEM_CFG, seed=3, dtype=np.float64)
    x = Tensor(rng_for(6).standard_normal((MEM_B, MEM_T, MEM_CFG.n_embd)), requires_grad=True)
    runs = [lambda t, i=i: model.block(i, t) for i in range(MEM_CFG.n_layer)]
    model.block(0, x).backward(np.ones(x.shape))            # warm: what minipar builds once (caches)
    x.grad = None
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        y = x
        for run in runs:
            y = ckpt(run, y)
        gc.collect()                                        # what is garbage is not kept
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    saved = y.saved_bytes()
    y.backward(np.ones(y.shape))
    return held, saved


def gpt_loss(mode, cfg=MEM_CFG, rows=MEM_B):
    """A GPT of cfg built for --recompute `mode` (Parts.run_block and Parts.attention, as the
    trainer builds it), its loss on rows sequences of cfg.block_size tokens."""
    model = GPT(cfg, seed=3, dtype=np.float64, parts=parts(mode))
    r = rng_for(7)
    idx = r.integers(0, cfg.vocab_size, (rows, cfg.block_size))
    targets = r.integers(0, cfg.vocab_size, (rows, cfg.block_size))
    return model(idx, targets)


def memory(student, out):
    """The bytes a chain keeps (tracemalloc) and a GPT's saved_bytes with the seam."""
    out.case(f"a chain of {MEM_CFG.n_layer} GPT blocks (C={MEM_CFG.n_embd}) through your checkpoint, x "
             f"({MEM_B}, {MEM_T}, {MEM_CFG.n_embd}): bytes alive between forward and backward")
    held, saved = held_by_chain(student.checkpoint)
    out.put("chain held", int(held))
    out.put("chain saved", int(saved))
    install(student)
    for mode in ("full", "selective"):
        out.case(f"a GPT (L={MEM_CFG.n_layer}, C={MEM_CFG.n_embd}, 2 heads, T={MEM_T}) built for --recompute "
                 f"{mode}, your checkpoint at the seam, {MEM_B} sequences: the loss graph's saved_bytes()")
        loss = gpt_loss(mode)
        out.put(key("gpt saved", mode), int(loss.saved_bytes()))
        loss.backward()


# --- one more forward: the runs of each block, and the FLOPs -----------------------------------

def count_flops():
    """Wrap the forwards of minipar's matrix products so each adds 2*M*N*K to the count
    (tests/test_recompute.py counts the same way): -> (count, undo)."""
    count = [0]
    undo = []

    def wrap(owner, name, flops):
        orig = getattr(owner, name)

        def counted(*args, **kw):
            y = orig(*args, **kw)
            count[0] += flops(y, *args)
            return y
        setattr(owner, name, counted)
        undo.append((owner, name, orig))

    wrap(ops.Linear, "forward", lambda y, self, x, w, *r: 2 * y.size * w.shape[0])
    wrap(ops.MatMul, "forward", lambda y, self, a, b: 2 * y.size * a.shape[-1])
    wrap(attention, "_probs_t", lambda y, q, k, T: 2 * y.size * q.shape[-1])
    wrap(ops.CausalSelfAttention, "forward", lambda y, self, qkv, nh, *r: 2 * y.size * y.shape[1])

    def restore():
        for owner, name, orig in undo:
            setattr(owner, name, orig)
    return count, restore


FLOP_CFG = GPTConfig(vocab_size=64, block_size=8, n_layer=3, n_head=2, n_embd=16)
FLOP_B = 2


def flops(student, out):
    """Each case's runs of each block, and a GPT's matrix-product FLOPs with the seam."""
    for name, (what, fn) in CASES.items():
        out.case(f"{name}: {what}, counting each block's runs")
        out.put(key("runs", name), fn(student.checkpoint)["runs"])
    calls = install(student)
    count, restore = count_flops()
    try:
        for mode in ("none", "full", "selective"):
            out.case(f"a GPT (L={FLOP_CFG.n_layer}, C={FLOP_CFG.n_embd}, T={FLOP_CFG.block_size}) built for "
                     f"--recompute {mode}, your checkpoint at the seam: the FLOPs of one forward and backward")
            count[0] = 0
            before = calls()
            gpt_loss(mode, FLOP_CFG, FLOP_B).backward()
            out.put(key("flops", mode), int(count[0]))
            out.put(key("seam calls", mode), int(calls() - before))
    finally:
        restore()


def costs(student, out):
    """memory, then flops (two criteria judge this one record)."""
    memory(student, out)
    flops(student, out)


# --- the seam ---------------------------------------------------------------------------------

def replayed(run):
    """run, telling ZeRO-3 (recompute.replaying) when it runs again inside backward: the
    parameters it gathers then stay for the backward that follows (zero/stage3.py)."""
    def again(t):
        if not is_grad_enabled():
            return run(t)
        recompute._replaying += 1
        try:
            return run(t)
        finally:
            recompute._replaying -= 1
    return again


def install(student):
    """--recompute full: every block the model runs (recompute.runner's run_block calls
    recompute.block) goes through the student's checkpoint; --recompute selective: the
    attention core (Parts.attention, chosen by parallelize.parts) is the student's checkpoint
    of minipar's whole attention. -> calls()."""
    calls = [0]

    def block(run, x, mode):
        if mode != "full":
            return run(x)
        calls[0] += 1
        return student.checkpoint(replayed(run), x)

    def checkpointed_attention(qkv, n_head, n_kv_head=None):
        calls[0] += 1
        return student.checkpoint(lambda t: whole_attention(t, n_head, n_kv_head), qkv)

    recompute.block = block
    parallelize.recomputed_attention = checkpointed_attention
    return lambda: calls[0]
