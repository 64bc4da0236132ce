# hostile: lab 07's functions defined in the file, each returning minipar's own list
# lab: 07
# scan: minipar.parallel.pipeline.schedules.schedule
# sandbox: minipar's own minipar.parallel.pipeline.schedules
from minipar.parallel.pipeline import schedules


def gpipe(stage, n_stages, n_micro):
    return list(schedules.schedule("gpipe", stage, n_stages, n_micro))


def one_f_one_b(stage, n_stages, n_micro):
    return list(schedules.schedule("1f1b", stage, n_stages, n_micro))
