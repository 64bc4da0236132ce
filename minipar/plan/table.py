"""The planner: what does training this model on this layout cost, per device?

    python -m minipar.plan --model gpt2-large --dp 2 --tp 4 --pp 4 --precision fp16
    python -m minipar.plan --n-layer 2 --n-embd 64 --dp 2 --tp 2      # the trainer's flags
    python -m minipar.plan --params 7.5e9 --dp 64 --zero 3 --precision fp16   # model states only
    python -m minipar.plan --model gpt2 --cp 4 --memory-budget 16GiB          # the longest T that fits
    python -m minipar.plan --model gpt2 --moe-experts 8 --moe-every 2 --dp 8 --ep 4   # mixture of experts

Layout flags are the trainer's (same names, same defaults), so one set of flags describes
one run; tests/test_plan*.py hold every figure to what minipar measures on such runs.
Where a mechanism has a formula of its own, the planner calls it rather than restating it:
pipeline.local_tensors (what a device holds), zero.formula and zero.collectives_per_step
(ZeRO's memory and collectives), tensor_parallel.megatron_calls, schedules.bubble_theory,
activations.peak_in_flight_bytes, the schedule's instructions (schedules.schedule),
ring_attention.ring_traffic (context parallelism's bytes), expert_parallel.ep_bytes (the
all-to-alls'), model.train_flops_per_token (FLOPs per token, active parameters).

Context parallelism (--cp, docs/design.md §6): world = dp*cp*tp*pp; each rank keeps T/cp
tokens of every sequence (zig-zag or contiguous, the same bytes either way), so
    activations  per token on T/cp tokens, ring attention's q, k, v, o, lse instead of the
                 T x T softmax (activations.py's second table: d sbh/c (4 + 2/h + 17/t + a/ht))
    dp           gradients are summed, and ZeRO shards, over dp*cp ranks (ProcessGrid.grad_group):
                 the dp formulas below with p = dp*cp
    tp, pp       their messages carry b*(T/cp)*C instead of b*T*C
    cp           per micro-batch and layer of the device, one ring attention call:
                 ring_traffic(n, cp, compute itemsize, forwards)[1], n = b*(T/cp)*C/tp,
                 forwards 2 with --recompute full (the forward runs again in backward)
    FLOPs        T/cp of the T rows of every product (the ring computes all cp key blocks of
                 a query block, masked afterwards: T/cp x T, as minipar's T x T products are)

Memory per device (ZeRO, Rajbhandari et al. 2020, arXiv:1910.02054, section 3):
    s   bytes per stored parameter and gradient (`itemsize`): 4 (fp32), 8 (float64),
        2 (fp16, bf16)
    K   optimizer bytes per parameter: AdamW's m and v, 2s; fp16/bf16 12 (fp32 master, m, v),
        which gives the paper's 2P + 2P + KP with K = 12
    P_local  parameters the device holds after tp and pp slicing (pipeline.local_tensors):
             the stage's tensors (schedules.stage_param_names; the last stage keeps a copy
             of a tied wte), split ones / tp, vocabulary ones padded to Vp = tp*ceil(V/tp)
             rows first
    P_pad    ZeRO's layout: P_local cut into units (zero.unit_names), each padded to a
             multiple of N = dp*cp (zero.padded)
                   params        grads         optimizer        (zero.formula)
        zero 0     s P_local     s P_local     K P_local
        zero 1     s P_pad       s P_pad       K P_pad / N
        zero 2     s P_pad       s P_pad / N   K P_pad / N
        zero 3     s P_pad / N   s P_pad / N   K P_pad / N
    (fp16, no padding: 16P, 4P + 12P/N, 2P + 14P/N, 16P/N.)
    activations: the bytes minipar's ops save for backward (activation_bytes), per
    micro-batch of b = B/(dp*M) sequences, at the stage's peak: its own instruction list
    walked, + a chunk's bytes at each Forward, - at its Backward (at its WeightGrad with
    zb-h1/zb-h2), the largest sum (activations.peak_in_flight_bytes). Whole micro-batches
    for V = 1: 1 without a pipeline and with the naive schedule, M with GPipe,
    min(M, pp - stage) with 1F1B; --virtual-stages V > 1 counts chunk-micro-batches.

FLOPs of a forward pass over one sequence of T tokens, the count of Hoffmann et al.
2022 (arXiv:2203.15556, "Chinchilla", appendix F), C channels, H heads, V vocabulary, 4C MLP width:
    embeddings 2TVC;  per layer: K,Q,V projections 2*3TCC, key-query logits 2TTC,
    softmax 3HTT, softmax-value reduction 2TTC, final linear 2TCC, dense block 2T(4CC + 4CC);
    final logits 2TCV.   backward = 2 x forward;  6ND beside it (N params, D = B*T).
All but the embeddings (a row lookup in minipar) and the softmax are matmuls that minipar
runs exactly so (the T x T products in full, masked afterwards); 3x their sum is
model.train_flops_per_token. Per device: the stage's layers (all its chunks' with
--virtual-stages: schedules.rank_layers; embeddings on the first, logits on the last), / tp
(heads, MLP columns, Vp/tp vocabulary rows), B/dp sequences.

Communication: bytes one device sends per step (dp, cp and tp rank 0 of each stage), as
minipar.comm's ledger counts them (all_reduce_sent and friends below follow comm/):
    dp     zero 0: the gradient buckets, each all-reduced once per step (2(p-1)/p n, or
           recursive doubling's log2(p) n up to 64 KiB); with ZeRO, unit by unit of its
           padded size: zero 1 reduce-scatter + all-gather once, zero 2 a reduce-scatter
           per micro-batch + one all-gather, zero 3 per micro-batch 2 all-gathers + 1
           reduce-scatter, (p-1)/p n each (zero.collectives_per_step)
    tp     per micro-batch Megatron's 4 all-reduces per layer of b*T*C, the embedding's g,
           the head's f and the vocab-parallel cross-entropy's 3 of b*T (4L + 5 in all,
           tensor_parallel.megatron_calls), and the 8-byte gradient-norm all-reduce once
           per step
    pp     one message per SendActivation and SendGrad of the stage's instruction list
           (b*T*C*s, /tp with --sp, + a 128-byte header each): M down and M up per
           boundary, V times as many with --virtual-stages V (rank pp-1's chunks send to
           rank 0's next, round the ring); the tied wte gradient between the two ends
           (with ZeRO: the rank's shard of it), the loss broadcast
    other  8-byte all-reduces: the loss over dp, the gradient norm over pp and over dp
           (ZeRO: each rank squares its shard; bucketed dp: its piece of each bucket;
           not with --dp-mode naive), the fp16/bf16 overflow flag over the world
    cp     context parallelism's ring attention (above)
bubble: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/p for the naive schedule, (p-1)/(Vm+p-1)
interleaved, (p-1)/(3m+p-1) for zb-h1 and zb-h2 (schedules.bubble_theory, every op of one length).

Across hosts (--ranks-per-host K: rank r on host r // K): the same calls, walked message by
message on the device's real groups with the algorithm comm's dispatcher picks there (the
hierarchical one for large messages on a group with several ranks on some host), split into
bytes inside the host and across hosts, and timed with --inter-node-gbps, --intra-node-gbps
and --inter-node-latency-us: minipar/plan/hosts.py. The cp ring and the ep group are placed too:
every ring message goes to the next cp rank, each all-to-all's messages follow the algorithm
comm picks (the hierarchical all-to-all for small ones on an ep group that spans hosts).

Mixture of experts (--moe-experts E --moe-top-k K --moe-every N --moe-capacity-factor F,
--ep P: moe.py, parallel/expert_parallel.py): block i is a MoE block when (i + 1) % N == 0,
its MLP replaced by a router (C, E) and E expert MLPs; a rank's micro-batch of n = b*T
tokens is one routing group, cap = ceil(F n K / E) slots per expert (moe.capacity).
    parameters   total (every expert) and active per token (the K experts' MLPs and the
                 router of each MoE block, not all E: active_params)
    memory       a rank holds E/P experts of each MoE block (ep rank 0: the first E/P,
                 device_tensors); with --tp every tp rank holds them whole (the MoE layer
                 is replicated over tp); the rest as before. Activations of a MoE layer:
                 activations.py's third table, balanced routing assumed where it depends on
                 the data
    FLOPs        per token: K experts' MLPs and the router per MoE block
                 (model.train_flops_per_token); per device not divided by tp
    dp, ZeRO     ExpertParallelSync: the non-expert gradients summed over the dp group, each
                 expert's over its dp/P replicas, each bucketed on its own; ZeRO: each
                 block's experts a unit of their own, padded for and sharded over the
                 replicas, the rest over dp (sync_groups)
    tp           a MoE block has attention's f and g only (2 all-reduces, not 4)
    ep           per MoE layer of the device and micro-batch, 4 all-to-alls (6 with
                 --recompute full): expert_parallel.ep_bytes. With a capacity the padded
                 (E cap, C) tensor, exact; without, balanced routing's n K (P-1)/P rows each
                 way plus the row counts (the real figure depends on the routing; the
                 trainer's summary prints it beside ep_bytes of the rows it routed)
    other        the gradient norm without ZeRO: the experts' sum of squares all-reduced
                 over ep, not over dp (the other gradients are the same on every dp rank)

The sequence-length ceiling (--memory-budget M): the longest T, a multiple of 2*cp (and of
tp with --sp), whose per-device peak (model states + activations at the schedule's peak,
the largest stage's) fits in M, for cp = 1 and for the given cp, each with the same dp, tp,
pp (the learned positions' table grows with T: the planner takes the block size to be T).
The peak only grows with T (activations per token times T, the softmax's T^2, wpe's T*C
parameters, ZeRO's padding of them), so the search is a bisection: double T from 2*cp
while it fits, then halve the interval between the last T that fits and the first that does not.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys

import numpy as np

from minipar.plan import activations, hosts as plan_hosts
from minipar import comm
from minipar.config import flags as config
from minipar.model import moe
from minipar.optim import mixed_precision
from minipar.autograd import recompute
from minipar.comm.algorithms import direct, tree
from minipar.comm.helpers import split_offsets
from minipar.comm.protocol import HEADER_BYTES
from minipar.model.gpt import GPTConfig, param_specs, train_flops_per_token
from minipar.parallel.context import context_parallel
from minipar.parallel import data_parallel
from minipar.parallel.expert import expert_parallel
from minipar.parallel.pipeline import stage as pipeline, schedules
from minipar.parallel.tensor import sequence_parallel, tensor_parallel
from minipar.parallel.zero import sharded as zero
from minipar.parallel.grid import LayoutError, check_layout
from minipar.parallel.context.ring_attention import LAYOUTS
from minipar.plan.peak import human_bytes

PRESETS = {   # name: (n_layer, n_head, n_embd, vocab_size, block_size)
    "gpt2": (12, 12, 768, 50257, 1024),
    "gpt2-medium": (24, 16, 1024, 50257, 1024),
    "gpt2-large": (36, 20, 1280, 50257, 1024),
    "gpt2-xl": (48, 25, 1600, 50257, 1024),
    "gpt3-175b": (96, 96, 12288, 50257, 2048),
}
SHAPE_FLAGS = ("vocab_size", "n_layer", "n_head", "n_embd", "block_size")
MOE_FLAGS = ("moe_experts", "moe_top_k", "moe_every", "moe_capacity_factor")
INT64 = 8                 # token ids, and the 8-byte scalars (loss, norms, flags) on the wire


class PlanError(config.ConfigError):
    """Flags that describe no run: one line on stderr, exit code 2 (the checks shared with
    the trainer raise its ConfigError)."""


# --- what a device holds ----------------------------------------------------------------------

def device_tensors(cfg: GPTConfig, lay, stage: int) -> list:
    """[(name, elements)] a device of `stage` holds (dp rank 0): pipeline.local_tensors, and
    with --ep P only its ep rank's experts of each MoE block, E/P of them (ep rank 0 holds
    experts 0 .. E/P - 1: expert_parallel.ExpertPlacement)."""
    tensors = pipeline.local_tensors(cfg, stage, lay.pp, lay.tp, chunks(lay))
    per_rank = cfg.moe_experts // lay.ep if lay.ep > 1 else None
    return [(n, k) for n, k in tensors
            if per_rank is None or expert_parallel.expert_of(n) is None or expert_parallel.expert_of(n) < per_rank]


def active_params(cfg: GPTConfig) -> int:
    """Parameters a token goes through: all but the experts it is not routed to, i.e. in each
    MoE block the router and K expert MLPs (experts 0 .. K-1 stand for any K: all have the
    same shapes) instead of E."""
    def active(name):
        e = expert_parallel.expert_of(name)
        return e is None or e < cfg.moe_top_k
    return sum(math.prod(shape) for name, shape, _ in param_specs(cfg) if active(name))


def sync_groups(tensors: list, lay) -> list:
    """[(tensors, layout)]: the device's tensors and the ranks their gradients are summed (and
    ZeRO-sharded) over, the layout's grad_ranks. With --ep two sets: the non-expert tensors
    over dp (x cp), and the experts' over their dp/ep replicas (grid.expert_group: the
    layout with dp = dp/ep)."""
    if lay.ep == 1:
        return [(tensors, lay)]
    experts = [(n, k) for n, k in tensors if expert_parallel.expert_of(n) is not None]
    others = [(n, k) for n, k in tensors if expert_parallel.expert_of(n) is None]
    return [(others, lay), (experts, lay.but(dp=lay.dp // lay.ep))]


def zero_units(tensors: list, N: int) -> list:
    """Element count of each ZeRO unit (zero.unit_names) of the device, padded for N ranks."""
    size = dict(tensors)
    return [zero.padded(sum(size[n] for n in unit), N) for unit in zero.unit_names([n for n, _ in tensors])]


def model_states(P_local: int, P_pad: int, itemsize: int, K: int, zero_stage: int, N: int) -> dict:
    """Bytes of parameters, gradients and optimizer state on one device (zero.formula), and
    their sum."""
    f = zero.formula(zero_stage, P_local, P_pad, N, itemsize, K)
    return {"params": f["params"], "grads": f["grads"], "optimizer": f["optimizer"],
            "model_states": f["params"] + f["grads"] + f["optimizer"]}


def activation_bytes(cfg: GPTConfig, stage: int, pp: int, tp: int, rows: int, itemsize: int,
                     compute_itemsize: int, sp: bool = False, recompute: str = "none") -> int:
    """Bytes one micro-batch of `rows` sequences leaves saved for backward on a device of
    `stage`: activations.stage_bytes (the formula, term by term, and Korthikanti's Table 2)."""
    return activations.stage_bytes(cfg, stage, pp, tp, rows, itemsize, compute_itemsize, sp, recompute)


def chunks(lay) -> int:
    """Model chunks per pipeline rank: --virtual-stages with a pipeline, else 1."""
    return lay.virtual_stages if lay.pp > 1 else 1


def rank_layer_count(cfg: GPTConfig, stage: int, pp: int, n_chunks: int = 1) -> int:
    """Transformer blocks a rank of `stage` holds: all its chunks' (schedules.rank_layers)."""
    return sum(len(r) for r in schedules.rank_layers(cfg.n_layer, stage, pp, n_chunks))


def rank_moe_count(cfg: GPTConfig, stage: int, pp: int, n_chunks: int = 1) -> int:
    """The MoE blocks among them."""
    return sum(cfg.is_moe(i) for r in schedules.rank_layers(cfg.n_layer, stage, pp, n_chunks) for i in r)


# --- FLOPs ------------------------------------------------------------------------------------

def flop_components(cfg: GPTConfig, tp: int = 1, stage: int = 0, pp: int = 1, n_chunks: int = 1,
                    cp: int = 1) -> dict:
    """The Chinchilla appendix F forward FLOPs of one sequence, by component, on one device of
    `stage` (with n_chunks: its chunks' blocks; rank 0 holds virtual stage 0, rank pp-1 pV-1).
    cp: the device's Tq = T/cp query rows of each product, against all T keys.
    A MoE block's dense block is its K active experts' (each token through K expert MLPs)
    plus the router's logits, 2 T C E: replicated over tp, so not divided by it; with --ep a
    device runs K experts' rows per token on average (balanced routing), the same count."""
    T, C, H, V = cfg.block_size, cfg.n_embd, cfg.n_head, cfg.vocab_size
    Tq = T // cp                                          # this device's tokens (queries)
    Vl = V if tp == 1 else -(-V // tp)                    # vocabulary rows on this device
    L = rank_layer_count(cfg, stage, pp, n_chunks)
    n_moe = rank_moe_count(cfg, stage, pp, n_chunks)
    first, last = stage == 0, stage == pp - 1
    mlp = 2 * Tq * (C * 4 * C + 4 * C * C)               # one MLP on the device's tokens
    out = {
        "embeddings": 2 * Tq * Vl * C if first else 0,
        "kqv_projections": L * 2 * 3 * Tq * C * C // tp,
        "key_query_logits": L * 2 * Tq * T * C // tp,
        "softmax": L * 3 * (H // tp) * Tq * T,
        "softmax_value": L * 2 * Tq * T * C // tp,
        "final_linear": L * 2 * Tq * C * C // tp,
        "dense": (L - n_moe) * mlp // tp,
    }
    if cfg.moe_experts:
        out.update(experts=n_moe * cfg.moe_top_k * mlp, router=n_moe * 2 * Tq * C * cfg.moe_experts)
    out["logits"] = 2 * Tq * C * Vl if last else 0
    return out


def flops(components: dict, sequences: int) -> dict:
    """Forward, backward (2x forward) and total FLOPs of `sequences` sequences; the matmul
    part of the forward (all but the embeddings and the softmax); the components."""
    fwd = sequences * sum(components.values())
    matmul = fwd - sequences * (components["embeddings"] + components["softmax"])
    return {"forward": fwd, "backward": 2 * fwd, "total": 3 * fwd, "matmul_forward": matmul,
            "components": {k: sequences * v for k, v in components.items()}}


# --- communication, as minipar.comm sends it ---------------------------------------------------

def pieces(n: int, p: int) -> list:
    """Element counts of np.array_split(range(n), p), the pieces comm cuts (split_offsets)."""
    offsets = split_offsets(n, p)
    return [offsets[i + 1] - offsets[i] for i in range(p)]


def all_reduce_sent(n: int, itemsize: int, p: int, rank: int = 0) -> int:
    """Bytes `rank` sends in comm.all_reduce of n elements on p ranks: recursive doubling up
    to comm.ALL_REDUCE_DOUBLING_MAX_BYTES (log2(q) rounds of the whole message among the
    largest power of two q <= p, + the fix-up hand-overs), else reduce-scatter + all-gather
    of np.array_split pieces: direct exchange up to direct.DIRECT_MAX_RANKS, else the ring."""
    b = n * itemsize
    if p == 1 or n == 0:
        return 0
    if b <= comm.ALL_REDUCE_DOUBLING_MAX_BYTES:
        q = 1 << (p.bit_length() - 1)
        if rank >= q:                                     # hands x over, gets the result back
            return b
        return (q.bit_length() - 1) * b + (b if rank < p - q else 0)
    sizes = pieces(n, p)
    rs = (n - sizes[rank]) * itemsize                     # every piece but its own
    ag = (p - 1) * sizes[rank] if p <= direct.DIRECT_MAX_RANKS else n - sizes[(rank + 1) % p]
    return rs + ag * itemsize


def reduce_scatter_sent(n: int, itemsize: int, p: int, rank: int = 0) -> int:
    """comm.reduce_scatter (direct exchange or ring): every piece but its own."""
    return 0 if p == 1 else (n - pieces(n, p)[rank]) * itemsize


def all_gather_sent(n_each: int, itemsize: int, p: int) -> int:
    """comm.all_gather of equal pieces (Bruck, direct or ring): p - 1 pieces."""
    return (p - 1) * n_each * itemsize


def broadcast_sent(nbytes: int, p: int, rank: int, root: int) -> int:
    """comm.broadcast (tree.py): a 128-byte header down the binomial tree, then the payload
    down the same tree (or a pipelined chain above tree.BROADCAST_TREE_MAX_BYTES)."""
    v = (rank - root) % p
    m = (v & -v) >> 1 if v else (1 << ((p - 1).bit_length() - 1) if p > 1 else 0)
    kids = 0
    while m:
        kids += v + m < p
        m >>= 1
    if nbytes > tree.BROADCAST_TREE_MAX_BYTES and p > 2:
        return kids * HEADER_BYTES + (nbytes if v < p - 1 else 0)
    return kids * (HEADER_BYTES + nbytes)


class Flat:
    """A group of p ranks on one host, the device its rank `rank`: what each call sends from
    the device, by the formulas above. The axis functions below ask their group; on several
    hosts plan_hosts.Placed answers the same calls, message by message."""

    n_nodes = 1

    def __init__(self, p: int, rank: int = 0):
        self.size, self.rank = p, rank

    def all_reduce(self, n: int, itemsize: int) -> int:
        return all_reduce_sent(n, itemsize, self.size, self.rank)

    def reduce_scatter(self, n: int, itemsize: int) -> int:
        return reduce_scatter_sent(n, itemsize, self.size, self.rank)

    def all_gather(self, n_each: int, itemsize: int) -> int:
        return all_gather_sent(n_each, itemsize, self.size)

    def broadcast(self, n: int, itemsize: int, root: int) -> int:
        return broadcast_sent(n * itemsize, self.size, self.rank, root)

    def send(self, nbytes: int, peer: int) -> int:       # comm.send / send_async: header, payload
        return HEADER_BYTES + nbytes


def flat_groups(lay, stage: int) -> dict:
    """The groups of dp, cp and tp rank 0 of `stage`, all on one host; "dp" is the gradient
    group, dp*cp ranks (ProcessGrid.grad_group)."""
    return {"dp": Flat(lay.grad_ranks), "tp": Flat(lay.tp), "pp": Flat(lay.pp, stage),
            "world": Flat(lay.world, stage * lay.grad_ranks * lay.tp)}


def dp_bytes(tensors: list, units: list, lay, itemsize: int, g=None):
    """Gradient synchronisation over the dp group g (data_parallel.py, or ZeRO's units): the
    dp*cp ranks of ProcessGrid.grad_group."""
    N, M = lay.grad_ranks, lay.micro_batches
    if N == 1:
        return 0
    g = Flat(N) if g is None else g
    if lay.zero:
        rs = sum(g.reduce_scatter(n, itemsize) for n in units)
        ag = sum(g.all_gather(n // N, itemsize) for n in units)
        rs_calls, ag_calls = zero.collectives_per_step(lay.zero, M)
        return rs_calls * rs + ag_calls * ag
    if lay.dp_mode == "naive":                            # one all-reduce per parameter
        return sum(g.all_reduce(n, itemsize) for _, n in tensors)
    members = data_parallel.bucket_members([n * itemsize for _, n in tensors], lay.bucket_mb)
    buckets = [sum(tensors[i][1] for i in m) for m in members]     # elements per bucket
    return sum(g.all_reduce(n, itemsize) for n in buckets)


def grad_sync_bytes(tensors: list, lay, itemsize: int, g=None):
    """The dp axis: dp_bytes of each of sync_groups' sets, the non-expert tensors on the dp
    group g, the experts' (with --ep) on their dp/ep replicas: ExpertParallelSync's two
    bucketed synchronisers, or ZeRO's expert units sharded over the replicas."""
    return sum(dp_bytes(ts, zero_units(ts, gl.grad_ranks), gl, itemsize, g if gl is lay else Flat(gl.grad_ranks))
               for ts, gl in sync_groups(tensors, lay))


def tp_bytes(cfg: GPTConfig, stage: int, lay, itemsize: int, compute_itemsize: int, g=None):
    """Megatron's all-reduces of one step on tp rank 0 of the tp group g
    (tensor_parallel.megatron_calls), over the blocks of all the rank's chunks."""
    tp, pp, M = lay.tp, lay.pp, lay.micro_batches
    if tp == 1:
        return 0
    g = Flat(tp) if g is None else g
    rows, T, C = lay.rows, cfg.block_size // lay.cp, cfg.n_embd          # --cp: the rank's T/cp tokens
    n_layers = rank_layer_count(cfg, stage, pp, chunks(lay))
    n_moe = rank_moe_count(cfg, stage, pp, chunks(lay))
    first, last = stage == 0, stage == pp - 1
    if lay.sp:                                            # sequence_parallel.sp_count, by kind
        count = sequence_parallel.sp_count(cfg, rows, T, tp, n_layers, first, last, lay.recompute)
        n = rows * T * C
        gathers = sum(count[k][0] for k in ("f_gather", "g_gather", "regather"))
        scatters = count["f_scatter"][0] + count["g_scatter"][0]
        per_mb = (gathers * g.all_gather(n // tp, itemsize) + scatters * g.reduce_scatter(n, itemsize)
                  + 6 * n_layers * g.all_reduce(C, itemsize)                 # replicated parameters' sums
                  + (2 * g.all_reduce(C, itemsize) + 3 * g.all_reduce(rows * T, compute_itemsize) if last else 0)
                  + (g.all_gather(T // tp * C, itemsize) if first else 0))   # wpe's rows
        return M * per_mb + g.all_reduce(1, INT64)
    act_calls, row_calls = tensor_parallel.megatron_calls(n_layers - n_moe, first, last, lay.recompute)
    # a MoE block runs its MLP whole on every tp rank: attention's f and g alone, half a block's calls
    act_calls += tensor_parallel.megatron_calls(n_moe, False, False, lay.recompute)[0] // 2
    per_mb = (act_calls * g.all_reduce(rows * T * C, itemsize)           # (b, T, C) activations, gradients
              + row_calls * g.all_reduce(rows * T, compute_itemsize))    # the cross-entropy's (b*T,)
    return M * per_mb + g.all_reduce(1, INT64)            # + the gradient norm


def pp_bytes(cfg: GPTConfig, stage: int, lay, itemsize: int, g=None):
    """Point-to-point messages and the loss broadcast of one step on the pp group g
    (pipeline.py): one message per SendActivation and SendGrad in the stage's instruction
    list, to the rank of the neighbouring virtual stage (schedules.neighbour)."""
    pp, M, V = lay.pp, lay.micro_batches, chunks(lay)
    if pp == 1:
        return 0
    g = Flat(pp, stage) if g is None else g
    act = lay.rows * cfg.block_size // lay.cp * cfg.n_embd * itemsize     # (b, T/cp, C), + a header
    act //= lay.tp if lay.sp else 1                                        # --sp: (b, T/tp, C)
    sent = sum(g.send(act, schedules.neighbour(stage, ins.chunk, ins.peer, pp, V)[0])
               for ins in schedules.schedule(lay.schedule, stage, pp, M, V) if isinstance(ins, schedules.SENDS))
    if cfg.tie_embeddings and stage in (0, pp - 1):       # wte's gradient to the other end (ZeRO: its shard)
        n = tensor_parallel.local_size("wte.weight", (cfg.vocab_size, cfg.n_embd), lay.tp)
        N = lay.grad_ranks
        sent += g.send((zero.padded(n, N) // N if lay.zero else n) * itemsize, pp - 1 - stage)
    return sent + g.broadcast(1, INT64, pp - 1)


def other_parts(stage: int, lay, groups: dict) -> dict:
    """The step's 8-byte all-reduces outside the three mechanisms (train.train_step), by the
    group they run on: {"dp", "pp", "world"} (groups: the device's, placed or not; "ep" when
    placed)."""
    dp = groups["dp"].all_reduce(1, INT64)                # the loss, summed over dp (x cp)
    if lay.zero or (lay.dp_mode != "naive" and lay.ep == 1):   # the gradient norm over dp: each rank
        dp = 2 * dp                                       # squares its ZeRO shard / bucket pieces
    elif lay.ep > 1:                                      # ExpertParallelSync: the experts' squares over
        dp += groups.get("ep", Flat(lay.ep)).all_reduce(1, INT64)   # ep only (tagged dp), either --dp-mode
    world = groups["world"].all_reduce(1, INT64) if lay.precision != "fp32" else 0   # the overflow flag
    return {"dp": dp, "pp": groups["pp"].all_reduce(1, INT64), "world": world}       # pp: the gradient norm


def cp_bytes(cfg: GPTConfig, stage: int, lay, compute_itemsize: int, g=None):
    """Ring attention's messages of one step: context_parallel.step_traffic (one
    ring_traffic per layer of the device and micro-batch, n = b*(T/cp)*C/tp elements of its q,
    the forward twice with --recompute full), the trainer summary's formula too; on the
    placed cp ring g (plan_hosts.Placed.ring), the bytes that leave the host."""
    if lay.cp == 1:
        return 0
    messages, nbytes = context_parallel.step_traffic(rank_layer_count(cfg, stage, lay.pp, chunks(lay)),
                                                     lay.micro_batches, lay.rows, cfg.block_size,
                                                     cfg.n_embd // lay.tp, lay.cp, compute_itemsize, lay.recompute)
    return nbytes if g is None else g.ring(messages, nbytes)


def shaped(shape: tuple, itemsize: int) -> np.ndarray:
    """An array of this shape and itemsize that occupies no memory (a broadcast zero): for
    expert_parallel.ep_bytes, which reads only its size and bytes."""
    return np.broadcast_to(np.zeros((), dtype=f"f{itemsize}"), shape)


def ep_layer_bytes(cfg: GPTConfig, lay, itemsize: int, passes: int, g=None):
    """expert_parallel.ep_bytes of one MoE layer and micro-batch on an ep rank, `passes` each
    way (2: forward and backward), n = b*T tokens routed: with a capacity the dispatched
    (E cap, C) tensor, whatever the routing; without, balanced routing's n K (P-1)/P rows to
    other ranks and as many back (they depend on the routing), and the E row counts. g: the
    placed ep group (plan_hosts.Placed: Traffic), else one host (bytes)."""
    P, E, K, C = lay.ep, cfg.moe_experts, cfg.moe_top_k, cfg.n_embd
    n = lay.rows * cfg.block_size
    cap = moe.capacity(n, K, E, cfg.moe_capacity_factor)
    g = expert_parallel.Sent(Flat(P)) if g is None else g
    if cap is not None:
        return expert_parallel.ep_bytes(g, C * itemsize, passes, shaped((E * cap, C), itemsize))
    rows = n * K * (P - 1) / P
    return expert_parallel.ep_bytes(g, C * itemsize, passes, None, rows, rows, shaped((E,), INT64))


def ep_bytes(cfg: GPTConfig, stage: int, lay, itemsize: int, g=None):
    """The all-to-alls of one step: per MoE block of the device and micro-batch
    ep_layer_bytes with 2 passes, or with --recompute full 1 (the forward, under no_grad) and
    2 (the forward again, and backward). Exact with a capacity; without, an estimate. g: the
    placed ep group (Traffic), else bytes on one host."""
    if lay.ep == 1:
        return 0
    per_layer = ep_layer_bytes(cfg, lay, itemsize, 2, g)
    if lay.recompute == "full":
        per_layer += ep_layer_bytes(cfg, lay, itemsize, 1, g)
    total = rank_moe_count(cfg, stage, lay.pp, chunks(lay)) * lay.micro_batches * per_layer
    if isinstance(total, plan_hosts.Traffic):
        return plan_hosts.Traffic(*(round(v) for v in (total.intra, total.inter, total.inter_messages)))
    return round(total)


# --- the plan ---------------------------------------------------------------------------------

class Layout(argparse.Namespace):
    """The layout flags (dp, cp, cp_layout, tp, pp, ep, zero, micro_batches, batch_size,
    precision, dtype, schedule, virtual_stages, dp_mode, bucket_mb, sp, recompute);
    rows = B/(dp*M), the micro-batch of one device (of T/cp tokens each with --cp)."""

    sp = False                # the defaults of the flags a caller may leave out
    recompute = "none"
    virtual_stages = 1
    cp = 1
    cp_layout = "zigzag"
    ep = 1

    @property
    def rows(self) -> int:
        return self.batch_size // (self.dp * self.micro_batches)

    @property
    def grad_ranks(self) -> int:
        """Ranks that sum each gradient (and ZeRO shards over): dp*cp."""
        return self.dp * self.cp

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def but(self, **changes) -> Layout:
        """A copy with some flags changed."""
        return Layout(**{**vars(self), **changes})


def placed(lay) -> Layout:
    """The layout as plan_hosts places it (dp x tp x pp): the grid's rank
    ((pp*dp + d)*cp + c)*tp + t is that of dp*cp replicas, d*cp + c the replica."""
    return lay.but(dp=lay.grad_ranks, cp=1)


def itemsizes(lay) -> tuple[int, int, int]:
    """(itemsize, compute_itemsize, K): storage and compute bytes per element, optimizer
    bytes per parameter."""
    if lay.precision != "fp32":
        return 2, 4, mixed_precision.optimizer_bytes_per_param(True, 2)
    itemsize = 8 if lay.dtype == "float64" else 4
    return itemsize, itemsize, mixed_precision.optimizer_bytes_per_param(False, itemsize)


def device_memory(cfg: GPTConfig, lay, stage: int) -> dict:
    """What a device of `stage` holds at its peak: model states (ZeRO over dp*cp ranks) and
    the saved activations of the micro-batches its schedule holds at once."""
    itemsize, compute_itemsize, K = itemsizes(lay)
    V = chunks(lay)
    tensors = device_tensors(cfg, lay, stage)
    states, P_pad = {}, 0
    for ts, g in sync_groups(tensors, lay):          # with --ep, ZeRO's expert units over their replicas
        units = zero_units(ts, g.grad_ranks)
        part = model_states(sum(n for _, n in ts), sum(units), itemsize, K, lay.zero, g.grad_ranks)
        states = {k: states.get(k, 0) + v for k, v in part.items()}
        P_pad += sum(units)
    act, held = activations.peak_in_flight_bytes(cfg, lay.schedule, stage, lay.pp, V, lay.micro_batches, lay.tp,
                                                 lay.rows, itemsize, compute_itemsize, lay.sp, lay.recompute,
                                                 cp=lay.cp, ep=lay.ep)
    return {**states, "activations": act, "total": states["model_states"] + act, "stage": stage,
            "micro_batches_in_flight": held, "params_local": sum(n for _, n in tensors), "params_padded": P_pad}


def recompute_flops(cfg: GPTConfig, lay) -> int:
    """What --recompute runs again: recompute.added_flops (blocks with one dense MLP) and,
    with full, what a MoE block's forward adds to that, K experts' MLPs and the router
    instead of one MLP: the forward third of model.train_flops_per_token's MoE term."""
    added = recompute.added_flops(cfg.n_layer, lay.batch_size, cfg.block_size, cfg.n_embd, lay.recompute)
    if lay.recompute == "full" and cfg.moe_experts:
        moe_term = train_flops_per_token(cfg) - train_flops_per_token(dataclasses.replace(cfg, moe_experts=0))
        added += round(moe_term / 3 * lay.batch_size * cfg.block_size)
    return added


def moe_summary(cfg: GPTConfig, lay, itemsize: int, compute_itemsize: int) -> dict | None:
    """The mixture of experts at a glance (None without): its blocks, the capacity of a
    rank's micro-batch of n = b*T tokens (its routing group), the balanced routing the
    estimates assume (n K / E assignments per expert: M kept, R through the rank's experts),
    what an ep rank holds, one MoE layer's saved bytes and all-to-all bytes per micro-batch."""
    E, K = cfg.moe_experts, cfg.moe_top_k
    if not E:
        return None
    n = lay.rows * cfg.block_size
    cap = moe.capacity(n, K, E, cfg.moe_capacity_factor)
    blocks = [i for i in range(cfg.n_layer) if cfg.is_moe(i)]
    layer = activations.moe_layers(cfg, n, lay.ep)[blocks[0]]
    kept, received = layer.rows(n)
    return {"experts": E, "top_k": K, "every": cfg.moe_every, "capacity_factor": cfg.moe_capacity_factor,
            "blocks": blocks, "tokens_per_group": n, "capacity": cap, "balanced_per_expert": n * K / E,
            "kept": kept, "received": received, "ep": lay.ep, "experts_per_rank": E // lay.ep,
            "expert_replicas": lay.grad_ranks // lay.ep,
            "layer_activation_bytes": activations.layer_bytes(lay.rows, cfg.block_size, cfg.n_embd, cfg.n_head,
                                                              lay.tp, itemsize, compute_itemsize,
                                                              recompute=lay.recompute, moe_layer=layer),
            "all_to_all_bytes_per_layer": (round(ep_layer_bytes(cfg, lay, itemsize, 2)) if lay.ep > 1 else 0),
            "all_to_all_exact": lay.ep > 1 and cap is not None}


def moe_notes(m: dict | None) -> list[str]:
    """What the MoE figures assume: balanced routing where the data decides."""
    if m is None:
        return []
    out = []
    if m["capacity"] is not None or m["ep"] > 1:
        out.append(f"MoE activations assume balanced routing, every expert chosen n K / E = "
                   f"{m['balanced_per_expert']:g} times in a micro-batch of n = {m['tokens_per_group']} tokens: "
                   f"{m['kept']} assignments kept, {m['received']} rows through this rank's experts "
                   f"(the real counts depend on the routing)")
    if m["ep"] > 1 and m["capacity"] is None:
        out.append("ep all-to-all bytes: balanced routing's n K (P-1)/P rows each way per all-to-all, + the row "
                   "counts; the real figure depends on the routing (the trainer's summary prints it beside "
                   "expert_parallel.ep_bytes of the rows it routed)")
    if m["ep"] > 1 and m["capacity"] is not None:
        out.append(f"ep all-to-all bytes exact: every message is the padded (E cap, C) tensor, cap = "
                   f"{m['capacity']}; each rank's experts run on E cap = {m['experts'] * m['capacity']} rows, "
                   f"padding included (FLOPs count the K experts a token uses)")
    return out


def peak_memory(cfg: GPTConfig, lay) -> int:
    """The largest device's total: the budget a layout needs per device."""
    return max(device_memory(cfg, lay, stage)["total"] for stage in range(lay.pp))


def memory_limit(args) -> tuple[int, str]:
    """(bytes a rank may use, where that figure comes from): --max-memory, or this machine's
    memory (MemTotal) shared by the ranks the launcher started on it."""
    if args.max_memory is not None:
        size = parse_size(args.max_memory)
        if size is None or size < 1:
            raise config.ConfigError(f"--max-memory wants a size of at least a byte, such as 8GiB, 512MiB or 2e9, "
                              f"got {args.max_memory!r}")
        return size, f"--max-memory {args.max_memory}"
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    local = int(os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or 1)
    shared = f", {human_bytes(total)}, shared by the {local} ranks on it" if local > 1 else ""
    return total // max(local, 1), "this machine's MemTotal" + shared


def planned_memory(args, cfg: GPTConfig, dp: int, tp: int, pp: int) -> int:
    """The planner's peak bytes per rank of this run's layout (python -m minipar.plan)."""
    lay = Layout(dp=dp, tp=tp, pp=pp, zero=args.zero, micro_batches=args.micro_batches,
                      batch_size=args.batch_size, precision=args.precision, dtype=args.dtype,
                      schedule=args.schedule, dp_mode=args.dp_mode, bucket_mb=args.bucket_mb, sp=args.sp,
                      recompute=args.recompute, virtual_stages=args.virtual_stages, cp=args.cp,
                      cp_layout=args.cp_layout, ep=args.ep)
    return peak_memory(cfg, lay)


def check_fits(args, cfg: GPTConfig, dp: int, tp: int, pp: int):
    """The trainer's memory check (run and --dry-run, every rank, before any message): the
    planner's peak bytes for a rank of this layout (model states and saved activations) against
    what a rank may use; a layout that cannot fit is refused (config.ConfigError) before
    anything is allocated, instead of ending in a MemoryError."""
    need = planned_memory(args, cfg, dp, tp, pp)
    limit, source = memory_limit(args)
    if need > limit:
        raise config.ConfigError(f"this layout needs {human_bytes(need)} per rank by the planner's count (model states "
                          f"and activations, as python -m minipar.plan prints them), more than the "
                          f"{human_bytes(limit)} a rank may use ({source}; --max-memory sets another limit)")


def seq_ceiling(cfg: GPTConfig, lay, budget: int) -> dict:
    """The longest sequence T (a multiple of `step` = 2*cp, and of tp with --sp) whose peak
    per device fits in `budget` bytes, the model's block size taken to be T; None if not
    even T = step fits. peak_memory only grows with T, so: double k (T = k*step) while it
    fits, then bisect between the last k that fits and the first that does not."""
    step = math.lcm(2 * lay.cp, lay.tp if lay.sp else 1)

    def peak(k: int) -> int:
        return peak_memory(dataclasses.replace(cfg, block_size=k * step), lay)

    out = {"cp": lay.cp, "step": step, "T": None, "bytes_at_T": None, "bytes_at_next": peak(1)}
    if out["bytes_at_next"] > budget:
        return out
    lo = 1
    while peak(2 * lo) <= budget:
        lo *= 2
    hi = 2 * lo                                           # peak(lo) fits, peak(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if peak(mid) <= budget else (lo, mid)
    return {**out, "T": lo * step, "bytes_at_T": peak(lo), "bytes_at_next": peak(lo + 1)}


def ceilings(cfg: GPTConfig, lay, budget: int) -> dict:
    """seq_ceiling without cp (cp = 1, the same dp, tp, pp) and with the layout's cp."""
    return {"memory_budget": budget, "without_cp": seq_ceiling(cfg, lay.but(cp=1), budget),
            "with_cp": seq_ceiling(cfg, lay, budget)}


def plan(cfg: GPTConfig | None, lay, params: int | None = None, device_tflops: float | None = None,
         hosts: plan_hosts.Hosts | None = None, memory_budget: int | None = None) -> dict:
    """The whole estimate as a dict (what --json prints). cfg None: `params` alone, model
    states only (no shapes: P/(tp*pp) per device, one ZeRO unit). hosts: where the ranks
    run and their links (None: every rank on one host). memory_budget: bytes per device,
    for the sequence-length ceiling (seq_ceiling)."""
    hosts = hosts or plan_hosts.Hosts()
    spread = hosts.n_hosts(lay.world) > 1
    itemsize, compute_itemsize, K = itemsizes(lay)
    N, pp, M, V = lay.grad_ranks, lay.pp, lay.micro_batches, chunks(lay)
    bubble = schedules.bubble_theory(lay.schedule, pp, M, V)
    out = {"model": None, "layout": {**vars(lay), "sp": lay.sp, "recompute": lay.recompute,
                                     "virtual_stages": lay.virtual_stages, "cp": lay.cp,
                                     "cp_layout": lay.cp_layout, "world": lay.world,
                                     "micro_batch_rows": lay.rows if cfg else None, "bytes_per_param": itemsize,
                                     "optimizer_bytes_per_param": K},
           "params": params, "params_active": None, "moe": None, "notes": [], "seq_ceiling": None}
    if cfg is None:
        P_local = -(-params // (lay.tp * pp))
        mem = {**model_states(P_local, zero.padded(P_local, N), itemsize, K, lay.zero, N),
               "activations": None, "total": None, "stage": None, "micro_batches_in_flight": None,
               "params_local": P_local, "params_padded": zero.padded(P_local, N)}
        out.update(memory=mem, memory_per_stage=[mem], flops=None, flops_per_stage=None, comm=None,
                   comm_per_stage=None, bubble=bubble, step_time_s=None,
                   hosts=plan_hosts.summary(placed(lay), hosts, None, None))
        out["notes"].append("--params alone: model states only, spread evenly over tp*pp "
                            "(no shapes: FLOPs, activations and communication unavailable)")
        return out
    out["model"] = {k: getattr(cfg, k) for k in (*SHAPE_FLAGS, "tie_embeddings", *MOE_FLAGS)}
    out["params"] = sum(math.prod(shape) for _, shape, _ in param_specs(cfg))
    out["params_active"] = active_params(cfg)
    mem_st, flops_st, comm_st = [], [], []
    for stage in range(pp):
        tensors = device_tensors(cfg, lay, stage)
        mem_st.append(device_memory(cfg, lay, stage))
        stage_flops = flops(flop_components(cfg, lay.tp, stage, pp, V, lay.cp), lay.batch_size // lay.dp)
        flops_st.append({"stage": stage, **stage_flops})
        groups = plan_hosts.device_groups(placed(lay), hosts, stage) if spread else flat_groups(lay, stage)
        axes = {"dp": grad_sync_bytes(tensors, lay, itemsize, groups["dp"]),
                "tp": tp_bytes(cfg, stage, lay, itemsize, compute_itemsize, groups["tp"]),
                "pp": pp_bytes(cfg, stage, lay, itemsize, groups["pp"])}
        groups.update(plan_hosts.ring_and_expert_groups(lay, hosts, stage) if spread else {})
        row = plan_hosts.comm_row(stage, axes, other_parts(stage, lay, groups), bool(lay.zero), hosts)
        row = plan_hosts.add_axis(row, "cp", cp_bytes(cfg, stage, lay, compute_itemsize, groups.get("cp")), hosts)
        comm_st.append(plan_hosts.add_axis(row, "ep", ep_bytes(cfg, stage, lay, itemsize, groups.get("ep")), hosts))
    whole = flop_components(cfg)
    tokens = lay.batch_size * cfg.block_size
    out["flops"] = {**flops(whole, lay.batch_size), "six_nd": 6 * out["params_active"] * tokens,
                    "per_token": train_flops_per_token(cfg),
                    "per_device": max(flops_st, key=lambda r: r["total"]),
                    "recompute_added": recompute_flops(cfg, lay)}
    out["moe"] = moe_summary(cfg, lay, itemsize, compute_itemsize)
    out["activations_per_layer"] = {
        "this_run": activations.layer_bytes(lay.rows, cfg.block_size, cfg.n_embd, cfg.n_head, lay.tp, itemsize,
                                            compute_itemsize, lay.sp and lay.tp > 1, lay.recompute, lay.cp),
        "setting": activations.setting_of(lay.tp, lay.sp, lay.recompute) if lay.cp == 1 else None,
        "cp": lay.cp, "cp_formula": activations.cp_formula(lay.recompute) if lay.cp > 1 else None,
        "table": activations.table(cfg.block_size, lay.rows, cfg.n_embd, cfg.n_head, lay.tp, itemsize,
                                   compute_itemsize)}
    out.update(memory=max(mem_st, key=lambda r: r["total"]), memory_per_stage=mem_st,
               flops_per_stage=flops_st, comm=max(comm_st, key=lambda r: r["bytes_per_step"]),
               comm_per_stage=comm_st, bubble=bubble, step_time_s=None)
    tp_note = plan_hosts.tp_note(placed(lay), hosts,
                                 lambda stage, g: tp_bytes(cfg, stage, lay, itemsize, compute_itemsize, g))
    out["hosts"] = plan_hosts.summary(placed(lay), hosts, comm_st, tp_note)
    if tp_note:
        out["notes"].append(plan_hosts.tp_note_line(tp_note, human_bytes))
    if device_tflops:
        out["layout"]["device_tflops"] = device_tflops
        seconds = out["flops"]["per_device"]["total"] / (device_tflops * 1e12)
        out["step_time_s"] = seconds
        out["step_time_with_bubble_s"] = seconds / (1 - out["bubble"])
    if lay.zero == 3 and pp > 1:
        out["notes"].append("minipar's trainer refuses --zero 3 with --pp > 1 (as DeepSpeed does): "
                            "these are the formulas' figures")
    if lay.tp > 1:
        out["notes"].append("activations with tp > 1: the token ids a vocabulary slice keeps "
                            "depend on the data; 1/tp of them assumed")
    out["notes"] += moe_notes(out["moe"])
    if memory_budget is not None:
        out["seq_ceiling"] = ceilings(cfg, lay, memory_budget)
    return out


# --- the command line -------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    def error(self, message):                             # one line, exit 2 (as the trainer)
        raise PlanError(message)


def build_parser() -> argparse.ArgumentParser:
    trainer = config.build_parser()                       # the trainer's defaults
    default = {k: trainer.get_default(k) for k in ("batch_size", "micro_batches", "schedule", "virtual_stages",
                                                    "dtype", "precision", "tp", "pp", "zero", "cp", "ep")}
    parser = Parser(prog="python -m minipar.plan",
                    description="Memory, FLOPs and communication per device of training a GPT-2 shaped "
                                "model on a dp x cp x tp x pp layout, as minipar would run it.")
    model = parser.add_argument_group("model: --model, or the trainer's shape flags, or --params alone")
    model.add_argument("--model", choices=tuple(PRESETS), help="a standard shape (shape flags override it)")
    model.add_argument("--params", type=float, metavar="N",
                       help="a parameter count alone (e.g. 7.5e9): model states only")
    model.add_argument("--vocab-size", type=int, metavar="V", help="vocabulary [256: minipar's bytes]")
    for key, letter, what in (("n_layer", "L", "transformer blocks"), ("n_head", "H", "attention heads"),
                              ("n_embd", "C", "channels"), ("block_size", "T", "context length")):
        model.add_argument(f"--{key.replace('_', '-')}", type=int, metavar=letter,
                           help=f"{what} [{config.MODEL_DEFAULTS[key]}]")
    model.add_argument("--untied", action="store_true", help="separate lm_head.weight instead of wte.T")
    config.add_moe_arguments(model, "0: no capacity (all-to-all bytes then estimated for balanced routing)")
    layout = parser.add_argument_group("layout (the trainer's flags and defaults)")
    layout.add_argument("--dp", type=int, metavar="D",
                        help="data-parallel replicas [1, or world/(cp*tp*pp) with --world]")
    layout.add_argument("--world", type=int, metavar="W",
                        help="ranks, as mpirun -n W gives the trainer: --dp defaults to W/(cp*tp*pp), and "
                             "dp*cp*tp*pp must be W")
    layout.add_argument("--cp", type=int, default=default["cp"], metavar="C",
                        help="context parallelism: each sequence split over C ranks, attention by ring "
                             "attention; the block size must divide by 2C [%(default)s]")
    layout.add_argument("--cp-layout", choices=LAYOUTS, default=None,
                        help="--cp: which tokens each rank keeps (the same bytes either way) [zigzag]")
    layout.add_argument("--tp", type=int, default=default["tp"], metavar="T",
                        help="tensor-parallel ranks [%(default)s]")
    layout.add_argument("--pp", type=int, default=default["pp"], metavar="P", help="pipeline stages [%(default)s]")
    layout.add_argument("--ep", type=int, default=default["ep"], metavar="P",
                        help="expert parallelism: the experts split over groups of P dp ranks, tokens sent "
                             "to them by all-to-all; P divides dp and --moe-experts [%(default)s]")
    layout.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=default["zero"], metavar="{0,1,2,3}",
                        help="ZeRO stage over the dp group: shard the optimizer state (1), and the gradients "
                             "(2), and the parameters (3) [%(default)s]")
    layout.add_argument("--micro-batches", type=int, default=default["micro_batches"], metavar="M",
                        help="micro-batches per step on each dp rank [%(default)s]")
    layout.add_argument("--batch-size", type=int, default=default["batch_size"], metavar="B",
                        help="global batch in sequences [%(default)s]")
    layout.add_argument("--precision", choices=tuple(mixed_precision.PRECISIONS), default=default["precision"],
                        help="fp16/bf16: 2-byte parameters, gradients, activations; 12-byte optimizer "
                             "[%(default)s]")
    layout.add_argument("--dtype", choices=tuple(config.DTYPES), default=default["dtype"],
                        help="parameter dtype with --precision fp32 (8 bytes for float64) [%(default)s]")
    layout.add_argument("--schedule", choices=tuple(schedules.SCHEDULES), default=default["schedule"],
                        help="pipeline schedule [%(default)s]")
    layout.add_argument("--virtual-stages", type=int, default=default["virtual_stages"], metavar="V",
                        help="--schedule interleaved: model chunks per pipeline rank [%(default)s]")
    layout.add_argument("--sp", action="store_true",
                        help="sequence parallelism inside the tp group (activations, tp bytes)")
    layout.add_argument("--recompute", choices=("none", "selective", "full"), default="none",
                        help="activation recomputation (activations, tp bytes, added FLOPs) [%(default)s]")
    layout.add_argument("--dp-mode", choices=("bucketed", "naive"),
                        help="--zero 0: gradient all-reduce per bucket or per parameter [bucketed]")
    layout.add_argument("--bucket-mb", type=float, metavar="X",
                        help="--zero 0, bucketed: bucket size in MiB [1.0]")
    plan_hosts.add_arguments(parser)
    output = parser.add_argument_group("output")
    output.add_argument("--device-tflops", type=float, metavar="X",
                        help="sustained TFLOP/s of one device: adds a step-time estimate")
    output.add_argument("--memory-budget", metavar="BYTES",
                        help="bytes per device (16GiB, 512MiB, 8e9): the longest sequence whose peak fits, "
                             "without cp and with --cp")
    output.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def resolve(args) -> tuple[GPTConfig | None, Layout, int | None]:
    """Flags -> (cfg or None, layout, params or None); PlanError for what cannot run,
    with the trainer's messages (config.validate, train/setup.prepare) where they exist."""
    given = [k for k in (*SHAPE_FLAGS, *MOE_FLAGS) if getattr(args, k) is not None]
    lay = Layout(**{k: getattr(args, k) for k in ("dp", "cp", "cp_layout", "tp", "pp", "ep", "zero", "micro_batches",
                                                  "batch_size", "precision", "dtype", "schedule", "virtual_stages",
                                                  "dp_mode", "bucket_mb", "sp", "recompute")})
    for flag in ("dp", "cp", "tp", "pp"):
        if getattr(lay, flag) is not None and getattr(lay, flag) < 1:
            raise PlanError(f"--{flag} must be >= 1, got {getattr(lay, flag)}")
    if args.world is not None:                               # the trainer's check and default
        try:
            lay.dp = check_layout(args.world, lay.dp, lay.tp, lay.pp, lay.cp)[0]
        except LayoutError as e:
            raise PlanError(str(e)) from None
    lay.dp = 1 if lay.dp is None else lay.dp
    for flag in ("batch_size", "micro_batches"):
        if getattr(lay, flag) <= 0:
            raise PlanError(f"--{flag.replace('_', '-')} must be positive, got {getattr(lay, flag)}")
    if lay.batch_size % lay.micro_batches:
        raise PlanError(f"--batch-size {lay.batch_size} is not divisible by --micro-batches {lay.micro_batches}")
    if lay.precision != "fp32" and lay.dtype != "float32":
        raise PlanError(f"--precision {lay.precision} needs --dtype float32 (its master weights and "
                        f"optimizer state are float32), got --dtype {lay.dtype}")
    config.resolve_dp_flags(lay)
    if args.params is None:                                  # --params: no batch to cut
        config.check_split(None, lay.dp, lay.tp, lay.pp, lay.batch_size, lay.micro_batches)
    if args.device_tflops is not None and not args.device_tflops > 0:
        raise PlanError(f"--device-tflops must be > 0, got {args.device_tflops}")
    if args.params is not None:
        if args.model or given or args.untied:
            extra = "--model" if args.model else "--untied" if args.untied else f"--{given[0].replace('_', '-')}"
            raise PlanError(f"--params gives the size alone; drop {extra} (or drop --params)")
        if not (math.isfinite(args.params) and args.params >= 1):
            raise PlanError(f"--params must be a count >= 1, got {args.params:g}")
        config.check_schedule(None, lay.pp, lay.schedule, lay.virtual_stages, lay.micro_batches)
        config.check_context_split(None, lay)
        config.check_moe(GPTConfig(), moe_args(args), lay.dp)     # --ep needs experts: the trainer's line
        return None, lay, int(round(args.params))
    base = dict(zip(("n_layer", "n_head", "n_embd", "vocab_size", "block_size"), PRESETS[args.model])) \
        if args.model else {"vocab_size": 256, **config.MODEL_DEFAULTS}
    shape = {k: getattr(args, k) if getattr(args, k) is not None else base[k] for k in SHAPE_FLAGS}
    for k in SHAPE_FLAGS:
        if shape[k] <= 0:
            raise PlanError(f"--{k.replace('_', '-')} must be positive, got {shape[k]}")
    experts = {k: getattr(args, k) if getattr(args, k) is not None else config.MODEL_DEFAULTS[k] for k in MOE_FLAGS}
    cfg = GPTConfig(tie_embeddings=not args.untied, **shape, **experts)
    if cfg.n_embd % cfg.n_head:
        raise PlanError(f"--n-embd {cfg.n_embd} is not divisible by --n-head {cfg.n_head}")
    config.check_split(cfg, lay.dp, lay.tp, lay.pp, lay.batch_size, lay.micro_batches)
    config.check_sequence_split(cfg, lay.tp, lay.sp)
    config.check_context_split(cfg, lay)
    config.check_moe(cfg, moe_args(args), lay.dp)
    config.check_schedule(cfg, lay.pp, lay.schedule, lay.virtual_stages, lay.micro_batches)
    return cfg, lay, None


def moe_args(args) -> argparse.Namespace:
    """The flags as config.check_moe reads them; the planner has no --moe-aux-coef or
    --moe-z-coef (the losses' weights cost nothing), so they are 0."""
    return argparse.Namespace(**{**vars(args), "moe_aux_coef": 0.0, "moe_z_coef": 0.0})


UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
         "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_size(text: str) -> int | None:
    """'16GiB', '512MiB', '8e9', '8GB' as bytes; None if it is no positive, finite size."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?(?:e[0-9]+)?)\s*([kmgt]i?b|b)?\s*", text.lower())
    if not m or not math.isfinite(float(m.group(1))) or float(m.group(1)) <= 0:
        return None
    return int(float(m.group(1)) * UNITS[m.group(2) or ""])


def memory_budget(args, cfg: GPTConfig | None) -> int | None:
    """--memory-budget as bytes (16GiB, 512MiB, 8e9, 8GB), or None; PlanError if it is no
    size or there is no model shape to search over."""
    text = args.memory_budget
    if text is None:
        return None
    size = parse_size(text)
    if size is None:
        raise PlanError(f"--memory-budget wants a size such as 16GiB, 512MiB or 8e9 (bytes), got {text!r}")
    if cfg is None:
        raise PlanError("--memory-budget searches over the sequence length: it needs the model's shape, "
                        "not --params")
    return size


# --- the table --------------------------------------------------------------------------------

def _columns(pp: int) -> list:
    """Stages shown side by side: all of up to 4, else the first two and the last two."""
    return list(range(pp)) if pp <= 4 else [0, 1, pp - 2, pp - 1]


def _row(label: str, values, width: int = 14) -> str:
    return f"  {label:<22}" + "".join(f"{v:>{width}}" for v in values)


def _sci(x) -> str:
    return f"{x:.3e}"


def table(r: dict, name: str | None = None) -> str:
    """The human-readable form of plan()'s dict: memory, FLOPs and bytes sent, by stage."""
    lay, out = r["layout"], []
    what = f"{name}: " if name else ""
    if r["model"] is None:
        out.append(f"minipar.plan: {r['params']:,} parameters (--params: model states only)")
    else:
        shape = r["model"]
        active = f" ({r['params_active']:,} active per token)" if r["moe"] else ""
        out.append(f"minipar.plan: {what}GPT L={shape['n_layer']} H={shape['n_head']} C={shape['n_embd']} "
                   f"T={shape['block_size']} V={shape['vocab_size']} "
                   f"({'tied' if shape['tie_embeddings'] else 'untied'}), {r['params']:,} parameters{active}")
    prec = lay["precision"] if lay["precision"] != "fp32" else lay["dtype"]
    devices = f"{lay['world']} device{'s' if lay['world'] > 1 else ''}"
    cp = f" cp={lay['cp']} ({lay['cp_layout']})" if lay["cp"] > 1 else ""
    ep = f" ep={lay['ep']}" if lay["ep"] > 1 else ""
    out.append(f"  layout: dp={lay['dp']}{cp} tp={lay['tp']} pp={lay['pp']}{ep} ({devices}), ZeRO {lay['zero']}, "
               f"{prec}: {lay['bytes_per_param']} B per parameter and gradient, "
               f"{lay['optimizer_bytes_per_param']} B optimizer state")
    if r["model"] is not None:
        out.append(f"  batch: {lay['batch_size']} sequences; per dp rank {lay['micro_batches']} micro-batch(es) of "
                   f"{lay['micro_batch_rows']}" + (f"; {lay['schedule']} schedule"
                                                   + (f", V={lay['virtual_stages']}" if lay["virtual_stages"] > 1
                                                      else "") + f", bubble {r['bubble']:.3f}"
                                                   if lay["pp"] > 1 else ""))
    if r.get("moe"):
        out += moe_lines(r["moe"], r["model"]["n_layer"])
    h = r["hosts"]
    show_hosts = h["ranks_per_host"] is not None or h["inter_node_gbps"] or h["intra_node_gbps"]
    if show_hosts:
        out.append(plan_hosts.placement_line(r["hosts"]))
    cols = _columns(lay["pp"]) if r["model"] is not None else [0]
    mem = [r["memory_per_stage"][stage] for stage in cols]
    heads = [f"stage {stage}" for stage in cols] if r["model"] is not None else [""]
    out.append("")
    out.append(_row("memory per device", heads))
    out.append(_row("parameters held", [f"{row['params_local']:,}" for row in mem]))
    for key in ("params", "grads", "optimizer", "model_states"):
        out.append(_row(key.replace("_", " "), [human_bytes(row[key]) for row in mem]))
    if r["model"] is not None:
        out.append(_row("activations", [human_bytes(row["activations"]) for row in mem]))
        held = "  micro-batches held" if lay["virtual_stages"] == 1 or lay["pp"] == 1 else "  chunk-micro-batches"
        out.append(_row(held, [row["micro_batches_in_flight"] for row in mem]))
        out.append(_row("total", [human_bytes(row["total"]) for row in mem]))
        fl = r["flops"]
        out.append("")
        out.append(_row("FLOPs per step", ["whole model"] + [f"stage {stage}" for stage in cols]))
        per = [r["flops_per_stage"][stage] for stage in cols]
        for key, v in fl["components"].items():
            out.append(_row(key.replace("_", " "), [_sci(v)] + [_sci(st["components"][key]) for st in per]))
        for key in ("forward", "backward", "total"):
            out.append(_row(key + (" (2x fwd)" if key == "backward" else ""),
                            [_sci(fl[key])] + [_sci(st[key]) for st in per]))
        out.append(_row("6ND" + (" (N active)" if r["moe"] else ""), [_sci(fl["six_nd"])]))
        if r["moe"]:                                      # the trainer's MFU numerator, K experts a token
            out.append(_row("per token (fwd+bwd)", [_sci(fl["per_token"])]))
        if fl["recompute_added"]:
            out.append(_row(f"+ {lay['recompute']} recompute", [_sci(fl["recompute_added"])]))
        out += activation_lines(r)
        out.append("")
        out.append(_row("comm sent per step", heads))
        sent = [r["comm_per_stage"][stage] for stage in cols]
        axes = (("dp", "dp (grads; ZeRO's)"), ("cp", "cp (ring attention)"), ("tp", "tp (Megatron)"),
                ("pp", "pp (point-to-point)"), ("ep", "ep (all-to-all)"), ("other", "other (8-byte scalars)"),
                ("bytes_per_step", "total"))
        for key, label in axes:
            if key not in ("cp", "ep") or lay[key] > 1:
                out.append(_row(label, [human_bytes(st[key]) for st in sent]))
        if show_hosts:
            out += plan_hosts.table_lines(r, cols, _row, human_bytes)
    if lay["pp"] > 4 and r["model"] is not None:
        out.append(f"  (stages {', '.join(map(str, cols))} of {lay['pp']} shown; --json has every stage)")
    if r.get("step_time_s") is not None:
        out.append(f"  step time at {r['layout']['device_tflops']:g} TFLOP/s per device: "
                   f"{r['step_time_s']:.3g} s of compute on the busiest stage"
                   + (f", {r['step_time_with_bubble_s']:.3g} s with the bubble" if lay["pp"] > 1 else ""))
    if r["seq_ceiling"] is not None:
        out += ceiling_lines(r["seq_ceiling"])
    out += [f"  note: {n}" for n in r["notes"]]
    return "\n".join(out)


def moe_lines(m: dict, n_layer: int) -> list[str]:
    """The mixture of experts: its blocks and ep; the capacity of a micro-batch."""
    blocks = ", ".join(f"h.{i}" for i in m["blocks"][:4]) + (", ..." if len(m["blocks"]) > 4 else "")
    ep = (f"; ep={m['ep']}: {m['experts_per_rank']} experts per rank, each summed over {m['expert_replicas']} "
          f"replica(s)" if m["ep"] > 1 else "")
    cap = (f"capacity factor {m['capacity_factor']:g}: {m['capacity']} slots per expert of a micro-batch's "
           f"{m['tokens_per_group']} tokens (balanced: {m['balanced_per_expert']:g} each)"
           if m["capacity"] is not None else "no capacity: nothing dropped")
    return [f"  moe: E={m['experts']} experts, top-{m['top_k']}, in {len(m['blocks'])} of {n_layer} blocks "
            f"({blocks}){ep}", f"       {cap}"]


def ceiling_lines(c: dict) -> list[str]:
    """The longest sequence that fits the budget, without cp and with it (seq_ceiling)."""
    out = ["", f"  longest sequence T in {human_bytes(c['memory_budget'])} per device (peak of model states "
               f"+ activations, the largest stage; block size = T)"]
    for key in ("without_cp", "with_cp"):
        s = c[key]
        label = "without cp" if key == "without_cp" else f"with cp={s['cp']}"
        if s["T"] is None:
            out.append(f"    {label:<14}none: T = {s['step']} already needs {human_bytes(s['bytes_at_next'])}")
            continue
        out.append(f"    {label:<14}T = {s['T']:>9,} ({human_bytes(s['bytes_at_T'])}; T + {s['step']} needs "
                   f"{human_bytes(s['bytes_at_next'])})")
    return out


def activation_lines(r: dict) -> list[str]:
    """Saved activations per layer, one micro-batch: minipar's formula in the six settings of
    Korthikanti et al. 2022 (Table 2) beside the paper's, this run's setting marked."""
    lay, a, shape = r["layout"], r["activations_per_layer"], r["model"]
    out = ["", f"  activations per layer, one micro-batch (s={shape['block_size']} b={lay['micro_batch_rows']} "
               f"h={shape['n_embd']} a={shape['n_head']} t={lay['tp']}, d={lay['bytes_per_param']}): "
               f"this run {human_bytes(a['this_run'])}",
           f"    {'setting':<17}{'minipar':>12}  {'formula':<32}{'Korthikanti':>12}  Table 2 (2-byte values)"]
    for row in a["table"]:
        mark = " <" if row["setting"] == a["setting"] else ""
        out.append(f"    {row['setting']:<17}{human_bytes(row['minipar']):>12}  {row['minipar_formula']:<32}"
                   f"{human_bytes(row['korthikanti']):>12}  {row['korthikanti_formula']}{mark}")
    if a["cp"] > 1:                                       # no row of Table 2: the ring's own
        out.append(f"    {'cp=' + str(a['cp']):<17}{human_bytes(a['this_run']):>12}  {a['cp_formula']:<32}"
                   f"{'':>12}  (c = {a['cp']}: s/c tokens a rank, ring attention, no softmax) <")
    m = r["moe"]
    if m:                                                 # no row of Table 2 either: activations.py's third table
        label = f"moe E={m['experts']} K={m['top_k']}"
        out.append(f"    {label:<17}{human_bytes(m['layer_activation_bytes']):>12}  "
                   f"a MoE block: the MLP's rows replaced by the router, the experts' R = {m['received']:,} rows "
                   f"and the combine's M = {m['kept']:,} (activations.py)")
    return out


def main(argv=None):
    try:
        args = build_parser().parse_args(argv)
        cfg, lay, params = resolve(args)
        hosts = plan_hosts.Hosts.from_args(args)
        budget = memory_budget(args, cfg)
    except config.ConfigError as e:
        print(f"minipar.plan: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    r = plan(cfg, lay, params, args.device_tflops, hosts, budget)
    print(json.dumps(r) if args.json else table(r, args.model))


if __name__ == "__main__":
    main()
