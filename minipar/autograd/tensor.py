"""A small reverse-mode autograd engine on NumPy arrays.

A `Tensor` wraps an ndarray (`.data`) and, for leaves that require it, accumulates a
gradient (`.grad`, same shape). Every differentiable operation is a `Function` subclass
with a hand-written `forward` (NumPy in, NumPy out) and `backward` (output gradient in,
one gradient per input out). `Function.apply` runs forward and, unless `no_grad()` is
active, records the node so that `loss.backward()` can walk the graph.

backward() in four steps (micrograd's recipe, a topological order walked backwards, made
safe for several live graphs):
  1. collect the nodes reachable from the root (a walk with an explicit stack; the order of
     the walk is not used) and sort them by creation number: an op's inputs exist before
     its output, so creation order is topological (`_graph` says why not a DFS order);
  2. in the same walk, count for every tensor how many edges of *this* graph feed gradient
     into it;
  3. walk the sorted nodes backwards: each node gets its complete output gradient, calls its
     Function's backward, and hands the pieces to its inputs (summing when a tensor is
     used several times, e.g. tied embeddings);
  4. when a leaf's count reaches zero its gradient for this backward is complete: it is
     added into `leaf.grad` with `+=` (or written into the buffer given by
     `set_grad_buffer`) and the leaf's hooks fire (data-parallel buckets start their
     all-reduce there while backward goes on).
Intermediate gradients live in a dict local to the call, never on the tensors, so several
graphs (micro-batches in flight in a pipeline) can be alive and be differentiated
independently, in any order. A graph is freed after its backward.
"""
from __future__ import annotations

import contextlib

import numpy as np

from minipar import trace as _trace

_grad_enabled = True


@contextlib.contextmanager
def no_grad():
    """Run operations without recording a graph (evaluation, generation, optimizer steps)."""
    global _grad_enabled
    prev, _grad_enabled = _grad_enabled, False
    try:
        yield
    finally:
        _grad_enabled = prev


@contextlib.contextmanager
def enable_grad():
    """Record a graph even inside no_grad() (recompute.Recompute rebuilds a block in backward)."""
    global _grad_enabled
    prev, _grad_enabled = _grad_enabled, True
    try:
        yield
    finally:
        _grad_enabled = prev


def is_grad_enabled() -> bool:
    return _grad_enabled



class Tensor:
    """An ndarray with an optional gradient and a link to the Function that produced it."""

    __slots__ = ("data", "grad", "requires_grad", "name", "_overwrite_grad", "_ctx", "_hooks", "__weakref__")

    def __init__(self, data, requires_grad: bool = False, name: str | None = None):
        self.data = data if isinstance(data, np.ndarray) else np.asarray(data)
        self.grad = None                 # ndarray like data, accumulated with +=
        self._overwrite_grad = False     # set by set_grad_buffer: the next backward writes .grad
        self.requires_grad = requires_grad
        self.name = name
        self._ctx = None                 # the Function node that made this tensor (None: a leaf)
        self._hooks = []

    # --- plain properties -------------------------------------------------------------
    shape = property(lambda self: self.data.shape)
    dtype = property(lambda self: self.data.dtype)
    ndim = property(lambda self: self.data.ndim)
    size = property(lambda self: self.data.size)
    is_leaf = property(lambda self: self._ctx is None)

    def __repr__(self):
        nm = f" {self.name!r}" if self.name else ""
        return f"Tensor{nm}(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"

    def item(self) -> float:
        return self.data.item()

    def numpy(self) -> np.ndarray:
        return self.data

    def register_grad_hook(self, fn):
        """fn(tensor) runs once this leaf's gradient for the current backward is complete
        (after it has been added, or written by set_grad_buffer's rule, into .grad)."""
        if not self.is_leaf:
            raise ValueError("grad hooks are only supported on leaf tensors")
        self._hooks.append(fn)
        return fn

    def remove_grad_hook(self, fn):
        self._hooks.remove(fn)

    def set_grad_buffer(self, buf: np.ndarray):
        """Make the preallocated array `buf` this leaf's .grad, to be overwritten: the next
        backward that delivers a gradient here writes it into `buf` in place instead of
        adding to what `buf` holds; backwards after that accumulate with += as usual.
        A caller that keeps all gradients in one flat array (data-parallel buckets, ZeRO-1)
        points each .grad at its slice once per step, and needs no memset to zero it."""
        if buf.shape != self.shape:
            raise ValueError(f"grad buffer shape {buf.shape} != tensor shape {self.shape}")
        self.grad = buf
        self._overwrite_grad = True

    # --- operators: thin sugar over minipar.ops ---------------------------------------
    def __add__(self, other):
        from minipar.autograd import ops
        return ops.add(self, other)

    __radd__ = __add__

    def __mul__(self, other):
        from minipar.autograd import ops
        return ops.mul(self, other)

    __rmul__ = __mul__

    def __matmul__(self, other):
        from minipar.autograd import ops
        return ops.matmul(self, other)

    def reshape(self, *shape):
        from minipar.autograd import ops
        return ops.reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)

    def sum(self, axis=None, keepdims=False):
        from minipar.autograd import ops
        return ops.sum(self, axis, keepdims)

    def mean(self, axis=None, keepdims=False):
        from minipar.autograd import ops
        return ops.mean(self, axis, keepdims)

    # --- the graph ----------------------------------------------------------------------
    def backward(self, grad=None, retain_graph: bool = False):
        """Back-propagate from this tensor. `grad` defaults to 1 for a scalar."""
        if grad is None:
            if self.data.size != 1:
                raise ValueError(f"backward() without grad needs a scalar, got shape {self.shape}")
            grad = np.ones_like(self.data)
        grad = np.asarray(grad, dtype=self.data.dtype)
        if grad.shape != self.shape:
            raise ValueError(f"grad shape {grad.shape} != tensor shape {self.shape}")
        backward(self, grad, retain_graph=retain_graph)

    def saved_bytes(self) -> int:
        """Bytes of activations that this graph holds for its backward (parameters excluded)."""
        return saved_bytes(self)


def _graph(root: Tensor):
    """Nodes (non-leaf tensors) reachable from root in topological order, and, for every
    tensor that requires grad, the number of graph edges that feed gradient into it.

    The order is the order of creation (Function.apply numbers every node): an op's
    inputs always exist before its output, so creation order is topological, and walking
    it backwards finishes the parameters used last in forward first, as PyTorch does
    (data-parallel buckets rely on that). A depth-first order would not: it can visit a
    tensor used both directly and through a branch (x + f(x)) before the branch is done."""
    nodes, pending = [], {}
    seen = {id(root)}
    stack = [root]
    while stack:
        t = stack.pop()
        if t._ctx is None:
            continue
        nodes.append(t)
        for p in t._ctx.parents:
            if p is None or not p.requires_grad:
                continue
            pending[id(p)] = pending.get(id(p), 0) + 1
            if id(p) not in seen:
                seen.add(id(p))
                stack.append(p)
    nodes.sort(key=lambda t: t._ctx.seq)
    return nodes, pending


def backward(root: Tensor, grad: np.ndarray, retain_graph: bool = False):
    if root._ctx is None:
        if not root.requires_grad:
            raise RuntimeError("backward() on a tensor with no graph: it does not require grad, "
                               "or its graph was already freed by an earlier backward()")
        _finish_leaf(root, grad)                # a leaf was asked for backward directly
        return
    order, pending = _graph(root)
    grads = {id(root): grad}
    label = _trace.RECORDER.backward_labeler() if _trace.RECORDER is not None else None
    for t in reversed(order):
        g = grads.pop(id(t), None)
        ctx = t._ctx
        if label is not None:                   # --trace: a span per layer (trace.layer)
            label(ctx.seq)
        if g is None:                           # nothing flowed here (e.g. unused output)
            g = np.zeros_like(t.data)
        in_grads = ctx.backward(g)
        if not isinstance(in_grads, tuple):
            in_grads = (in_grads,)
        if len(in_grads) != len(ctx.parents):
            raise RuntimeError(f"{type(ctx).__name__}.backward returned {len(in_grads)} grads "
                               f"for {len(ctx.parents)} inputs")
        for p, pg in zip(ctx.parents, in_grads):
            if p is None or not p.requires_grad:
                continue
            if pg is not None:
                if pg.shape != p.data.shape:
                    raise RuntimeError(f"{type(ctx).__name__}.backward: grad shape {pg.shape} "
                                       f"!= input shape {p.data.shape}")
                prev = grads.get(id(p))
                # never add in place: pg may alias another tensor's gradient
                grads[id(p)] = pg if prev is None else prev + pg
            pending[id(p)] -= 1
            if pending[id(p)] == 0 and p._ctx is None:
                _finish_leaf(p, grads.pop(id(p), None))
        if not retain_graph:
            ctx.saved = ()
            t._ctx = None
    if label is not None:
        label(None)


def _finish_leaf(leaf: Tensor, g):
    if g is not None:
        if leaf.grad is None:
            leaf.grad = np.array(g, dtype=leaf.data.dtype, copy=True)  # own it: g may alias
        elif leaf._overwrite_grad:       # set_grad_buffer: write into the buffer, don't add
            np.copyto(leaf.grad, g)
        else:
            leaf.grad += g
        leaf._overwrite_grad = False
    for hook in leaf._hooks:
        hook(leaf)


def _owner(a: np.ndarray) -> np.ndarray:
    """The array that owns a view's memory (a reshape or transpose of x is x's memory)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def saved_bytes(root: Tensor) -> int:
    order, _ = _graph(root)
    params = {id(_owner(p.data)) for t in order for p in t._ctx.parents if p is not None and p._ctx is None}
    counted, total = set(), 0
    for t in order:
        for a in t._ctx.saved:
            if isinstance(a, np.ndarray):
                own = _owner(a)
                if id(own) not in counted and id(own) not in params:
                    counted.add(id(own))
                    total += own.nbytes
    return total


class Function:
    """One node of the graph. Subclasses write forward(self, *arrays) -> ndarray and
    backward(self, grad) -> one gradient (or None) per forward argument, in order.
    Non-Tensor arguments (ints, index arrays, flags) are passed through and get None."""

    # which inputs want a gradient: apply() sets it per node (backward_split narrows it); a
    # node made by hand, outside apply (labs/01_autograd), computes them all
    needs_input_grad = (True,) * 8

    def save(self, *arrays):
        """Keep what backward needs. Counted by Tensor.saved_bytes()."""
        self.saved = arrays

    @classmethod
    def apply(cls, *args, **kwargs) -> Tensor:
        ctx = cls()
        ctx.saved = ()
        raw = [a.data if isinstance(a, Tensor) else a for a in args]
        needs = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        ctx.needs_input_grad = needs
        out = Tensor(ctx.forward(*raw, **kwargs))
        if _grad_enabled and any(needs):
            ctx.seq = next(_trace.nodes)    # creation order (trace.nodes)
            out.requires_grad = True
            out._ctx = ctx
            ctx.parents = tuple(a if isinstance(a, Tensor) else None for a in args)
            # the micro-batch's own data came in beside the tensors (token ids, targets):
            # backward_split.py counts this node's output as varying with the micro-batch
            ctx.takes_data = any(isinstance(a, np.ndarray) for a in args)
        else:
            ctx.saved = ()
        return out

    def forward(self, *args):  # pragma: no cover - abstract
        raise NotImplementedError

    def backward(self, grad):  # pragma: no cover - abstract
        raise NotImplementedError
