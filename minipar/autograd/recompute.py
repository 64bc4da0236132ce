"""Activation recomputation: keep less from forward, compute it again in backward.

What is kept (--recompute, Korthikanti et al. 2022, arXiv:2205.05198, section 4):
    none       every activation an op saves for its backward (what minipar always did)
    selective  all but the attention core: CausalSelfAttention keeps q, k and v, not the
               (B, nh, T, T) softmax P, and computes P again from q and k in backward
               (ops.py); the other saved bytes of a layer stay
    full       only each block's input: the block's forward runs under no_grad (no graph,
               nothing saved), and Recompute.backward runs it again with a graph, then
               back-propagates through that graph (Chen et al. 2016, arXiv:1604.06174)

Exactness. The recomputation runs the same NumPy operations on the same inputs in the same
order, so in float64 every gradient is bit-identical to --recompute none
(tests/test_recompute.py compares with ==). What it costs: selective, one more Q K^T,
softmax per layer in backward; full, one more forward of every block, and with tensor
parallelism its all-reduces again (Megatron's g in each block's forward).

How full works in the autograd engine. Recompute is one Function node standing for a whole
block: its only input in the graph is the block's input x, and its backward does
    leaf = Tensor(x, requires_grad=True); y = block(leaf)      # a graph of the block, now
    y.backward(g)                                              # parameters' .grad += ..., hooks
    return leaf.grad                                           # on to the previous block
The parameters are not inputs of the node: the inner backward adds their gradients into
.grad and fires their hooks (data parallelism's buckets start there), exactly when the same
block's backward would have without recomputation.
"""
from __future__ import annotations

from minipar import trace
from minipar.autograd import backward_split
from minipar.autograd.tensor import Function, Tensor, enable_grad, is_grad_enabled, no_grad

MODES = ("none", "selective", "full")
_replaying = 0              # > 0 while Recompute.backward runs a block's forward again


def replaying() -> bool:
    """Is a block's forward running again, inside backward (--recompute full)? ZeRO-3's gathers
    ask (zero/stage3.py): the parameters gathered for it stay for the backward that follows."""
    return _replaying > 0


def added_flops(L: int, B: int, T: int, C: int, mode: str) -> int:
    """Matmul FLOPs that one forward + backward of B sequences of T tokens adds, over L blocks
    of width C (the count of model.train_flops_per_token: 2*M*N*K per product):
    selective  the Q K^T of every layer again, 2 B T^2 C each;
    full       every block's forward again: its linears, 2 B T (3C^2 + C^2 + 8C^2) = 24 B T C^2,
               and attention's Q K^T and P V, 4 B T^2 C."""
    per_layer = {"none": 0, "selective": 2 * B * T * T * C, "full": 24 * B * T * C * C + 4 * B * T * T * C}
    return L * per_layer[mode]


class Recompute(Function):
    """y = run(x) with nothing saved but x; backward runs `run` again (see the module)."""

    def forward(self, x, run):
        self.run = run
        with no_grad():
            y = run(Tensor(x)).data
        self.save(x)
        return y

    def backward(self, g):
        (x,) = self.saved
        leaf = Tensor(x, requires_grad=True)
        global _replaying
        _replaying += 1
        try:
            with enable_grad():
                y = self.run(leaf)
        finally:
            _replaying -= 1
        if backward_split.running():            # B of a zero-bubble schedule: W comes later
            backward_split.defer(self.seq, backward_split.backward_b(y, g, inputs=[leaf]))
        else:
            y.backward(g)
        return leaf.grad, None


def runner(mode: str):
    """Parts.run_block for --recompute `mode`: block(i, x) in a trace span of its own
    (trace.layer), recomputed in backward when mode is "full"."""
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {mode!r}")

    def run_block(blk, i: int, x: Tensor) -> Tensor:
        with trace.layer(f"h.{i}"):
            return block(lambda t: blk(i, t), x, mode)
    return run_block


def block(run, x: Tensor, mode: str) -> Tensor:
    """run(x) (one transformer block), recomputed in backward when mode is "full"."""
    if mode != "full" or not is_grad_enabled() or not x.requires_grad:
        return run(x)
    return Recompute.apply(x, run)
