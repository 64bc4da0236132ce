"""ZeRO: optimizer state, gradients and parameters sharded over the data-parallel group.

    sharded.py          stages 1, 2 and 3
    summary.py          the run summary's ZeRO figures and line
"""
