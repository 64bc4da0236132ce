"""Backward in two passes, B then W, for the zero-bubble pipeline schedules (Qi et al. 2024,
"Zero Bubble Pipeline Parallelism", arXiv:2401.10241, section 2).

From its output gradient g a layer's backward computes two things:
    B   the gradient of its input,   dL/dx = g W^T   the critical path: the layer below,
                                                     and the previous pipeline stage, wait for it
    W   the gradient of its weights, dL/dW = x^T g   only the optimizer step needs it
A zero-bubble schedule runs W later, in time the pipeline would otherwise leave idle:

    pending = backward_b(out, g, inputs=[x])   # B: every activation's gradient, x.grad (the
                                               #    stage's input) set; no parameter touched
    ...                                        # other micro-batches' F and B
    pending.run()                              # W: every parameter's gradient (+= and hooks)

Which gradients are B's. A tensor *varies* (with the micro-batch) if it is one of `inputs`,
or if the op that made it took the micro-batch's data (an ndarray argument beside its tensors:
token ids, targets; Function.apply notes it as ctx.takes_data) or a tensor that varies. What
does not vary is a parameter, or computed from parameters alone (a transposed weight, sequence
parallelism's identity on a LayerNorm weight). B is the backward of everything that varies;
W is every gradient that flows into the rest.

How. B walks the graph backwards as tensor.backward does, but asks each node only for the
gradients of its varying inputs (needs_input_grad masked). A node with a non-varying input
too is remembered with its output gradient g, and keeps its saved arrays for W. W then walks
the remembered nodes and the non-varying nodes together, in the same order (latest created
first), asks each remembered node for the gradients of its other inputs, and passes them to
the parameters, which finish as in tensor.backward: += into .grad, then their hooks (data
parallelism's buckets start during W). A block under full recomputation (recompute.Recompute)
splits too: its backward, running inside B, runs B of the block's rebuilt graph and leaves
that graph's W here (defer).

Exact. Every gradient comes from the same arrays through the same code as in one pass, and a
parameter's pieces are added in the same order, so in float64 B then W leaves every .grad
equal, bit for bit, to tensor.backward's (tests/test_backward_split.py). An op that ignores
needs_input_grad computes the masked gradients anyway and they are dropped; the matmuls
(Linear, MatMul) and LayerNorm honour it, so the work itself is split.
"""
from __future__ import annotations

import numpy as np

from minipar.autograd import tensor
from minipar.autograd.tensor import Tensor

_RUNNING = []          # the PendingW of each B pass in progress (innermost last)


class PendingW:
    """What B left for W: remembered nodes with their output gradients (and the W of
    recomputed blocks), by creation number. run() once."""

    def __init__(self):
        self.nodes = []        # (seq, tensor, g): W asks tensor._ctx for its other inputs' gradients
        self.inner = []        # (seq, PendingW) of the recomputed blocks met in B

    def run(self):
        """W: the parameters' gradients, accumulated into .grad; their hooks fire."""
        param_side, pending = _param_side(self.nodes)
        work = [(seq, 0, t, g) for seq, t, g in self.nodes] + [(seq, 1, w, None) for seq, w in self.inner] \
            + [(t._ctx.seq, 2, t, None) for t in param_side]
        grads = {}
        for _, kind, t, g in sorted(work, key=lambda w: -w[0]):      # latest created first
            if kind == 1:
                t.run()                                               # a recomputed block's W
                continue
            ctx = t._ctx
            if kind == 2:                                             # e.g. a transposed weight
                g = grads.pop(id(t), None)
                g = np.zeros_like(t.data) if g is None else g
            for p, pg, n in zip(ctx.parents, _grads_of(ctx, g), ctx.needs_input_grad):
                if not n:                                             # B's input, or no gradient
                    continue
                if pg is not None:
                    prev = grads.get(id(p))
                    grads[id(p)] = pg if prev is None else prev + pg
                pending[id(p)] -= 1
                if pending[id(p)] == 0 and p._ctx is None:
                    tensor._finish_leaf(p, grads.pop(id(p), None))
            ctx.saved = ()
            t._ctx = None
        self.nodes, self.inner = [], []


def running() -> bool:
    """Is a B pass in progress (recompute.Recompute asks, inside its backward)?"""
    return bool(_RUNNING)


def defer(seq: int, pending: PendingW):
    """Leave a recomputed block's W (its rebuilt graph's) to the W of the B pass running now,
    at the place of the node numbered seq."""
    _RUNNING[-1].inner.append((seq, pending))


def backward_b(root: Tensor, grad: np.ndarray, inputs=()) -> PendingW:
    """B: back-propagate grad from root through everything that varies with the micro-batch;
    each leaf of `inputs` gets its .grad. Returns what W needs (PendingW.run)."""
    order, pending = tensor._graph(root)
    varies = {id(x) for x in inputs}
    for t in order:                                                   # creation order: inputs first
        ctx = t._ctx
        if ctx.takes_data or any(p is not None and id(p) in varies for p in ctx.parents):
            varies.add(id(t))
    out, grads = PendingW(), {id(root): np.asarray(grad, dtype=root.data.dtype)}
    _RUNNING.append(out)
    try:
        for t in reversed(order):
            if id(t) not in varies:                                   # all of its backward is W's
                continue
            ctx = t._ctx
            g = grads.pop(id(t), None)
            g = np.zeros_like(t.data) if g is None else g
            full = ctx.needs_input_grad
            b = tuple(n and p is not None and id(p) in varies for n, p in zip(full, ctx.parents))
            w = tuple(n and not nb for n, nb in zip(full, b))
            if any(b):
                ctx.needs_input_grad = b
                for p, pg, nb in zip(ctx.parents, _grads_of(ctx, g), b):
                    if not nb:
                        continue
                    if pg is not None:
                        prev = grads.get(id(p))
                        grads[id(p)] = pg if prev is None else prev + pg
                    pending[id(p)] -= 1
                    if pending[id(p)] == 0 and p._ctx is None:        # one of `inputs`: done
                        tensor._finish_leaf(p, grads.pop(id(p), None))
            if any(w):
                ctx.needs_input_grad = w
                out.nodes.append((ctx.seq, t, g))
            else:
                ctx.saved = ()
                t._ctx = None
    finally:
        _RUNNING.pop()
    return out


def _grads_of(ctx, g) -> tuple:
    """ctx.backward(g) as a tuple, checked against the node's inputs (as tensor.backward)."""
    in_grads = ctx.backward(g)
    in_grads = in_grads if isinstance(in_grads, tuple) else (in_grads,)
    if len(in_grads) != len(ctx.parents):
        raise RuntimeError(f"{type(ctx).__name__}.backward returned {len(in_grads)} grads "
                           f"for {len(ctx.parents)} inputs")
    return in_grads


def _param_side(nodes) -> tuple[list, dict]:
    """The non-varying nodes the remembered ones lead to (a transposed weight ...), and for
    every tensor W feeds, how many of W's edges feed it (tensor._graph's count, for W)."""
    side, pending, seen = [], {}, set()
    stack = []
    for _, t, _ in nodes:
        ctx = t._ctx
        stack += [p for p, n in zip(ctx.parents, ctx.needs_input_grad) if n and p is not None]
        for p, n in zip(ctx.parents, ctx.needs_input_grad):
            if n and p is not None:
                pending[id(p)] = pending.get(id(p), 0) + 1
    while stack:
        t = stack.pop()
        if id(t) in seen or t._ctx is None:
            continue
        seen.add(id(t))
        side.append(t)
        for p in t._ctx.parents:
            if p is not None and p.requires_grad:
                pending[id(p)] = pending.get(id(p), 0) + 1
                stack.append(p)
    return side, pending
