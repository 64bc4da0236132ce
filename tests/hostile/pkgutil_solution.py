# hostile: reads the hand solution through pkgutil and runs it
# lab: 02
# scan: import of pkgutil
# sandbox: the file defines no reduce_scatter
import pkgutil

_src = pkgutil.get_data("labs", "02_ring/solution.py") or b""
_ns = {}
exec(compile(_src, "solution", "exec"), _ns)
if "reduce_scatter" in _ns:
    reduce_scatter, all_gather = _ns["reduce_scatter"], _ns["all_gather"]
