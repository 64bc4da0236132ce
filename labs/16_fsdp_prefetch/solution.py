"""Lab 16, solved by hand as a student would: the prefetch window, the release rule, and one
step's schedule written out by walking the units with two sets (what is gathered, what is
still on its way). minipar's own schedule lives in minipar/parallel/zero/stage3.py (Gathers)."""


def pass_order(n, backward):
    """The order a pass visits the units: 0..n-1 forward, n-1..0 backward."""
    if backward:
        return list(range(n - 1, -1, -1))
    return list(range(n))


def ahead(i, n, K, backward, live):
    order = pass_order(n, backward)
    if i is None:
        first = 0                      # the pass starts: its first K units
    else:
        first = order.index(i) + 1     # the K units that come after i in this pass
    window = order[first:first + K]    # slicing stops at the end of the pass by itself
    return [u for u in window if u not in live]


def releases(i, n, phase, reshard):
    if phase == "backward":
        return True                    # its gradient is done: nothing needs the parameters now
    return reshard                     # forward: release now, or keep them for the backward


def events(n, K, reshard):
    out = []
    gathered = set()                   # gathered or on the way
    on_the_way = set()                 # started, not yet waited for
    for phase in ("forward", "backward"):
        backward = phase == "backward"

        def start(units, how):
            for u in units:
                out.append((how, phase, u))
                gathered.add(u)
                on_the_way.add(u)

        start(ahead(None, n, K, backward, set(gathered)), "prefetch")
        for u in pass_order(n, backward):
            if u not in gathered:
                start([u], "gather")    # nobody prefetched it: start it now (and wait in full)
            if u in on_the_way:
                out.append(("wait", phase, u))
                on_the_way.discard(u)
            start(ahead(u, n, K, backward, set(gathered)), "prefetch")
            out.append(("compute", phase, u))
            if releases(u, n, phase, reshard):
                out.append(("release", phase, u))
                gathered.discard(u)
    return out
