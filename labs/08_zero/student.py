"""Lab 08: ZeRO stages 1, 2 and 3, for one unit of parameters at a time.

minipar cuts a rank's parameters into units (wte, each transformer block, the rest), and
flattens each unit into one vector of n elements, padded with zeros to n_pad, a multiple of
the dp group's size N. You write what happens to one unit; minipar's ZeRO (through the seam
of labs/08_zero/drive.py) calls your functions for every unit, in the same order on every
rank. labs/08_zero/README.md has the picture and the hints.

A unit, as your functions see it (g is the dp group: g.size = N ranks, this one g.rank):

    unit.n              the unit's elements before padding
    unit.n_pad          its padded length, N * (hi - lo) from your shard_bounds
    unit.lo, unit.hi    this rank's shard: elements [lo, hi) of the padded flat vector
    unit.param_flat     (n_pad,) the full parameters, or None when not held
    unit.param_shard    (hi - lo,) stage 3: the parameters this rank owns (None in stages 1, 2)
    unit.grad_flat      (n_pad,) a full gradient, or None when not held
    unit.grad_shard     (hi - lo,) this rank's summed gradient shard, or None when not held
Every array in the parameters' dtype (float64 or float32: np.zeros(k) alone is float64).

The model's parameters are views of unit.param_flat (minipar re-points them after your
update and gather, so assigning a new array is fine). Adam's m and v are this rank's shards,
kept by minipar; you reach them only through the adamw function that update receives.

What a rank holds between steps (formulas.formula; the memory criterion counts every array):

    stage 1   param_flat   grad_flat    (the gradient buffer the micro-batches add into)
    stage 2   param_flat   grad_shard
    stage 3   param_shard  grad_shard
Everything else is transient: set it to None once you are done with it.

Communicate with minipar's collectives only (no MPI collective):
    piece = comm.reduce_scatter(g, x)     rank r: piece r of np.array_split(sum over ranks of x, N)
    whole = comm.all_gather(g, piece)     every rank's piece, concatenated in rank order

Check:  make lab L=08        (or: .venv/bin/python -m labs.grade 08 --student this_file.py)
"""
import numpy as np  # noqa: F401 - you will want it

from minipar import comm  # noqa: F401 - comm.reduce_scatter, comm.all_gather


def shard_bounds(n, N, rank):
    """This rank's shard of a unit of n >= 1 elements over N ranks: (lo, hi), two ints, the
    half-open range [lo, hi) of the unit's flat vector once it is padded with zeros to n_pad,
    the smallest multiple of N that is >= n. Every rank's shard has n_pad / N elements and
    rank r's is the r-th of them: the piece comm.reduce_scatter hands rank r.

    Example: n = 7, N = 3 pads to 9: rank 0 (0, 3), rank 1 (3, 6), rank 2 (6, 9)."""
    raise NotImplementedError("lab 08: shard_bounds, see labs/08_zero/README.md")


def reduce_gradient(g, stage, unit, first, last):
    """Backward has finished one micro-batch's gradient of every parameter of the unit, and
    minipar has put it in unit.grad_flat (n_pad,; zeros in the padding). first / last: is
    this the step's first / last micro-batch?

    Stage 1: unit.grad_flat is the buffer the micro-batches add into (the model's .grad are
    views of it): it holds the sum over this step's micro-batches so far. Keep it. Only on
    the last micro-batch, reduce-scatter it over g into unit.grad_shard.
    Stages 2 and 3: unit.grad_flat holds this micro-batch's gradient alone. Reduce-scatter
    it over g and add the piece into unit.grad_shard (on the first micro-batch the piece
    replaces whatever unit.grad_shard held), then drop unit.grad_flat (None).

    After the last micro-batch unit.grad_shard is this rank's (hi - lo,) shard of the
    gradient summed over every rank and micro-batch."""
    raise NotImplementedError("lab 08: reduce_gradient, see labs/08_zero/README.md")


def update(g, stage, unit, adamw):
    """The optimizer step of the unit, once the last backward is over. adamw(w, grad) runs
    one AdamW step in place on w, this rank's (hi - lo,) shard of the parameters, from grad,
    its summed gradient shard (minipar.optim.adamw.adamw_update with this shard's m and v, each
    parameter's weight decay, the step's learning rate and clip factor). Call it once, on
    the array the rank keeps, not on a copy.

    Stages 1 and 2: update this rank's shard of unit.param_flat, then all-gather the updated
    shards so that unit.param_flat (n_pad,) holds every rank's new parameters. Stage 1 then
    drops unit.grad_shard (None): it keeps the full gradient buffer and nothing more.
    Stage 3: update unit.param_shard. Nothing is gathered: the next forward gathers."""
    raise NotImplementedError("lab 08: update, see labs/08_zero/README.md")


def gather(g, unit):
    """Stage 3, before the unit's forward and again before its backward: all-gather every
    rank's unit.param_shard over g into unit.param_flat, the full (n_pad,) parameters, an
    array of its own: never the shard itself (not even when g.size == 1), since release
    drops param_flat and the rank must keep its shard."""
    raise NotImplementedError("lab 08: gather, see labs/08_zero/README.md")


def release(unit):
    """Stage 3, after the unit's forward and again after its backward: drop the full
    parameters (unit.param_flat = None); the rank keeps only its unit.param_shard."""
    raise NotImplementedError("lab 08: release, see labs/08_zero/README.md")
