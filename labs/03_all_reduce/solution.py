"""Lab 03, solved by hand as a student would: two plain loops over one Call each (minipar's
own, in minipar/comm/algorithms/ring.py and doubling.py, are generators that a non-blocking Handle can
also drive). This ring numbers its pieces one further on than minipar's: at step s rank r
sends piece (r - s) and ends the reduce-scatter owning piece r + 1; any numbering works as
long as every rank follows the same one."""
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
    at = edges(acc.size, p)
    piece = lambda i: acc[at[i % p]:at[i % p + 1]]                   # noqa: E731
    right, left = (r + 1) % p, (r - 1) % p
    inbox = np.empty(at[1] - at[0], acc.dtype)                       # the largest piece
    call = g.begin("all_reduce", 2 * (p - 1))
    # reduce-scatter: pass a partial sum to the right, add my copy to the one from the left
    for s in range(p - 1):
        got = inbox[:piece(r - s - 1).size]
        call.wait(call.sendrecv(s, piece(r - s), right, got, left))
        combine(piece(r - s - 1), got, out=piece(r - s - 1))
    # piece r + 1 is now complete here; all-gather: pass on what came in last
    for s in range(p - 1):
        call.wait(call.sendrecv(p - 1 + s, piece(r + 1 - s), right, piece(r - s), left))
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
