"""Lab 19, solved by hand as a student would: the heads from the query heads (a rank's key/value
heads are those its query heads read), the groups from the heads, and the sum as a pairwise
exchange inside the group, added up in the group's order (minipar's own layout is in
minipar/parallel/tensor/tensor_parallel.py, its sum an all-reduce over a split communicator)."""
import numpy as np


def check(n_head, n_kv_head, tp):
    """ValueError, in one line, for a split tensor parallelism cannot make."""
    if n_kv_head < 1 or n_head % n_kv_head:
        raise ValueError(f"n_head {n_head} is not a multiple of n_kv_head {n_kv_head}")
    if tp < 1 or n_head % tp:
        raise ValueError(f"tp {tp} does not divide n_head {n_head}: each rank holds n_head/tp whole query heads")
    if n_kv_head % tp and tp % n_kv_head:
        raise ValueError(f"tp {tp} and n_kv_head {n_kv_head}: tp must divide n_kv_head (each rank its own "
                         f"key/value heads) or n_kv_head divide tp (each head on tp/n_kv_head ranks)")


def rank_heads(n_head, n_kv_head, tp, rank):
    check(n_head, n_kv_head, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not a rank of a tp group of {tp}")
    per = n_head // tp
    g = n_head // n_kv_head                         # query heads per key/value head
    q = list(range(rank * per, (rank + 1) * per))
    kv = sorted({h // g for h in q})                # the key/value heads my query heads read
    return q, kv


def qkv_columns(n_head, n_kv_head, head_size, tp, rank):
    q, kv = rank_heads(n_head, n_kv_head, tp, rank)
    hs = head_size

    def cols(heads, start):
        return [start + h * hs + c for h in heads for c in range(hs)]

    return np.array(cols(q, 0) + cols(kv, n_head * hs) + cols(kv, (n_head + n_kv_head) * hs), dtype=np.int64)


def kv_groups(n_head, n_kv_head, tp):
    check(n_head, n_kv_head, tp)
    groups = [[] for _ in range(n_kv_head)]
    for r in range(tp):
        for j in rank_heads(n_head, n_kv_head, tp, r)[1]:
            groups[j].append(r)
    return groups


def sum_kv_grad(g, grad, ranks):
    ranks = sorted(ranks)
    m, me = len(ranks), ranks.index(g.rank)
    flat = np.ascontiguousarray(grad).reshape(-1)
    parts = [None] * m
    parts[me] = flat
    call = g.begin("kv_grads", m - 1)
    for k in range(1, m):                           # round k: to the k-th next, from the k-th previous
        src = (me - k) % m
        buf = np.empty_like(flat)
        call.wait(call.sendrecv(k - 1, flat, ranks[(me + k) % m], buf, ranks[src]))
        parts[src] = buf
    call.done()
    total = parts[0].copy()
    for a in parts[1:]:                             # the group's order: the same sum on every rank
        total += a
    return total.reshape(np.shape(grad))
