# hostile: lab 16's ahead answered by minipar's own Gathers._ahead on a Gathers it builds itself
# lab: 16
# scan: import from minipar.parallel.zero: not a module this lab's handout gives
# sandbox: minipar's own minipar.parallel.zero.stage3.Gathers._ahead
from minipar.parallel.zero import stage3


class Prefetch:
    prefetch = 0


def ahead(i, n, K, backward, live):
    g = stage3.Gathers()
    g.order, g.sync = list(range(n)), Prefetch()
    g.sync.prefetch = K
    return [j for j in g._ahead(i, -1 if backward else 1) if j not in live]


def releases(i, n, phase, reshard):
    return phase == "backward" or reshard


def events(n, K, reshard):
    return []
