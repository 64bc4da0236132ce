"""Lab 15, solved by hand as a student would: the router's top-k, the capacity and its claim
order, the dispatch order, the expert-parallel dispatch and its way back, and the weighted
combine, as plain loops and NumPy."""
import math

import numpy as np

from minipar import comm


def top_k(logits, k, router="switch"):
    z = np.asarray(logits, dtype=np.float64)
    e = np.exp(z - z.max(axis=1, keepdims=True))             # the max first: exp(1000) overflows
    p = e / e.sum(axis=1, keepdims=True)
    order = np.argsort(-p, axis=1, kind="stable")          # stable: equal p keep the lower id first
    choice = order[:, :k].astype(np.int64)
    picked = np.take_along_axis(p, choice, axis=1)
    if k > 1 or router == "mixtral":
        weights = picked / picked.sum(axis=1, keepdims=True)
    else:
        weights = picked                                   # Switch's k = 1: p itself
    return choice, weights


def capacity(tokens, k, experts, factor):
    if factor <= 0:
        return None
    return int(math.ceil(factor * tokens * k / experts))


def claim_slots(choice, experts, cap):
    N, K = choice.shape
    kept = np.ones((N, K), dtype=bool)
    if cap is None:
        return kept
    used = [0] * experts
    for k in range(K):                                     # every first choice, then every second, ...
        for n in range(N):                                 # in token order
            e = int(choice[n, k])
            if used[e] < cap:
                used[e] += 1
            else:
                kept[n, k] = False
    return kept


def assignments(choice, kept, experts):
    N, K = choice.shape
    tokens, slots = [], []
    rows = np.zeros(experts, dtype=np.int64)
    for e in range(experts):
        for k in range(K):
            for n in range(N):
                if kept[n, k] and choice[n, k] == e:
                    tokens.append(n)
                    slots.append(n * K + k)
                    rows[e] += 1
    return np.array(tokens, dtype=np.int64), np.array(slots, dtype=np.int64), rows


def expert_major(counts):
    """counts (P, El): received rows come source by source, each source's in expert order;
    the permutation that lists them expert by expert, each expert's in source order."""
    P, El = counts.shape
    start = np.zeros((P, El), dtype=np.int64)
    at = 0
    for s in range(P):
        for j in range(El):
            start[s, j] = at
            at += counts[s, j]
    order = [start[s, j] + i for j in range(El) for s in range(P) for i in range(counts[s, j])]
    return np.array(order, dtype=np.int64)


def dispatch(g, x, tokens, rows):
    P = g.size
    El = len(rows) // P
    send = x[tokens]                                       # already grouped by expert, so by rank
    sizes = [int(np.sum(rows[j * El:(j + 1) * El])) for j in range(P)]
    got = comm.all_to_all(g, send, sizes=sizes)
    mine = np.asarray(rows, dtype=np.int64).reshape(P, El)  # row j: what I send to rank j's experts
    counts = comm.all_to_all(g, mine.reshape(-1)).reshape(P, El)
    return got[expert_major(counts)], counts


def send_back(g, out, counts):
    counts = np.asarray(counts, dtype=np.int64)
    source_major = np.empty_like(out)
    source_major[expert_major(counts)] = out               # undo the expert-major order
    sizes = [int(n) for n in counts.sum(axis=1)]
    return comm.all_to_all(g, source_major, sizes=sizes)


def combine(rows, tokens, slots, weights, n):
    K = weights.shape[1]
    y = np.zeros((n, rows.shape[1]), dtype=rows.dtype)
    for m in range(len(tokens)):
        t, s = int(tokens[m]), int(slots[m])
        y[t] += weights[s // K, s % K] * rows[m]
    return y
