"""Lab 02, solved by hand as a student would: the ring as two plain loops (minipar's own,
in minipar/comm/algorithms/ring.py, is a generator that a non-blocking Handle can also drive)."""
import numpy as np

OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def bounds(n, p):
    """Where each of the p pieces of np.array_split(range(n), p) starts and ends."""
    base, extra = divmod(n, p)
    starts = [i * base + min(i, extra) for i in range(p + 1)]
    return starts


def reduce_scatter(g, x, op="sum"):
    p, r = g.size, g.rank
    flat = np.ascontiguousarray(x).ravel()
    at = bounds(flat.size, p)
    if p == 1:
        return flat.copy()
    reduce = OPS[op]
    right, left = (r + 1) % p, (r - 1) % p
    k = (r - 1) % p                                   # start with my copy of piece r-1
    sending = flat[at[k]:at[k + 1]].copy()
    call = g.begin("reduce_scatter", p - 1)
    for step in range(p - 1):
        k = (r - step - 2) % p                        # the piece arriving from the left
        arriving = np.empty(at[k + 1] - at[k], dtype=flat.dtype)
        call.wait(call.sendrecv(step, sending, right, arriving, left))
        sending = reduce(arriving, flat[at[k]:at[k + 1]])   # add my copy, pass it on
    call.done()
    return sending                                    # k == r after the last step


def all_gather(g, piece, sizes=None):
    p, r = g.size, g.rank
    mine = np.ascontiguousarray(piece).ravel()
    sizes = [mine.size] * p if sizes is None else [int(s) for s in sizes]
    at = [0]
    for s in sizes:
        at.append(at[-1] + s)
    out = np.empty(at[-1], dtype=mine.dtype)
    out[at[r]:at[r + 1]] = mine
    if p == 1:
        return out
    right, left = (r + 1) % p, (r - 1) % p
    call = g.begin("all_gather", p - 1)
    for step in range(p - 1):
        send, recv = (r - step) % p, (r - step - 1) % p   # pass on what arrived last time
        call.wait(call.sendrecv(step, out[at[send]:at[send + 1]], right, out[at[recv]:at[recv + 1]], left))
    call.done()
    return out
