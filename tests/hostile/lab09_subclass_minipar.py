# hostile: lab 09's LossScaler as a subclass of minipar's own, adding nothing
# lab: 09
# scan: from minipar.optim.mixed_precision import LossScaler: minipar's own loss scaler
# sandbox: LossScaler.__init__ is not defined in lab09_subclass_minipar.py
from minipar import comm
from minipar.optim.mixed_precision import LossScaler as MiniparLossScaler


class LossScaler(MiniparLossScaler):
    pass


def step_is_skipped(world_group, local_found_inf):
    import numpy as np
    flag = np.array([int(local_found_inf)], dtype=np.int64)
    return bool(comm.all_reduce(world_group, flag, op="max")[0])
