# hostile: lab 19's functions defined in the file, each answering with minipar's own layout (kv_share, TensorParallelGPT.shard) and sum (tp_all_reduce)
# lab: 19
# scan: from minipar.parallel.tensor import tensor_parallel as tpar: import from minipar.parallel.tensor: not a module this lab's handout gives
# sandbox: minipar's own minipar.parallel.tensor.tensor_parallel.kv_share
import numpy as np

from minipar import comm
from minipar.model.llama import FAMILY
from minipar.parallel.tensor import tensor_parallel as tpar


class Bag:
    """A stand-in for a config and a model: what kv_share and shard() read."""


def model(n_head, n_kv_head, tp, rank):
    cfg, m = Bag(), Bag()
    cfg.n_head, cfg.kv_heads, cfg.hidden, cfg.family = n_head, n_kv_head, tp, FAMILY
    m.cfg, m.tp_rank, m.tp_size, m.kv_share = cfg, rank, tp, tpar.kv_share(cfg, tp)
    m.full_shapes = {f"layers.0.self_attn.{n}_proj.weight": (1, n_head if n == "q" else n_kv_head) for n in "qkv"}
    return m


def rank_heads(n_head, n_kv_head, tp, rank):
    m = model(n_head, n_kv_head, tp, rank)
    return tuple([int(c) for c in tpar.TensorParallelGPT.shard(m, f"layers.0.self_attn.{n}_proj.weight",
                                                                np.arange(w)[None, :]).reshape(-1)]
                 for n, w in (("q", n_head), ("k", n_kv_head)))


def qkv_columns(n_head, n_kv_head, head_size, tp, rank):
    q, kv = rank_heads(n_head, n_kv_head, tp, rank)
    starts = [h * head_size for h in q] + [(n_head + j) * head_size for j in kv] + \
        [(n_head + n_kv_head + j) * head_size for j in kv]
    return np.array([s + c for s in starts for c in range(head_size)], dtype=np.int64)


def kv_groups(n_head, n_kv_head, tp):
    return [[r for r in range(tp) if j in rank_heads(n_head, n_kv_head, tp, r)[1]] for j in range(n_kv_head)]


def sum_kv_grad(g, grad, ranks):
    sub = comm.Group.split(g.comm, min(ranks), g.rank)
    return np.array(tpar.tp_all_reduce(sub, np.array(grad, copy=True), "sum", "kv_grads"), copy=True)
