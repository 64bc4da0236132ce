# hostile: reads the hand solution and execs it in its own namespace
# lab: 02
# scan: exec: runs code the scan cannot see
# sandbox: the file defines no reduce_scatter
import os

for root in ("/work/main", os.environ.get("PYTHONPATH", "")):
    path = os.path.join(root, "labs", "02_ring", "solution.py")
    if os.path.exists(path):
        exec(open(path).read())
        break
