"""Lab 09: the dynamic loss scaler and the all-rank skip (fp16 mixed precision).

Write the class and the function below (labs/09_loss_scaler/README.md has the pictures and
the hints). The trainer (minipar.train.trainer.train_step) uses them like this, on every rank:

    scale = scaler.scale                              # backward starts from S, not 1
    ... forward, backward, the gradient sync ...
    skipped = step_is_skipped(world_group, local_found_inf)   # this rank's inf/NaN -> everyone's
    if not skipped:
        opt.step(grad_scale=clip_coef / scale)        # unscale (and clip) in fp32
    scaler.update(skipped)

and its start-up line, summary and checkpoints read the attributes scale, dynamic,
growth_factor, backoff_factor, growth_interval and good_steps, and state_dict().

Communicate with minipar.comm (all_reduce, all_gather, send, recv, ...) on the group you are
given, never with MPI's own collectives.

Check:  make lab L=09        (or: python -m labs.grade 09 --student this_file.py)
"""
import numpy as np  # noqa: F401 - you will want it

from minipar import comm  # noqa: F401 - and this


class LossScaler:
    """PyTorch GradScaler's dynamic loss scale. Attributes (all public, read by the trainer):

    scale            the factor the next backward multiplies the loss by (a Python float)
    growth_factor    the scale is multiplied by it after growth_interval clean steps in a row
    backoff_factor   the scale is multiplied by it after a step with an inf/NaN gradient
    growth_interval  how many clean steps in a row make the scale grow (an int)
    good_steps       clean steps since the scale last changed (an int, 0 at first)
    dynamic          False: a fixed scale (bf16 uses 1.0) that update() never changes
    """

    def __init__(self, scale=65536.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
                 dynamic=True):
        """Store the arguments as the attributes above (the grader passes them by keyword),
        with good_steps = 0."""
        raise NotImplementedError("lab 09: LossScaler.__init__, see labs/09_loss_scaler/README.md")

    def update(self, found_inf):
        """After every step, skipped (found_inf True) or not. dynamic=False: change nothing at
        all. found_inf: scale *= backoff_factor and good_steps = 0. A clean step: good_steps
        += 1, and when that makes it growth_interval, scale *= growth_factor and good_steps
        = 0. So with growth_interval = 3, clean steps after a change leave good_steps at
        1, 2, then grow the scale and leave it at 0."""
        raise NotImplementedError("lab 09: LossScaler.update, see labs/09_loss_scaler/README.md")

    def state_dict(self):
        """-> {"scale": float, "good_steps": int, "growth_interval": int, "dynamic": bool}:
        plain Python values (a checkpoint writes the dict into its meta.json) with minipar's
        keys, so that load_state_dict on a fresh LossScaler() continues exactly as this one."""
        raise NotImplementedError("lab 09: LossScaler.state_dict, see labs/09_loss_scaler/README.md")

    def load_state_dict(self, state):
        """Set scale, good_steps, growth_interval and dynamic from a dict of state_dict()'s
        form (yours, or one of minipar's own checkpoints). The factors are not state: they
        stay as constructed."""
        raise NotImplementedError("lab 09: LossScaler.load_state_dict, see labs/09_loss_scaler/README.md")


def step_is_skipped(world_group, local_found_inf):
    """Every rank of world_group calls this once a step with its own flag (did any gradient
    it holds contain an inf or NaN?) and gets back the same bool: True if any rank's flag is
    True, else False. world_group is a minipar.comm.Group (g.rank, g.size; any size, 1
    included); local_found_inf a bool or np.bool_."""
    raise NotImplementedError("lab 09: step_is_skipped, see labs/09_loss_scaler/README.md")
