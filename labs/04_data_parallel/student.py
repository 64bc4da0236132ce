"""Lab 04: data parallelism, the naive gradient all-reduce and then the bucketed one.

Write the two classes below (labs/04_data_parallel/README.md has the picture and the hints).
Both are gradient synchronisers (docs/design.md §4, GradSync): the trainer makes one with
the model's parameters and the dp group, then drives it through every step like this

    sync.zero_grad(); sync.start_step()
    for k in range(M):                              # the step's micro-batches
        sync.sync_now(k == M - 1)                   # only the last one communicates
        loss = model(x_k, y_k, loss_denom=B*T)      # already divided by the GLOBAL token count
        loss.backward()                             # your gradient hooks run in here
    sync.finish()                                   # every p.grad now summed over the dp group
    norm = sqrt(sync.grad_norm_sq(model)); optimizer step

What you may use (and nothing else of minipar's data parallelism):
    import time, numpy as np
    from minipar import comm                        # call comm.all_reduce(...) and
                                                    # comm.all_reduce_async(...) through the
                                                    # module: the grader watches them there
    from minipar.parallel.data_parallel import GradSyncBase   # the base class: params, zero_grad,
                                                    # grad_norm_sq, local_found_inf, ...
and on each parameter p (a minipar.tensor.Tensor): p.data, p.grad, p.shape, p.size,
p.requires_grad, p.name, p.register_grad_hook(fn), p.set_grad_buffer(view).

    comm.all_reduce(group, x, out=None)         -> the sum over the group (out=x: in place)
    comm.all_reduce_async(group, x, out=None)   -> a Handle h: h.test() makes progress and
                                                   says whether it is done, h.done, h.wait()

Parameters with requires_grad False are frozen: never synchronised, their .grad left as it is
(None). Every parameter that requires grad receives a gradient in every backward, once (a
tied parameter used twice, like wte.weight, too: autograd adds both uses before the hook).

Check:  make lab L=04        (or: .venv/bin/python -m labs.grade 04 --student this_file.py)
"""
import time  # noqa: F401 - you will want it

import numpy as np  # noqa: F401 - you will want it

from minipar import comm  # noqa: F401 - you will want it
from minipar.parallel.data_parallel import GradSyncBase


class DataParallelNaive(GradSyncBase):
    """After the last backward, all-reduce every gradient, one parameter at a time."""

    def __init__(self, params, group):
        """params: the model's parameters (Tensors, in model order); keep those that require
        grad (as self.params: GradSyncBase's zero_grad clears their .grad). group: the dp group
        (group.size ranks, each with its own slice of the batch)."""
        raise NotImplementedError("lab 04: DataParallelNaive.__init__, see labs/04_data_parallel/README.md")

    def finish(self):
        """Replace every kept parameter's gradient by its SUM over the group (not the mean:
        each rank's loss is already divided by the global token count), one blocking
        comm.all_reduce per parameter. Set self.exposed_seconds to the seconds this took."""
        raise NotImplementedError("lab 04: DataParallelNaive.finish, see labs/04_data_parallel/README.md")


class DataParallelBucketed(GradSyncBase):
    """Buckets of gradients, each all-reduced from a gradient hook while backward goes on."""

    def __init__(self, params, group, bucket_mb=1.0):
        """Keep the parameters that require grad, then cut them into buckets:
          - walk them in REVERSE model order (backward finishes the last layers first); add
            each to the open bucket, and close the bucket as soon as its gradients hold
            >= limit bytes, limit = max(1, int(bucket_mb * 1024 * 1024)); what is left at
            the end is the last bucket. So bucket 0 starts with the last parameter
            (ln_f.bias), and a huge bucket_mb gives one bucket, a tiny one a bucket each.
          - each bucket owns ONE flat np.zeros buffer, in the parameters' dtype, allocated
            here once; each member's gradient is a view of its slice, shaped like the
            parameter, so a finished bucket is all-reduced as it is (no packing copy);
          - register self.on_grad_ready as a grad hook on every kept parameter."""
        raise NotImplementedError("lab 04: DataParallelBucketed.__init__, see labs/04_data_parallel/README.md")

    def zero_grad(self):
        """Before each step: point each kept p.grad at its view with p.set_grad_buffer(view),
        so the step's first backward overwrites the view (no memset, no new array) and the
        next micro-batches add to it."""
        raise NotImplementedError("lab 04: DataParallelBucketed.zero_grad, see labs/04_data_parallel/README.md")

    def start_step(self):
        """A step begins: every bucket again waits for all its members' gradients, and no
        bucket has an all-reduce in flight."""
        raise NotImplementedError("lab 04: DataParallelBucketed.start_step, see labs/04_data_parallel/README.md")

    def sync_now(self, on):
        """A backward is about to run: communicate during it only if on (the last
        micro-batch); the other micro-batches just accumulate into the buffers."""
        raise NotImplementedError("lab 04: DataParallelBucketed.sync_now, see labs/04_data_parallel/README.md")

    def on_grad_ready(self, p):
        """The grad hook: p's gradient for this backward is complete (already in its view).
        If communicating, count p's bucket down; when its last gradient has arrived start
        comm.all_reduce_async(group, flat, out=flat) (in place) and keep the handle. Then push
        every bucket still in flight a step further (h.test()): MPI only makes progress
        inside calls, and backward is busy computing."""
        raise NotImplementedError("lab 04: DataParallelBucketed.on_grad_ready, see labs/04_data_parallel/README.md")

    def finish(self):
        """After the last backward: wait for every bucket's all-reduce. Each was summed in
        place, so every p.grad (a view) now holds the sum over the group. Set
        self.exposed_seconds to the seconds spent waiting."""
        raise NotImplementedError("lab 04: DataParallelBucketed.finish, see labs/04_data_parallel/README.md")
