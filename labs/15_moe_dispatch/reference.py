"""Lab 15 answered by minipar's own code (python -m labs.grade 15 --solution): moe.top_k,
moe.capacity, moe.claim_slots, moe.assignments and moe.combine, and the dispatch and way back
of expert_parallel.run_experts (its path without a capacity: comm.all_to_all with the rows per
rank, the experts' row counts by an equal all-to-all, expert_parallel.expert_major) behind the
lab's signatures."""
import numpy as np

from minipar import comm
from minipar.autograd.tensor import Tensor
from minipar.model import moe
from minipar.parallel.expert import expert_parallel

top_k = moe.top_k
capacity = moe.capacity
claim_slots = moe.claim_slots
# bound now: in the trainer the seam puts these functions at moe.assignments and moe.combine
_assignments, _combine = moe.assignments, moe.combine


def assignments(choice, kept, experts):
    return _assignments(moe.Decisions(choice=choice, kept=kept), experts)


def dispatch(g, x, tokens, rows):
    P = g.size
    rows = np.asarray(rows, dtype=np.int64)
    got = comm.all_to_all(g, x[tokens], sizes=list(rows.reshape(P, -1).sum(1)))
    counts = comm.all_to_all(g, rows).reshape(P, -1)
    return got[expert_parallel.expert_major(counts)], counts


def send_back(g, out, counts):
    counts = np.asarray(counts, dtype=np.int64)
    return comm.all_to_all(g, out[np.argsort(expert_parallel.expert_major(counts))], sizes=list(counts.sum(1)))


def combine(rows, tokens, slots, weights, n):
    return _combine(Tensor(rows), tokens, slots, Tensor(weights), n).data
