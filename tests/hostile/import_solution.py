# hostile: loads the lab's hand solution with importlib
# lab: 02
# scan: import of importlib
# sandbox: No module named 'labs.02_ring.solution'
import importlib

_solution = importlib.import_module("labs.02_ring.solution")
reduce_scatter = _solution.reduce_scatter
all_gather = _solution.all_gather
