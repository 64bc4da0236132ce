"""python -m minipar.plot: figures from finished runs. Read in this order:

    curves.py           loss, gradient norm, bytes and memory curves from --log files
    timeline.py         a --trace file drawn as each rank's timeline
"""
from minipar.plot.curves import build_parser, main

__all__ = ["build_parser", "main"]
