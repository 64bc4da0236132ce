"""The collectives' algorithms, each a generator of point-to-point steps (docs/collectives.md).
Read in this order:

    ring.py                   ring reduce-scatter and all-gather: bandwidth-optimal
    direct.py                 direct exchange: one round, p-1 messages each way
    doubling.py               recursive doubling / halving and Bruck: latency-optimal
    tree.py                   binomial trees: broadcast, reduce, scatter, gather
    alltoall.py               all-to-all: pairwise exchange
    hierarchical.py           two-level all-reduce: inside each host, then across hosts
    hierarchical_alltoall.py  two-level all-to-all
    straight_line.py          every algorithm above as one plain loop over a list of arrays:
                              the reference the tuned generators are tested against
"""
