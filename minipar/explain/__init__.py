"""python -m minipar.explain: each mechanism drawn from a real run's trace, checked against
the formulas. Read in this order:

    pictures.py         the runs behind each picture and the command line
    read.py             what a picture reads from the trace, checked
    draw.py             the pictures
"""
from minipar.explain.pictures import build_parser, main, settle

__all__ = ["build_parser", "main", "settle"]
