"""Lab 16, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's ahead, releases and events, and the seam. Nothing here judges; lab.py does,
in the grader, against its own plain schedule.

Cases (the grader rebuilds every one from the functions below):
  ahead     n = 0..6 units, K = 0..n+1 (K past the last unit), forward and backward, i = None
            (the pass's start) and every unit, and four sets of live units each: i alone, i
            and the K-1 units after it (a prefetch's steady state), every unit (reshard off's
            backward), i and a seeded random set; each call gets a fresh set, recorded after.
  releases  n = 1..6, every unit, both phases, reshard on and off.
  events    n = 0..6, K = 0..n+1, reshard on and off: the whole list.
A teacher's "n_units" ($MINIPAR_LAB_EXTRA/16_fsdp_prefetch/cases.json) adds unit counts.

The seam (install): stage3.Gathers._prefetch, which ZeRO-3 calls when a block's all-gather has
been waited for (and at embed's and the head's, i = None), asks the student's ahead which
blocks to start, and starts each as asked: a block gathered or in flight is all-gathered a
second time (its bytes counted again), never skipped. stage3.Stage3.release asks the
student's releases for a block inside a training step (the embedding-side units and the
evaluation's forwards keep minipar's own rule). The rest is minipar's own: Stage3.start,
gather (the wait), poll, Regather and the reduce-scatters.
"""
import os

import numpy as np

from labs.framework import extra_cases
from labs.results import key
from minipar.parallel.zero import stage3

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ("forward", "backward")
# minipar's own schedule: reached from the student's file, each raises (labs/child.py)
OWN = ["minipar.parallel.zero.stage3:Gathers._ahead", "minipar.parallel.zero.stage3:Gathers._prefetch",
       "minipar.parallel.zero.stage3:Gathers.backward_enter", "minipar.parallel.zero.formulas:gathered_peak"]


def unit_counts() -> list:
    """n = 0..6, and a teacher's "n_units"."""
    return sorted({*range(7), *map(int, extra_cases(HERE).get("n_units", []))})


def order(n, backward) -> list:
    return list(range(n - 1, -1, -1)) if backward else list(range(n))


def ahead_cases() -> list:
    """(n, K, backward, i, live) of the ahead criterion, live a sorted list."""
    out = []
    for n in unit_counts():
        for K in range(n + 2):
            for backward in (False, True):
                seq = order(n, backward)
                for at, i in enumerate([None, *seq]):
                    mine = set() if i is None else {i}
                    rng = np.random.default_rng([n, K, int(backward), at])
                    picked = {int(u) for u in range(n) if rng.random() < 0.5}
                    lives = [mine, mine | set(seq[at:at + max(K - 1, 0)]), set(range(n)), mine | picked]
                    for live in sorted({tuple(sorted(x)) for x in lives}):
                        out.append((n, K, backward, i, list(live)))
    return out


def releases_cases() -> list:
    return [(n, i, phase, reshard) for n in unit_counts() if n for i in range(n) for phase in PHASES
            for reshard in (True, False)]


def events_cases() -> list:
    return [(n, K, reshard) for n in unit_counts() for K in range(n + 2) for reshard in (True, False)]


def call_ahead(n, K, backward, i, live) -> str:
    return f"ahead(i={i}, n={n}, K={K}, backward={backward}, live={set(live) or 'set()'})"


# --- what the child runs ----------------------------------------------------------------------

def ahead(student, out):
    for idx, (n, K, backward, i, live) in enumerate(ahead_cases()):
        out.case(call_ahead(n, K, backward, i, live))
        given = set(live)
        out.put(key("ahead", idx), student.ahead(i, n, K, backward, given))
        out.put(key("ahead", idx, "live after"), sorted(given) if isinstance(given, set) else None)


def releases(student, out):
    for idx, (n, i, phase, reshard) in enumerate(releases_cases()):
        out.case(f"releases(i={i}, n={n}, phase={phase!r}, reshard={reshard})")
        out.put(key("releases", idx), student.releases(i, n, phase, reshard))


def events(student, out):
    for n, K, reshard in events_cases():
        out.case(f"events(n={n}, K={K}, reshard={reshard})")
        out.put(key("events", n, K, reshard), student.events(n, K, reshard))


def schedule(student, out):
    """Every criterion's cases in one child: ahead's, releases', then events' (what each
    recorded before a failure stays for its own criterion's judge)."""
    ahead(student, out)
    releases(student, out)
    events(student, out)


# --- the seam ---------------------------------------------------------------------------------

def is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def start_as_asked(sync, u, again: bool):
    """Stage3.start, except that a unit gathered or in flight is all-gathered again (as the
    student asked): its bytes count on the ledger and in the gathered bytes a second time."""
    if u.live:
        if u.gather_handle is not None:
            u.gather_handle.wait()
            u.gather_handle = None
            sync.wire.landed(u)
        u.live = False
    sync.start(u, again)


def install(student):
    """ZeRO-3's prefetch and release decisions become the student's, on this rank."""
    calls = [0]
    own_release = stage3.Stage3.release

    def _prefetch(self, i, step):
        n, back, K = len(self.order), step < 0, self.sync.prefetch
        pos = None if i is None else self.order.index(i)
        live = {p for p, b in enumerate(self.order) if any(u.live for u in self.blocks[b])}
        calls[0] += 1
        got = student.ahead(pos, n, K, back, set(live))
        if not isinstance(got, (list, tuple)) or not all(is_int(j) and 0 <= j < n for j in got):
            raise ValueError(f"{call_ahead(n, K, back, pos, sorted(live))} returned {got!r:.200}: want a list "
                             f"of units in 0..{n - 1}")
        for j in got:
            for u in self.blocks[self.order[int(j)]]:
                start_as_asked(self.sync, u, back)

    def release(self, u, after_backward: bool = False):
        g = self.model.parts.gathers
        i = self.model.family.block_of(u.names[0])
        if not self.in_step or i is None:
            return own_release(self, u, after_backward)
        n, pos, phase = len(g.order), g.order.index(i), "backward" if after_backward else "forward"
        calls[0] += 1
        go = student.releases(pos, n, phase, self.reshard_after_forward)
        if not isinstance(go, (bool, np.bool_)):
            raise ValueError(f"releases(i={pos}, n={n}, phase={phase!r}, reshard={self.reshard_after_forward}) "
                             f"returned {go!r:.200}: want True or False")
        if not go:
            return                                      # kept gathered, as the student said
        keep, self.reshard_after_forward = self.reshard_after_forward, True    # release it, whatever the flag
        try:
            own_release(self, u, after_backward)
        finally:
            self.reshard_after_forward = keep

    stage3.Gathers._prefetch = _prefetch
    stage3.Stage3.release = release
    return lambda: calls[0]
