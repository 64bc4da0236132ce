"""Lab 19 answered by minipar's own code (python -m labs.grade 19 --solution): the layout of
minipar/parallel/tensor/tensor_parallel.py behind the lab's signatures. kv_share refuses what
cannot be split; TensorParallelGPT.shard, applied to a row of column numbers, says which columns
of q_proj, k_proj and v_proj a rank keeps; the sum is SumGradOver's all-reduce (comm.all_reduce,
what tp_all_reduce runs) over the ranks that hold the head, on a communicator split off the tp
group as TensorParallelGPT splits one."""
from types import SimpleNamespace

import numpy as np

from minipar import comm
from minipar.model.llama import FAMILY as LLAMA
from minipar.parallel.tensor import tensor_parallel as tpar

Q, K, V = (f"layers.0.self_attn.{n}_proj.weight" for n in "qkv")
SHARD = tpar.TensorParallelGPT.shard            # minipar's own, before the lab's seam puts ours there


def layout(n_head, n_kv_head, tp, rank):
    """A stand-in for a tensor-parallel model of these head counts on `rank`: what its shard()
    reads (kv_share raises ValueError for a split it cannot make)."""
    if n_kv_head < 1 or n_head % n_kv_head:
        raise ValueError(f"n_head {n_head} is not a multiple of n_kv_head {n_kv_head}")
    cfg = SimpleNamespace(n_head=n_head, kv_heads=n_kv_head, hidden=tp, family=LLAMA)
    share = tpar.kv_share(cfg, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not a rank of a tp group of {tp}")
    shapes = {Q: (1, n_head), K: (1, n_kv_head), V: (1, n_kv_head)}
    return SimpleNamespace(cfg=cfg, tp_rank=rank, tp_size=tp, kv_share=share, full_shapes=shapes)


def held(model, name, width):
    """The column numbers of canonical tensor `name` that the model's rank keeps."""
    return [int(c) for c in SHARD(model, name, np.arange(width)[None, :]).reshape(-1)]


def rank_heads(n_head, n_kv_head, tp, rank):
    m = layout(n_head, n_kv_head, tp, rank)
    return held(m, Q, n_head), held(m, K, n_kv_head)


def qkv_columns(n_head, n_kv_head, head_size, tp, rank):
    q, kv = rank_heads(n_head, n_kv_head, tp, rank)
    hs = head_size
    starts = [h * hs for h in q] + [(n_head + j) * hs for j in kv] + [(n_head + n_kv_head + j) * hs for j in kv]
    return np.array([s + c for s in starts for c in range(hs)], dtype=np.int64)


def kv_groups(n_head, n_kv_head, tp):
    layout(n_head, n_kv_head, tp, 0)
    return [[r for r in range(tp) if j in rank_heads(n_head, n_kv_head, tp, r)[1]] for j in range(n_kv_head)]


def sum_kv_grad(g, grad, ranks):
    sub = comm.Group.split(g.comm, min(ranks), g.rank)
    try:
        x = np.array(grad, copy=True)                   # tp_all_reduce's all-reduce (the seam counts the call)
        return np.array(x if sub.size == 1 else comm.all_reduce(sub, x, op="sum"), copy=True)
    finally:
        sub.comm.Free()
