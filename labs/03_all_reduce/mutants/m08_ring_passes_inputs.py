# criterion: identical results on every rank
"""Mutant: the naive ring: p-1 steps passing whole input arrays round the ring, each rank adding
them in the order they arrive, its own first. The sum is complete, but rank 0 computes
(x0+x2)+x1 and rank 1 (x1+x0)+x2: results differ in the last bit between ranks (and it
sends (p-1) times the array, not 2(p-1)/p)."""
import numpy as np

COMBINE = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def edges(n, p):
    """Piece i of np.array_split(range(n), p) is [edges[i], edges[i + 1])."""
    small, big = divmod(n, p)                    # the first `big` pieces get one more
    out = [0]
    for i in range(p):
        out.append(out[-1] + small + (i < big))
    return out


def fresh_copy(x):
    """A new C-ordered 1-D copy of x: the working array, and later the result."""
    return np.array(x, order="C").reshape(-1)


def all_reduce_ring(g, x, op="sum"):
    combine = COMBINE[op]
    p, r = g.size, g.rank
    acc = fresh_copy(x)
    if p == 1 or acc.size == 0:
        return acc.reshape(np.shape(x))
    right, left = (r + 1) % p, (r - 1) % p
    passing, inbox = acc.copy(), np.empty_like(acc)
    call = g.begin("all_reduce", p - 1)
    for s in range(p - 1):                       # every input goes once round the ring
        call.wait(call.sendrecv(s, passing, right, inbox, left))
        combine(acc, inbox, out=acc)             # add what came in, in the order it came
        passing, inbox = inbox, passing
    call.done()
    return acc.reshape(np.shape(x))


def all_reduce_doubling(g, x, op="sum"):
    combine = COMBINE[op]
    p, r = g.size, g.rank
    acc = fresh_copy(x)
    if p == 1 or acc.size == 0:
        return acc.reshape(np.shape(x))
    q = 1
    while 2 * q <= p:                            # the largest power of two <= p
        q *= 2
    rounds = q.bit_length() - 1
    extra = p - q                                # ranks q .. p-1 sit out the doubling
    call = g.begin("all_reduce", rounds + (2 if extra else 0))
    inbox = np.empty_like(acc)
    if r >= q:                                   # hand my x to rank r - q, wait for the answer
        call.wait(call.isend(0, acc, r - q))
        call.wait(call.irecv(rounds + 1, acc, r - q))
        call.done()
        return acc.reshape(np.shape(x))
    if r < extra:                                # fold rank r + q's x into mine first
        call.wait(call.irecv(0, inbox, r + q))
        combine(acc, inbox, out=acc)
    for k in range(rounds):                      # swap everything with r ^ 2^k, combine
        partner = r ^ (1 << k)
        call.wait(call.sendrecv(k + 1, acc, partner, inbox, partner))
        combine(acc, inbox, out=acc)             # both partners add the same two arrays
    if r < extra:                                # and hand rank r + q the result
        call.wait(call.isend(rounds + 1, acc, r + q))
    call.done()
    return acc.reshape(np.shape(x))
