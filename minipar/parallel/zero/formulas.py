"""ZeRO stages 1, 2 and 3 over the data-parallel group (Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", 2020; DeepSpeed): the bytes a rank
holds and sends, as formulas.

Plain data parallelism keeps N identical copies of everything: parameters, gradients and
the optimizer state. ZeRO gives each of the N dp ranks 1/N of the model states instead:

    what each rank keeps (bytes, P parameters, 2-byte storage, fp32 Adam):  params  grads  optimizer
    stage 0  (plain dp, --zero 0)                                   16P  =  2P   +  2P  +  12P
    stage 1  optimizer state sharded                          4P + 12P/N =  2P   +  2P  +  12P/N
    stage 2  + gradients sharded                              2P + 14P/N =  2P   +  2P/N + 12P/N
    stage 3  + parameters sharded                                  16P/N =  2P/N +  2P/N + 12P/N
In fp32 (and float64) the same shapes hold with 4 (8)-byte parameters and gradients and an
8P (16P) optimizer (m and v; the parameters are their own master weights).
"""
from __future__ import annotations

import numpy as np

from minipar.comm.helpers import shaped
from minipar.parallel.zero.quantize import wire_bytes


def formula(stage: int, P: int, P_pad: int, N: int, itemsize: int, K: int) -> dict:
    """Bytes per rank of each model state (the table above): `itemsize`-byte parameters and
    gradients, K optimizer bytes per parameter; P the rank's parameters, P_pad with every
    unit padded for N ranks. The planner (minipar/plan/memory.py) takes its memory table from here."""
    params = itemsize * (P if stage == 0 else P_pad // N if stage == 3 else P_pad)
    grads = itemsize * (P if stage == 0 else P_pad // N if stage >= 2 else P_pad)
    optimizer = K * (P if stage == 0 else P_pad // N)
    text = {0: "{s}P + {s}P + {K}P", 1: "{s}P + {s}P + {K}P/N", 2: "{s}P + {s}P/N + {K}P/N",
            3: "{s}P/N + {s}P/N + {K}P/N"}[stage].format(s=itemsize, K=K)
    return {"params": params, "grads": grads, "optimizer": optimizer, "text": text}


def gathered_peak(outer: int, blocks: list, K: int, reshard_after_forward: bool) -> int:
    """Stage 3: bytes of gathered parameters in use at the peak of a step (stage3.py's
    prefetch and reshard-after-forward): the embedding-side units (`outer` bytes, gathered
    from embed to head and again from head's backward to embed's), and the blocks' (`blocks`,
    bytes of each, in model order): the largest K+1 consecutive ones, a block's and the K
    prefetched after it; every block with reshard_after_forward off (all kept for backward)."""
    if not blocks:
        return outer
    if not reshard_after_forward:
        return outer + sum(blocks)
    w = min(K + 1, len(blocks))
    return outer + max(sum(blocks[i:i + w]) for i in range(len(blocks) - w + 1))


def collectives_per_step(stage: int, M: int, reshard_after_forward: bool = True) -> tuple[int, int]:
    """(reduce-scatters, all-gathers) of each unit in one step of M micro-batches ("One
    step" in stage1.py, stage2.py and stage3.py): stage 1 one of each; stage 2 a
    reduce-scatter per micro-batch and one all-gather; stage 3 per micro-batch a
    reduce-scatter and two all-gathers (forward's and backward's); stage 0, plain dp's
    all-reduce, as much as one of each. Stage 3 with reshard_after_forward off: the forward's
    all-gather only, M."""
    return {0: (1, 1), 1: (1, 1), 2: (M, 1), 3: (M, (2 if reshard_after_forward else 1) * M)}[stage]


def traffic_theory(stage: int, P_pad: int, N: int, itemsize: int, M: int, R: int = 1,
                   reshard_after_forward: bool = True) -> float:
    """Bytes one rank sends per step for its gradient and parameter collectives: a
    reduce-scatter or all-gather of n bytes over the N ranks of a shard group sends
    (N-1)/N * n; with hybrid sharding (hybrid.py, R shard groups) the shard's all-reduce
    across its R replicas adds 2(R-1)/R * n/N once a step (the bandwidth algorithms'; a
    small shard's recursive doubling sends log2(R) * n/N: comm.sent, which the trainer asks)."""
    calls = sum(collectives_per_step(stage, M, reshard_after_forward))
    return (calls * (N - 1) / N + 2 * (R - 1) / R / N) * itemsize * P_pad


def calls_of(stage: int, u, itemsize: int, M: int, reshard_after_forward: bool = True, wire=None) -> list:
    """[(operation, group, stand-in array, calls per step)] of one unit u (units.Unit) in a step
    of M micro-batches: its reduce-scatters of the whole (n_pad,) gradient and all-gathers of
    the (n_pad/N,) shard on its group, with hybrid sharding the shard's all-reduce across the
    replicas, once; with ZeRO++ (wire: zpp.Wire) the all-gathers of qwZ's packed codes, hpZ's
    backward all-gathers of the n_pad/k secondary shards inside the host, and qgZ's two
    all-to-alls of packed pieces in place of the reduce-scatter. What comm.sent is asked, to
    the byte."""
    rs, ag = collectives_per_step(stage, M, reshard_after_forward)
    whole, piece = shaped((u.n_pad,), itemsize), shaped((u.shard_size,), itemsize)
    out = [("all_reduce", u.replicas, piece, 1)] if u.replicas is not None else []
    if wire is None or not wire.on:
        return [("reduce_scatter", u.group, whole, rs), ("all_gather", u.group, piece, ag)] + out
    codes = _bytes((wire_bytes(u.shard_size, wire.qwz),)) if wire.qwz else piece
    backward = ag - M                                # stage 3: backward's all-gathers (0 with reshard off)
    out.append(("all_gather", u.group, codes, ag - (backward if wire.hpz else 0)))
    if wire.hpz and backward:
        out.append(("all_gather", u.local, shaped((u.n_pad // u.local.size,), itemsize), backward))
    if not wire.qgz:
        return out + [("reduce_scatter", u.group, whole, rs)]
    w, H = wire_bytes(u.shard_size, wire.qgz), u.group.n_nodes
    out.append(("all_to_all", u.local, _bytes((u.local.size, H * w)), rs))
    return out + ([("all_to_all", u.cross, _bytes((H, w)), rs)] if u.cross is not None else [])


def _bytes(shape: tuple):
    """A uint8 stand-in of this shape that holds no memory (packed codes)."""
    return np.broadcast_to(np.zeros((), dtype=np.uint8), shape)
