"""A fault injector, for the tests of how a run ends (docs/debugging.md).

    MINIPAR_FAULT="kind=nan,rank=1,step=3"            one fault
    MINIPAR_FAULT="kind=exit,code=0,rank=2,step=1; kind=sigterm,rank=0,step=4"

Each fault fires once, on the rank it names (rank=all: every rank), at the step it names, just
before that step's forward. kind:

    raise     RuntimeError("injected fault")           the traceback path
    exit      sys.exit(code) (code=0 by default)        a rank that leaves early
    hang      sleeps for ever                           the others' comm timeout names it
    kill      SIGKILL to itself                         a rank that dies
    nan       a NaN into each of this rank's weights     divergence: it spreads to every rank
                                                        through the step's messages
    sigint, sigterm   that signal to itself             one rank interrupted

Unset (the default), nothing happens: the trainer only asks `due(step, rank)`.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

from minipar.parallel.zero import stage3

KINDS = ("raise", "exit", "hang", "kill", "nan", "sigint", "sigterm")


class FaultSpecError(ValueError):
    pass


def parse(text: str) -> list[dict]:
    """MINIPAR_FAULT's faults: [{"kind", "rank" (int or "all"), "step", "code"}]."""
    faults = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = {}
        for item in part.split(","):
            key, _, value = item.partition("=")
            fields[key.strip()] = value.strip()
        kind = fields.get("kind")
        if kind not in KINDS:
            raise FaultSpecError(f"MINIPAR_FAULT {part!r}: kind must be one of {', '.join(KINDS)}")
        try:
            rank = "all" if fields.get("rank", "0") == "all" else int(fields.get("rank", "0"))
            step, code = int(fields["step"]), int(fields.get("code", "0"))
        except (KeyError, ValueError):
            raise FaultSpecError(f"MINIPAR_FAULT {part!r}: needs step=N, and rank=R or rank=all "
                                 f"(code=N with kind=exit)") from None
        faults.append({"kind": kind, "rank": rank, "step": step, "code": code})
    return faults


_FAULTS: list | None = None


def load() -> list[dict]:
    """MINIPAR_FAULT, parsed once (FaultSpecError: the trainer's one-line exit 2)."""
    global _FAULTS
    if _FAULTS is None:
        _FAULTS = parse(os.environ.get("MINIPAR_FAULT", ""))
    return _FAULTS


def due(step: int, rank: int) -> list[dict]:
    return [f for f in load() if f["step"] == step and f["rank"] in ("all", rank)]


def inject(session, step: int, rank: int):
    """Fire this rank's faults of `step` (s: the train.Session)."""
    for f in due(step, rank):
        kind = f["kind"]
        print(f"[rank {rank}] MINIPAR_FAULT: {kind} at step {step}", file=sys.stderr, flush=True)
        if kind == "raise":
            raise RuntimeError(f"injected fault at step {step} on rank {rank}")
        if kind == "exit":
            sys.exit(f["code"])
        if kind == "hang":
            while True:
                time.sleep(1)
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind in ("sigint", "sigterm"):
            os.kill(os.getpid(), signal.SIGINT if kind == "sigint" else signal.SIGTERM)
        if kind == "nan":
            poison(session)


def poison(session):
    """A NaN into every weight tensor this rank holds (its first element), or with ZeRO-3,
    whose parameters live as shards between steps, into every shard: some of them are
    surely used (a single embedding row might not be)."""
    arrays = ([u.param_shard for u in session.sync.units] if isinstance(session.sync, stage3.Stage3)
              else [p.data for p in session.model.parameters()])
    for a in arrays:
        if a.size:
            a.flat[0] = np.nan
