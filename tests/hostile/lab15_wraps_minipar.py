# hostile: lab 15's functions defined in the file, each handing the work to minipar's own routing and dispatch
# lab: 15
# scan: import from minipar.model: not a module this lab's handout gives
# sandbox: minipar's own minipar.model.moe.top_k was called
import numpy as np

from minipar import comm
from minipar.autograd.tensor import Tensor
from minipar.model import moe
from minipar.parallel.expert import expert_parallel


def top_k(logits, k, router="switch"):
    return moe.top_k(logits, k, router)


def capacity(tokens, k, experts, factor):
    return moe.capacity(tokens, k, experts, factor)


def claim_slots(choice, experts, cap):
    return moe.claim_slots(choice, experts, cap)


def assignments(choice, kept, experts):
    return moe.assignments(moe.Decisions(choice=choice, kept=kept), experts)


def dispatch(g, x, tokens, rows):
    P = g.size
    rows = np.asarray(rows, dtype=np.int64)
    got = comm.all_to_all(g, x[tokens], sizes=list(rows.reshape(P, -1).sum(1)))
    counts = comm.all_to_all(g, rows).reshape(P, -1)
    return got[expert_parallel.expert_major(counts)], counts


def send_back(g, out, counts):
    order = np.argsort(expert_parallel.expert_major(counts))
    return comm.all_to_all(g, out[order], sizes=list(np.asarray(counts).sum(1)))


def combine(rows, tokens, slots, weights, n):
    return moe.combine(Tensor(rows), tokens, slots, Tensor(weights), n).data
