"""Context parallelism (--cp C): every sequence of T tokens is split across the C ranks of a
cp group, T/C tokens each, at the positions ring_attention.positions gives (zig-zag by
default: chunks i and 2C-1-i of 2C). docs/context-parallel.md; docs/design.md §6.

Only attention mixes tokens, so only attention talks (--cp-impl): ring_attention.RingAttention
passes K and V round the cp group, ulysses.UlyssesAttention turns sequence shards into head
shards and back, allgather_attention.AllGatherAttention gathers K and V whole, and hybrid is
Ulysses inside groups with the ring across them. Everything else runs on the rank's own
tokens, unchanged:
    the embedding   wte[idx_local] + wpe[positions]        (its positions, not 0..T/C-1)
    LayerNorm, MLP, the projections, ln_f, the head        per token
    the loss        sum of its tokens' cross-entropies / (B T), the global token count
so the loss summed over the cp ranks (and dp) is the mean over the global batch, and every
parameter's gradient is a partial sum over this rank's tokens: the gradient synchroniser
sums it over dp x cp (ProcessGrid.grad_group), and ZeRO shards over the same ranks.

A model takes part through its Parts (model/contract.py): ContextSplit.attention is its attention
and ContextSplit.global_positions its positions (minipar/parallel/parallelize.py).
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from minipar import comm
from minipar.comm.helpers import shaped
from minipar.parallel.context import ring_attention
from minipar.parallel.context.packed import AllGatherSelfAttention, RingSelfAttention
from minipar.parallel.context.ring_attention import LAYOUTS, positions
from minipar.parallel.context.ulysses import UlyssesAttention, head_split
from minipar.comm.group import Group

__all__ = ["ContextSplit", "RingSelfAttention", "AllGatherSelfAttention", "IMPLS", "LAYOUTS", "step_traffic",
           "summary"]


IMPLS = ("ring", "ulysses", "allgather", "hybrid")


class ContextSplit:
    """This rank's share of every sequence: its cp group, the layout of the split and how its
    attention talks (impl: ring, ulysses, allgather or hybrid). hybrid: Ulysses over groups of
    `ulysses` consecutive cp ranks (default: the cp ranks of a host), ring attention across
    them; its two groups are made here (a collective over the cp group)."""

    def __init__(self, group, layout: str = "zigzag", impl: str = "ring", ulysses: int | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if impl not in IMPLS:
            raise ValueError(f"--cp-impl must be one of {IMPLS}, got {impl!r}")
        self.group, self.layout, self.impl, self.ulysses = group, layout, impl, None
        if impl == "hybrid":
            U = self.ulysses = hybrid_degree(group, ulysses)
            c = group.rank
            self.ulysses_group = Group.split(group.comm, c // U, c % U, axis="cp")
            self.ring_group = Group.split(group.comm, c % U, c // U, axis="cp")

    @property
    def size(self) -> int:
        return self.group.size

    def positions(self, T: int) -> np.ndarray:
        """Global positions of this rank's T/C tokens of a sequence of T, in its order."""
        return positions(self.group.rank, self.group.size, T, self.layout)

    def global_positions(self, t: int, block_size: int) -> np.ndarray:
        """Parts.positions with context parallelism: the global positions of this rank's t
        tokens of a sequence of t * C."""
        T = t * self.size
        if T > block_size:
            raise ValueError(f"sequence length {T} > block_size {block_size}")
        return self.positions(T)

    def local(self, a) -> np.ndarray:
        """This rank's tokens of a (..., T) array of ids or targets: (..., T/C)."""
        a = np.asarray(a)
        return a[..., self.positions(a.shape[-1])]

    def sent(self) -> dict:
        """call_traffic's groups: what this rank's calls send on each of its groups."""
        if self.impl == "hybrid":
            return {"cp": Sent(self.group), "ulysses": Sent(self.ulysses_group), "ring": Sent(self.ring_group)}
        return {"cp": Sent(self.group), "ulysses": Sent(self.group)}

    def attention(self, qkv, n_head: int, n_kv_head: int | None = None):
        """Causal self-attention of the whole sequence for this rank's queries."""
        if self.impl == "ulysses":
            return UlyssesAttention.apply(qkv, n_head, self.group, self.layout, n_kv_head, None)
        if self.impl == "hybrid":
            return UlyssesAttention.apply(qkv, n_head, self.ulysses_group, self.layout, n_kv_head, self.ring_group)
        cls = RingSelfAttention if self.impl == "ring" else AllGatherSelfAttention
        return cls.apply(qkv, n_head, self.group, self.layout, n_kv_head)


def hybrid_degree(group, ulysses: int | None) -> int:
    """--cp-impl hybrid's Ulysses degree U on this cp group: `ulysses` (--cp-ulysses), else the
    cp ranks of a host when every host holds as many and they are consecutive (Ulysses inside a
    host, the ring across hosts); one host: U = C, Ulysses alone."""
    C = group.size
    if ulysses is None:
        per_host = C // group.n_nodes
        if C % group.n_nodes or any(group.nodes[r] != r // per_host for r in range(C)):
            raise ValueError(f"--cp-impl hybrid: the cp group's {C} ranks are not in equal runs on its "
                             f"{group.n_nodes} hosts (hosts {group.nodes}): give --cp-ulysses U")
        ulysses = per_host
    if ulysses < 1 or C % ulysses:
        raise ValueError(f"--cp-ulysses {ulysses} must divide --cp {C}")
    return ulysses


class Sent:
    """What one rank's calls send on a group of its attention (a comm.Group, or anything with
    its size, rank and hosts): the costs call_traffic adds up, by the algorithm comm's
    dispatcher picks for the group and size (an all-to-all across hosts: hierarchical). The
    planner passes its own, which place the same messages on hosts (plan_hosts.Placed)."""

    def __init__(self, group):
        self.group = group

    def ring(self, messages: int, nbytes: int) -> int:
        """Ring attention's `messages` sends of nbytes in all, to the next rank."""
        return nbytes

    def all_gather(self, n_each: int, itemsize: int) -> int:
        """Every algorithm sends C - 1 pieces of n_each (Bruck, direct, ring, hierarchical)."""
        return (self.group.size - 1) * n_each * itemsize

    def reduce_scatter(self, n: int, itemsize: int) -> int:
        """Every piece but its own (n divisible by C here: equal pieces)."""
        return (n - n // self.group.size) * itemsize

    def all_to_all(self, x) -> int:
        return comm.all_to_all_sent(self.group, x)


def flat(C: int) -> Sent:
    """Sent on C ranks of one host, as rank 0."""
    return Sent(SimpleNamespace(size=C, rank=0, nodes=(0,) * C, n_nodes=1))


def kv_width(cfg, tp: int) -> int:
    """The channels of the key (or value) heads one tp rank holds: Hkv/tp heads of hs, at least
    one head (tp > Hkv: a shared one). GPT-2: C/tp."""
    return max(1, cfg.kv_heads // tp) * cfg.head_size


def call_traffic(impl: str, rows: int, T: int, C: int, cfg, tp: int, itemsize: int,
                 forwards: int = 1, ulysses: int | None = None, groups: dict | None = None) -> tuple:
    """(messages, bytes) one rank sends for one attention call and its backward, `rows`
    sequences of T tokens split over C ranks, n = rows (T/C) kv_width elements of its keys
    (only the key heads travel):
        ring       ring_attention.ring_traffic(n)
        allgather  forwards all-gathers of 2n (k, v), one reduce-scatter of 2n C (dK, dV):
                   allgather_traffic(n)
        ulysses    forwards + 1 all-to-alls of the q, k, v pieces and as many of the output's
                   (its heads after tp: ulysses.head_split): ulysses_traffic, pairwise
        hybrid     Ulysses over U = `ulysses` ranks, then the ring over C/U on the U t tokens
                   and the heads Ulysses left
    groups: {"cp", "ulysses", "ring"} -> Sent, or the planner's placed groups (bytes are then
    its Traffic); default one host. messages: the ring's point-to-point messages, or the
    collectives called."""
    width, t, hs = kv_width(cfg, tp), T // C, cfg.head_size
    if C == 1:
        return 0, 0
    U = C if impl == "ulysses" else ulysses
    groups = groups or {"cp": flat(C), "ulysses": flat(U or 1), "ring": flat(C // (U or 1))}
    n = rows * t * width
    if impl == "ring":
        messages, nbytes = ring_attention.ring_traffic(n, C, itemsize, forwards)
        return messages, groups["cp"].ring(messages, nbytes)
    if impl == "allgather":
        g = groups["cp"]
        return forwards + 1, forwards * g.all_gather(2 * n, itemsize) + g.reduce_scatter(2 * n * C, itemsize)
    Hq, kv = head_split(cfg.n_head // tp, width // hs, U)
    messages, nbytes = 0, 0
    if U > 1:                                  # the q, k, v pieces and the output's, each way
        g = groups["ulysses"]
        qkv, out = (shaped((U, rows, t, w * hs), itemsize) for w in (Hq + 2 * kv, Hq))
        messages, nbytes = 2 * (forwards + 1), (forwards + 1) * (g.all_to_all(qkv) + g.all_to_all(out))
    if impl == "hybrid" and C > U:
        ring_messages, ring_bytes = ring_attention.ring_traffic(rows * U * t * kv * hs, C // U, itemsize, forwards)
        messages, nbytes = messages + ring_messages, nbytes + groups["ring"].ring(ring_messages, ring_bytes)
    return messages, nbytes


def step_traffic(layers: int, micro_batches: int, rows: int, T: int, C: int, cfg, tp: int, itemsize: int,
                 recompute: str = "none", impl: str = "ring", ulysses: int | None = None,
                 groups: dict | None = None) -> tuple:
    """(messages, bytes) a rank sends over its cp group in one training step: one attention call
    per layer it runs and micro-batch (call_traffic); with --recompute full each forward runs
    twice. itemsize: of the compute dtype (fp16/bf16 attend in float32)."""
    messages, nbytes = call_traffic(impl, rows, T, C, cfg, tp, itemsize, 2 if recompute == "full" else 1, ulysses,
                                    groups)
    calls = layers * micro_batches
    return calls * messages, calls * nbytes


FORMULAS = {   # impl: the summary's words for call_traffic, per layer and micro-batch
    "ring": "[2n(C-1) fwd{full} + 2n(C-1) + 2nC bwd] x {s} B + {messages} headers, n = {n}",
    "allgather": "[all-gather 2n(C-1) fwd{full} + reduce-scatter 2n(C-1) bwd] x {s} B, n = {n}",
    "ulysses": "[(C-1)/C of q, k, v and of o fwd{full}, of do and dq, dk, dv bwd: all-to-alls] x {s} B, "
               "{heads} heads a rank, n = {n}",
    "hybrid": "[Ulysses' all-to-alls over U = {U} ranks, {heads} heads a rank, + the ring over C/U = {R} on "
              "U t tokens{full}] x {s} B, n = {n}",
}


def summary(rows_log: list, cfg, *, cp: int, layout: str, rows: int, micro_batches: int, layers: int,
            tp: int, itemsize: int, recompute: str, impl: str = "ring",
            ulysses: int | None = None, groups: dict | None = None) -> tuple[dict, list[str]]:
    """The summary's context-parallel figures for this rank: the bytes its attention sent per
    step (the rows' "cp" axis) beside step_traffic, the seconds waited on the ring (cp_wait_s),
    and the sub-blocks of scores each cp rank computes per pass (the load balance of the
    layout). rows: sequences per micro-batch of this dp rank; layers: those this rank runs;
    itemsize: of the dtype attention computes in; groups: ContextSplit.sent() (the algorithms
    comm picks on them)."""
    C, M, T = cp, micro_batches, cfg.block_size
    messages, want = step_traffic(layers, M, rows, T, C, cfg, tp, itemsize, recompute, impl, ulysses, groups)
    sent = float(np.mean([r["bytes_by_axis"].get("cp", 0) for r in rows_log]))
    wait = float(np.mean([r["cp_wait_s"] for r in rows_log]))
    work = [ring_attention.blocks(r, C, T, layout) for r in range(C)]
    other = "contiguous" if layout == "zigzag" else "zigzag"
    work_other = [ring_attention.blocks(r, C, T, other) for r in range(C)]
    out = {"cp": C, "impl": impl, "layout": layout, "tokens_per_rank": T // C, "bytes_per_step": sent,
           "theory_bytes_per_step": want, "messages_per_step": messages, "wait_s_per_step": wait,
           "sub_blocks_per_rank": work, f"sub_blocks_per_rank_{other}": work_other}
    ratio = sent / want if want else float("nan")
    U = C if impl == "ulysses" else ulysses
    pairs = "/".join(str(ring_attention.pairs(r, C, T, layout)) for r in range(C))
    R = C // (U or 1)                                   # hybrid: the ring's members
    ring_blocks = "/".join(str(ring_attention.blocks(r, R, T, layout)) for r in range(R))
    balance = {"ring": f"score sub-blocks per rank and pass {'/'.join(map(str, work))} "
                       f"({other}: {'/'.join(map(str, work_other))})",
               "ulysses": "every rank attends over all T tokens for its H/C heads: the same work on each",
               "hybrid": f"score sub-blocks per ring rank and pass, on U t tokens: {ring_blocks}",
               "allgather": f"(query, key) pairs per rank {pairs}"}[impl]
    width = kv_width(cfg, tp)
    heads = "/".join(map(str, head_split(cfg.n_head // tp, width // cfg.head_size, U))) if U else ""
    formula = FORMULAS[impl].format(full=" x 2 (full recompute)" if recompute == "full" else "", s=itemsize,
                                    messages=messages, heads=heads, U=U, R=C // U if U else C,
                                    n=f"{rows}x{T // C}x{width}" if impl != "ulysses" else f"B t = {rows}x{T // C}")
    line = (f"  context parallel: cp={C} {impl} ({layout}), {T // C} of {T} tokens per rank; sent "
            f"{sent:,.0f} B/step per rank, theory {layers} layer(s) x {M} micro-batch(es) x {formula} "
            f"= {want:,} B (ratio {ratio:.3f}); waited {wait * 1e3:.1f} ms/step for its messages; "
            + balance)
    return out, [line]
