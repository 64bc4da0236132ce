"""The trainer: one run from flags to a summary (`python -m minipar.train`). Read in this order:

    setup.py            the flags, outputs, checkpoint and data checked on every rank: RunSpec
    trainer.py          set-up, the loop, train_step, validation, saving, the end of a run
    data.py, corpus.py  the tokens: the built-in corpus or a file, and the batches
    checkpoint.py       saving and resuming, atomically, in the canonical format
    verify.py           --verify: the same steps in one process, compared in float64
    report.py           the summary at the end: each figure held to its formula
    stop.py, faults.py  stopping early (divergence, signals) and the injected faults that test it
"""
from minipar.train.trainer import build_parser, main

__all__ = ["build_parser", "main"]
