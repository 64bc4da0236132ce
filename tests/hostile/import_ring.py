# hostile: one line: minipar's own ring under the student's name
# lab: 02
# scan: not a module this lab's handout gives
# sandbox: is not defined in import_ring.py
from minipar.comm.algorithms.ring import all_gather, reduce_scatter  # noqa: F401
