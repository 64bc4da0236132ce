"""Bytes a device sends per step, by formula, as minipar.comm sends them.

Communication: bytes one device sends per step (dp, cp and tp rank 0 of each stage), as
minipar.comm's ledger counts them (all_reduce_sent and friends below follow comm/):
    dp     zero 0: the gradient buckets, each all-reduced once per step (2(p-1)/p n, or
           recursive doubling's log2(p) n up to 64 KiB); with ZeRO, unit by unit of its
           padded size: zero 1 reduce-scatter + all-gather once, zero 2 a reduce-scatter
           per micro-batch + one all-gather, zero 3 per micro-batch 2 all-gathers + 1
           reduce-scatter, (p-1)/p n each (formulas.collectives_per_step); with
           --shard-group S these inside the device's shard group of S ranks, (S-1)/S n,
           and once a step the n/S shard all-reduced across its R = p/S replicas
           (formulas.calls_of: zero_bytes)
    tp     per micro-batch Megatron's 4 all-reduces per layer of b*T*C, the embedding's g,
           the head's f and the vocab-parallel cross-entropy's 3 of b*T (4L + 5 in all,
           tensor_parallel.megatron_calls), and the 8-byte gradient-norm all-reduce once
           per step; Llama with tp > Hkv: 2 per layer of a (C, hs) key/value gradient over
           the tp/Hkv ranks sharing the head (tensor_parallel.kv_grad_count); --sp: sp_count's
           gathers and scatters, the replicated parameters' sums (replicated_sums)
    pp     one message per SendActivation and SendGrad of the stage's instruction list
           (b*T*C*s, /tp with --sp, + a 128-byte header each): M down and M up per
           boundary, V times as many with --virtual-stages V (rank pp-1's chunks send to
           rank 0's next, round the ring); with Mixtral's router each followed by the
           micro-batch's pooled counts (pooled_counts); the tied embedding's gradient between the two ends
           (with ZeRO: the rank's shard of it), the loss broadcast
    other  8-byte all-reduces: the loss over dp, the gradient norm over pp and over dp
           (ZeRO: each rank squares its shard; bucketed dp: its piece of each bucket;
           not with --dp-mode naive), the fp16/bf16 overflow flag over the world
    cp     context parallelism's ring attention (above)

Across hosts (--ranks-per-host K: rank r on host r // K): the same calls, walked message by
message on the device's real groups with the algorithm comm's dispatcher picks there (the
hierarchical one for large messages on a group with several ranks on some host), split into
bytes inside the host and across hosts, and timed with --inter-node-gbps, --intra-node-gbps
and --inter-node-latency-us: minipar/plan/hosts.py. The cp ring and the ep group are placed too:
every ring message goes to the next cp rank, each all-to-all's messages follow the algorithm
comm picks (the hierarchical all-to-all for small ones on an ep group that spans hosts).
"""
from __future__ import annotations

from types import SimpleNamespace

from minipar import comm
from minipar.comm.algorithms import direct, tree
from minipar.comm.helpers import shaped, split_offsets
from minipar.comm.protocol import HEADER_BYTES
from minipar.model import moe
from minipar.model.gpt import GPTConfig
from minipar.parallel import data_parallel
from minipar.parallel.context import context_parallel
from minipar.parallel.expert import expert_parallel
from minipar.parallel.pipeline import schedules
from minipar.parallel.tensor import sequence_parallel, tensor_parallel
from minipar.parallel.zero.formulas import calls_of
from minipar.parallel.zero.units import padded
from minipar.parallel.zero.zpp import Wire
from minipar.plan import hosts as plan_hosts
from minipar.plan.layout import chunks, rank_layer_count, rank_moe_count, sync_groups, zero_split, zero_units

INT64 = 8                 # token ids, and the 8-byte scalars (loss, norms, flags) on the wire


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

    def first(self, n: int) -> Flat:
        """The group of this group's first n ranks (tp rank 0's key/value head group)."""
        return Flat(n, self.rank)

    def split(self, S: int) -> tuple:
        """(its block of S consecutive ranks, the ranks in the same place of every block):
        a ZeRO shard group and its replicas (zero.hybrid)."""
        return Flat(S, self.rank % S), Flat(self.size // S, self.rank // S)

    def all_to_all(self, x) -> int:
        """comm.all_to_all of x in p equal pieces, by the algorithm comm picks for it."""
        return comm.all_to_all_sent(self, x) if self.size > 1 else 0

    def hosts(self) -> tuple:
        """(its ranks on the device's host, those of the device's place on every host): ZeRO++'s
        two groups (zpp.host_groups); one host: (the group, None)."""
        return self, None


def flat_groups(lay, stage: int) -> dict:
    """The groups of dp, cp and tp rank 0 of `stage`, all on one host; "dp" is the gradient
    group, dp*cp ranks (ProcessGrid.grad_group)."""
    return {"dp": Flat(lay.grad_ranks), "tp": Flat(lay.tp), "pp": Flat(lay.pp, stage),
            "world": Flat(lay.world, stage * lay.grad_ranks * lay.tp)}


def zero_bytes(units: list, stage: int, M: int, itemsize: int, g, S: int | None = None, reshard: bool = True,
               wire=None):
    """ZeRO's collectives of one step (formulas.calls_of) for units of these padded sizes, on
    the gradient group g: the reduce-scatters and all-gathers inside the device's shard group
    of S ranks (all of g: flat ZeRO), and with R = g.size/S > 1 each unit's n/S shard
    all-reduced across its R replicas once (g.split); reshard: stage 3's
    --reshard-after-forward (off: no backward all-gather); wire: ZeRO++ (zpp.Wire: qwZ's codes,
    hpZ's all-gathers inside the host, qgZ's all-to-alls, on the shard group's host groups)."""
    S = S or g.size
    shards, replicas = g.split(S) if S < g.size else (g, None)
    local, cross = shards.hosts() if wire is not None and wire.on else (shards, None)
    total = 0
    for n in units:
        unit = SimpleNamespace(n_pad=n, shard_size=n // S, group=shards, replicas=replicas, local=local,
                               cross=cross)                                       # as units.Unit
        for op, group, x, calls in calls_of(stage, unit, itemsize, M, reshard, wire):
            total += calls * (group.all_to_all(x) if op == "all_to_all" else getattr(group, op)(x.size, x.itemsize))
    return total


def dp_bytes(tensors: list, units: list, lay, itemsize: int, g=None, S: int | None = None):
    """Gradient synchronisation over the dp group g (data_parallel.py, or ZeRO's units): the
    dp*cp ranks of ProcessGrid.grad_group; S: ZeRO's shard group (zero_bytes)."""
    N, M = lay.grad_ranks, lay.micro_batches
    if N == 1:
        return 0
    g = Flat(N) if g is None else g
    if lay.zero:
        return zero_bytes(units, lay.zero, M, itemsize, g, S, lay.reshard_after_forward,
                          Wire(lay.qwz, lay.hpz, lay.qgz) if lay.zero == 3 else None)
    if lay.dp_mode == "naive":                            # one all-reduce per parameter
        return sum(g.all_reduce(n, itemsize) for _, n in tensors)
    members = data_parallel.bucket_members([n * itemsize for _, n in tensors], lay.bucket_mb)
    buckets = [sum(tensors[i][1] for i in m) for m in members]     # elements per bucket
    return sum(g.all_reduce(n, itemsize) for n in buckets)


def grad_sync_bytes(tensors: list, lay, itemsize: int, g=None, family=None):
    """The dp axis: dp_bytes of each of sync_groups' sets, the non-expert tensors on the dp
    group g, the experts' (with --ep) on their dp/ep replicas: ExpertParallelSync's two
    bucketed synchronisers, or ZeRO's expert units sharded over the replicas. family: the
    model family whose names the tensors carry (ZeRO's units; default GPT-2's). With
    --shard-group, each set's shard groups (layout.zero_split)."""
    return sum(dp_bytes(ts, zero_units(ts, gl.grad_ranks, family), gl, itemsize,
                        g if gl is lay else Flat(gl.grad_ranks), zero_split(lay, gl)[0])
               for ts, gl in sync_groups(tensors, lay))


def tp_bytes(cfg: GPTConfig, stage: int, lay, itemsize: int, compute_itemsize: int, g=None):
    """Megatron's all-reduces of one step on tp rank 0 of the tp group g
    (tensor_parallel.megatron_calls), over the blocks of all the rank's chunks; with key/value
    heads shared by tp/Hkv ranks (tp > Hkv), their gradient sums over those ranks, the first of
    g's (tensor_parallel.kv_grad_count)."""
    tp, pp, M = lay.tp, lay.pp, lay.micro_batches
    if tp == 1:
        return 0
    g = Flat(tp) if g is None else g
    rows, T, C = lay.rows, cfg.block_size // lay.cp, cfg.n_embd          # --cp: the rank's T/cp tokens
    n_layers = rank_layer_count(cfg, stage, pp, chunks(lay))
    n_moe = rank_moe_count(cfg, stage, pp, chunks(lay))
    first, last = stage == 0, stage == pp - 1
    kv, (kv_calls, kv_elems) = 0, tensor_parallel.kv_grad_count(cfg, tp, n_layers)
    if kv_calls:                                          # k_proj's and v_proj's (C, hs) copies, per block
        kv = kv_calls * g.first(tensor_parallel.kv_share(cfg, tp)).all_reduce(kv_elems // kv_calls, itemsize)
    if lay.sp:                                            # sequence_parallel.sp_count, by kind
        count = sequence_parallel.sp_count(cfg, rows, T, tp, n_layers, first, last, lay.recompute)
        (block_calls, block_elems), (final_calls, final_elems), pos = sequence_parallel.replicated_sums(cfg)
        n = rows * T * C
        gathers = sum(count[k][0] for k in ("f_gather", "g_gather", "regather"))
        scatters = count["f_scatter"][0] + count["g_scatter"][0]
        per_mb = (gathers * g.all_gather(n // tp, itemsize) + scatters * g.reduce_scatter(n, itemsize)
                  # the replicated parameters' gradient sums, each a (C,) vector: norms (and GPT-2's biases)
                  + block_calls * n_layers * g.all_reduce(block_elems // block_calls, itemsize)
                  + (final_calls * g.all_reduce(final_elems // final_calls, itemsize)
                     + 3 * g.all_reduce(rows * T, compute_itemsize) if last else 0)
                  + (g.all_gather(T // tp * pos, itemsize) if first and pos else 0))   # wpe's rows
        return M * (per_mb + kv) + g.all_reduce(1, INT64)
    act_calls, row_calls = tensor_parallel.megatron_calls(n_layers - n_moe, first, last, lay.recompute)
    # a MoE block runs its MLP whole on every tp rank: attention's f and g alone, half a block's calls
    act_calls += tensor_parallel.megatron_calls(n_moe, False, False, lay.recompute)[0] // 2
    per_mb = (act_calls * g.all_reduce(rows * T * C, itemsize)           # (b, T, C) activations, gradients
              + row_calls * g.all_reduce(rows * T, compute_itemsize))    # the cross-entropy's (b*T,)
    return M * (per_mb + kv) + g.all_reduce(1, INT64)     # + the gradient norm


def pooled_counts(cfg: GPTConfig, n_virtual: int):
    """Mixtral's pooled load-balancing loss on a pipeline (stage.py, moe.MoESettings.pooled):
    every activation and gradient message is followed by the micro-batch's counts, an int64
    (groups, E) array, groups = 1 (a micro-batch of one dp rank is one routing group): after an
    activation, the counts of the MoE blocks before ((0, E), no payload, while there are
    none); after a gradient, the whole model's. -> f(send instruction, stage, pp): its
    payload bytes; None when no counts travel (no MoE, or Switch's per-layer loss). The
    planner has no --moe-aux-coef: it assumes the trainer's default 0.01, > 0 (with 0 the
    trainer sends no counts, 2 x (128 + 8E) bytes a micro-batch and boundary fewer)."""
    if not cfg.moe_experts or cfg.moe_router != "mixtral":
        return None
    parts = schedules.partition(cfg.n_layer, n_virtual)
    first_moe = min(v for v, r in enumerate(parts) if any(cfg.is_moe(i) for i in r))
    row = INT64 * cfg.moe_experts

    def payload(ins, stage: int, pp: int) -> int:
        if isinstance(ins, schedules.SendGrad):
            return row
        return row if ins.chunk * pp + stage >= first_moe else 0     # the sender's virtual stage
    return payload


def pp_bytes(cfg: GPTConfig, stage: int, lay, itemsize: int, g=None):
    """Point-to-point messages and the loss broadcast of one step on the pp group g
    (pipeline.py): one message per SendActivation and SendGrad in the stage's instruction
    list, to the rank of the neighbouring virtual stage (schedules.neighbour); with Mixtral's
    pooled loss each followed by its counts (pooled_counts)."""
    pp, M, V = lay.pp, lay.micro_batches, chunks(lay)
    if pp == 1:
        return 0
    g = Flat(pp, stage) if g is None else g
    act = lay.rows * cfg.block_size // lay.cp * cfg.n_embd * itemsize     # (b, T/cp, C), + a header
    act //= lay.tp if lay.sp else 1                                        # --sp: (b, T/tp, C)
    counts = pooled_counts(cfg, pp * V)
    sent = sum(g.send(act, peer) + (g.send(counts(ins, stage, pp), peer) if counts else 0)
               for ins in schedules.schedule(lay.schedule, stage, pp, M, V) if isinstance(ins, schedules.SENDS)
               for peer in [schedules.neighbour(stage, ins.chunk, ins.peer, pp, V)[0]])
    if cfg.tie_embeddings and stage in (0, pp - 1):       # the embedding's gradient to the other end (ZeRO: its shard)
        n = tensor_parallel.local_size(cfg.family.embedding, (cfg.vocab_size, cfg.n_embd), lay.tp, cfg)
        N = lay.grad_ranks
        sent += g.send((padded(n, N) // zero_split(lay)[0] if lay.zero else n) * itemsize, pp - 1 - stage)
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


def cp_bytes(cfg: GPTConfig, stage: int, lay, compute_itemsize: int, groups: dict | None = None):
    """The cp group's messages of one step, by --cp-impl: context_parallel.step_traffic (one
    call_traffic per layer of the device and micro-batch, n = b*(T/cp)*kv_width elements of
    its keys, the forward twice with --recompute full), the trainer summary's formula too;
    groups: the placed groups (plan/context.groups: Traffic, the bytes that leave the host),
    else one host (bytes)."""
    if lay.cp == 1:
        return 0
    return context_parallel.step_traffic(rank_layer_count(cfg, stage, lay.pp, chunks(lay)), lay.micro_batches,
                                         lay.rows, cfg.block_size, lay.cp, cfg, lay.tp, compute_itemsize,
                                         lay.recompute, lay.cp_impl or "ring", lay.cp_ulysses, groups)[1]


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
