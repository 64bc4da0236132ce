"""Lab 09 answered by minipar's own code (python -m labs.grade 09 --solution): the scaler is
minipar.optim.mixed_precision.LossScaler, and the skip is minipar.train.trainer.train_step's own decision, inline
there, behind the lab's signature: a max all-reduce of each rank's int64 flag."""
import numpy as np

from minipar import comm
from minipar.optim.mixed_precision import LossScaler  # noqa: F401 - the lab's LossScaler


def step_is_skipped(world_group, local_found_inf):
    flag = np.array([local_found_inf], dtype=np.int64)
    return bool(comm.all_reduce(world_group, flag, op="max")[0])
