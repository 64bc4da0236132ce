"""Lab 16 answered by minipar's own code (python -m labs.grade 16 --solution): the schedule of
minipar/parallel/zero/stage3.py behind the lab's signatures. ahead is Gathers._ahead on a
Gathers whose order is the n units, filtered by Stage3.start's rule (a unit gathered or in
flight is not started again); releases is Stage3.release's rule (kept after forward when
reshard_after_forward is off, released after backward); events walks a step as Gathers.embed,
Gathers.block and Gathers.backward_enter do (the pass's prefetch at embed's / head's gather,
each block's gather, its prefetch, its compute, Regather's release)."""
from types import SimpleNamespace

from minipar.parallel.zero import stage3


def ahead(i, n, K, backward, live):
    g = stage3.Gathers()
    g.order, g.sync = list(range(n)), SimpleNamespace(prefetch=K)
    return [j for j in g._ahead(i, -1 if backward else 1) if j not in live]     # Stage3.start skips live


def releases(i, n, phase, reshard):
    return phase == "backward" or reshard                                        # Stage3.release


def events(n, K, reshard):
    out, live, flying = [], set(), set()
    for phase in ("forward", "backward"):
        back = phase == "backward"

        def start(units, op):                                                    # Stage3.start
            for u in units:
                out.append((op, phase, u))
                live.add(u)
                flying.add(u)
        start(ahead(None, n, K, back, set(live)), "prefetch")                    # embed / backward_enter(OUTER)
        for u in (range(n - 1, -1, -1) if back else range(n)):
            if u not in live:                                                    # Stage3.gather
                start([u], "gather")
            if u in flying:
                out.append(("wait", phase, u))
                flying.discard(u)
            start(ahead(u, n, K, back, set(live)), "prefetch")                   # Gathers._prefetch
            out.append(("compute", phase, u))
            if releases(u, n, phase, reshard):                                   # Regather / _unit_ready
                out.append(("release", phase, u))
                live.discard(u)
    return out
