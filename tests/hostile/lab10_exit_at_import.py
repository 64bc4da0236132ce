# hostile: lab 10's formulas: the file exits with code 0 as soon as it is imported
# lab: 10
# scan: import of sys
# sandbox: the code called sys.exit(0)
import sys

sys.exit(0)


def param_count(V, T, L, C, tied=True):
    return 0
