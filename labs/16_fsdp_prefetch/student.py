"""Lab 16: FSDP's (ZeRO-3's) parameter schedule with prefetch.

Every unit of the model (a transformer block) keeps 1/N of its parameters on each of the N dp
ranks. Before a unit computes, its full parameters are all-gathered; after, they are released.
You write the SCHEDULE: which units' all-gathers start when, which are waited for, and when
each unit's gathered parameters are released. minipar (labs/16_fsdp_prefetch/drive.py's seam)
does the all-gathers themselves (stage3.Stage3.start, gather and release, handed out) and asks
your `ahead` and `releases` at every unit, so `--zero 3 --prefetch K` trains with your schedule.

The units are numbered 0..n-1 in forward order. A training step is two passes:
    forward   units 0, 1, ..., n-1
    backward  units n-1, n-2, ..., 0
Prefetch K: when a unit's all-gather has been waited for (it is about to compute), the
all-gathers of the next K units of the pass are started, so they travel while it computes; at
the start of a pass (before its first unit), the first K units of the pass are started.
Reshard after forward on: a unit is released right after its forward compute, and gathered
again in backward. Off: it stays gathered from its forward until its backward is done.
In backward a unit is always released after its compute.

Nothing here communicates: the functions are plain Python, ints, lists, sets and tuples.

Check:  make lab L=16        (or: .venv/bin/python -m labs.grade 16 --student this_file.py)
"""


def ahead(i, n, K, backward, live):
    """The units whose all-gathers to start now, in the pass's order: a list of ints.

    i: the unit whose all-gather has just been waited for (it computes next), or None at
    the start of the pass (before its first unit). n >= 0 units, K >= 0 the prefetch,
    backward: False for the forward pass (order 0..n-1), True for backward (n-1..0).
    live: the set of units that are gathered or whose all-gather is in flight right now
    (i among them); do not modify it.

    Return the units among the K that follow i in the pass's order (the first K of the pass
    when i is None) that are not in live; never past the pass's last unit (fewer than K
    near the end, none after it).

    Example: n = 5, K = 2, forward, i = 1, live = {1, 2}: [3]  (2 is on its way already).
    Backward, i = None, live = set(): [4, 3]."""
    raise NotImplementedError("lab 16: ahead, see labs/16_fsdp_prefetch/README.md")


def releases(i, n, phase, reshard):
    """After unit i (of n) computed in `phase` ("forward" or "backward"): are its gathered
    parameters released now? A bool: in backward always; in forward when reshard (reshard
    after forward on), else they are kept for the unit's backward."""
    raise NotImplementedError("lab 16: releases, see labs/16_fsdp_prefetch/README.md")


def events(n, K, reshard):
    """One training step's schedule over n >= 0 units with prefetch K >= 0 and reshard after
    forward on (True) or off (False): a list of (op, phase, unit) tuples, op one of the
    strings below, phase "forward" or "backward", unit an int in 0..n-1, in the order they
    happen. The step starts with nothing gathered. For each pass, forward then backward:

      at the pass's start    ("prefetch", phase, j) for each j of ahead(None, ...), in order
      then for each unit u of the pass, in the pass's order:
        ("gather", phase, u)     if u is neither gathered nor on its way (nobody prefetched it)
        ("wait", phase, u)       if u's all-gather is in flight (started and not yet waited for)
        ("prefetch", phase, j)   for each j of ahead(u, ...), in order
        ("compute", phase, u)
        ("release", phase, u)    if releases(u, n, phase, reshard)

    live (what ahead receives) is every unit gathered or on its way at that moment: started
    ("gather" or "prefetch") and not yet released. A unit kept from forward (reshard off) is
    gathered: backward neither gathers it nor waits for it.

    Example: n = 2, K = 1, reshard on:
      ("prefetch", "forward", 0), ("wait", "forward", 0), ("prefetch", "forward", 1),
      ("compute", "forward", 0), ("release", "forward", 0), ("wait", "forward", 1),
      ("compute", "forward", 1), ("release", "forward", 1),
      ("prefetch", "backward", 1), ("wait", "backward", 1), ("prefetch", "backward", 0),
      ("compute", "backward", 1), ("release", "backward", 1), ("wait", "backward", 0),
      ("compute", "backward", 0), ("release", "backward", 0)"""
    raise NotImplementedError("lab 16: events, see labs/16_fsdp_prefetch/README.md")
