# hostile: lab 07 handed in as minipar's own schedules under the student's names
# lab: 07
# scan: from minipar.parallel.pipeline.schedules import gpipe: minipar's own GPipe
# sandbox: is not defined in lab07_minipars_schedules.py
from minipar.parallel.pipeline.schedules import gpipe, one_f_one_b  # noqa: F401
