"""Expert parallelism (--ep P): a MoE layer's E experts split over the P ranks of an ep group
carved out of the dp group (grid.py), E/P each: rank j holds experts j E/P .. (j+1) E/P - 1.
docs/moe.md; docs/design.md §6.

Each rank routes its own tokens (moe.Router: the same choices as on one process), then

    dispatch   all-to-all over the ep group: each kept assignment's token row to the rank
               of its expert, in expert order                         (M, C) -> (M', C)
    compute    each local expert's MLP on the rows it received from every rank
    combine    all-to-all back: the outputs to the ranks the rows came from  (M', C) -> (M, C)
    then       y[token] += w_k x output, as on one process (moe.ScatterRows)

and backward runs the two all-to-alls again the other way (AllToAll.backward): four per MoE
layer and micro-batch. Without a capacity the rows are exactly the kept assignments (a
variable all-to-all; its row counts travel first, and each rank also learns how many rows
of each of its experts come from each source: an equal all-to-all of E/P int64 per rank).
With --moe-capacity-factor each expert's rows are padded to its capacity, so every message
has the capacity tensor's shape, (E/P) cap rows, and nothing else needs exchanging.

Bytes one rank sends per MoE layer and micro-batch (ep_bytes), rows of C elements of the
activations' dtype d: with a capacity 4 (P-1) (E/P) cap C d (each all-to-all (P-1)/P of the
E cap rows, by the pairwise exchange; Bruck's figure where comm picks it, small messages on
P >= comm.ALL_TO_ALL_BRUCK_MIN_RANKS, and the hierarchical all-to-all's on an ep group that
spans hosts, up to comm.ALL_TO_ALL_HIERARCHICAL_MAX_BYTES); without one, 2 x (rows it sends to other ranks + rows
it receives from them) x C d,
plus the counts: 4 x 8 (P-1) for the variable all-to-alls' own and one equal all-to-all of
the E row counts (8 (P-1) E/P bytes pairwise).

Gradients: an expert's weights live on the dp/ep ranks of the same ep rank (grid.expert_group)
and their gradients are summed over those only; every other parameter's over the whole dp
group (ExpertParallelSync). Summing expert gradients over all of dp would add other experts'
gradients into each: the trap tests/test_moe_cli.py plants (the replica check then stops the run).
"""
from __future__ import annotations

import math

import numpy as np

from minipar import comm
from minipar.autograd import ops
from minipar.optim.adamw import sum_of_squares
from minipar.parallel import data_parallel
from minipar.autograd.tensor import Function, Tensor, is_grad_enabled
from minipar.model.families import FAMILIES

COUNT_BYTES = 8                 # a row count on the wire: the variable all-to-all sends p - 1 of them first


def expert_of(name: str) -> int | None:
    """The routed expert a canonical parameter (of either family) belongs to, or None for every
    other parameter (a shared expert's included: every rank holds those)."""
    for family in FAMILIES.values():
        found = family.expert_of(name)
        if found is not None:
            return found[1]
    return None


class ExpertPlacement:
    """Which experts this rank holds, and its ep group."""

    def __init__(self, group: comm.Group, experts: int):
        if experts % group.size:
            raise ValueError(f"--moe-experts {experts} is not divisible by --ep {group.size}")
        self.group, self.P, self.rank, self.E = group, group.size, group.rank, experts
        self.per_rank = experts // group.size
        self.local = range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)
        self.theory_bytes = 0          # what the all-to-alls should have sent so far (ep_bytes)

    def owns(self, name: str) -> bool:
        e = expert_of(name)
        return e is None or e in self.local

    def run(self, P: dict, i: int, x2: Tensor, tokens, rows, cap, family) -> Tensor:
        """moe.moe_mlp's dispatch when experts are spread over ranks (run_experts below): the
        MoE layer calls placement.run, so the model imports no parallel module."""
        return run_experts(self, P, i, x2, tokens, rows, cap, family)


def held_elsewhere(cfg, layers, ep: int) -> int:
    """Parameters of `layers`' MoE blocks that other ep ranks hold: (E - E/ep) experts per
    block, each of its family's expert size (GPT-2: 8C^2 + 5C, c_fc, c_proj and their biases;
    Llama: 3 C F_e, w1, w2, w3)."""
    E, family = cfg.moe_experts, cfg.family
    per_expert = sum(math.prod(shape) for _, shape, _ in family.expert_specs(cfg, ""))
    return sum((E - E // ep) * per_expert for i in layers if cfg.is_moe(i))


class AllToAll(Function):
    """x's rows to the ranks of `group` (comm.all_to_all, sizes rows each, or equal pieces);
    backward sends the gradient rows back the same way round."""

    def forward(self, x, group, sizes=None):
        self.group = group
        if sizes is None:
            self.back = None
            return comm.all_to_all(group, x)
        y, self.back = comm.all_to_all(group, x, sizes=list(sizes), return_sizes=True)
        return y

    def backward(self, g):
        g = np.ascontiguousarray(g)
        return (comm.all_to_all(self.group, g) if self.back is None
                else comm.all_to_all(self.group, g, sizes=list(self.back))), None, None


class Sent:
    """What one rank's all-to-alls send on `group` (a comm.Group, or anything with its size,
    rank and hosts): the two costs ep_bytes adds up. The planner passes its own, which place
    the same messages on hosts (plan_hosts.Placed)."""

    def __init__(self, group):
        self.group = group

    def all_to_all(self, x) -> int:
        """An equal all-to-all of x (comm.all_to_all_sent)."""
        return comm.all_to_all_sent(self.group, x)

    def all_to_all_rows(self, nbytes) -> int:
        """A variable all-to-all (pairwise) sending nbytes of rows to the other ranks, after
        a row count to each."""
        return nbytes + COUNT_BYTES * (self.group.size - 1)


def ep_bytes(sent, row_bytes: int, passes: int, padded: np.ndarray | None = None, rows_out: int = 0,
             rows_in: int = 0, counts: np.ndarray | None = None):
    """Bytes one rank sends in one MoE layer's all-to-alls (sent: Sent(group), or the
    planner's placed costs), `passes` each way (2 when the backward runs too, 1 for a forward
    alone). With a capacity (padded: the dispatched (E cap, C) array) four equal all-to-alls
    of its shape. Without, the dispatch sends the rows_out rows bound for other ranks and the
    combine the rows_in that came from them, each a variable all-to-all with its 8(P-1) bytes
    of counts, and one equal all-to-all of the E row counts (counts) tells each rank its
    experts' rows by source."""
    if padded is not None:
        return 2 * passes * sent.all_to_all(padded)
    return (passes * (sent.all_to_all_rows(rows_out * row_bytes) + sent.all_to_all_rows(rows_in * row_bytes))
            + sent.all_to_all(counts))


def expert_major(counts: np.ndarray) -> np.ndarray:
    """counts (P sources, El experts) of rows arriving source-major (each source's rows in
    expert order) -> the permutation that orders them expert-major (each expert's rows in
    source order)."""
    starts = np.concatenate([[0], np.cumsum(counts.ravel())[:-1]]).reshape(counts.shape)
    return np.concatenate([np.arange(starts[s, e], starts[s, e] + counts[s, e])
                           for e in range(counts.shape[1]) for s in range(counts.shape[0])]).astype(np.int64)


def run_experts(placement: ExpertPlacement, P: dict, i: int, x2: Tensor, tokens, rows, cap, family) -> Tensor:
    """The kept assignments' rows (tokens, expert-major, rows per expert) through their
    experts on the ranks that hold them -> their outputs (M, C), in the same order."""
    E, El, Pn = placement.E, placement.per_rank, placement.P
    C = x2.shape[1]
    if cap is not None:                                 # pad every expert's rows to its capacity
        slot = np.concatenate([np.arange(n) for n in rows]).astype(np.int64) + np.repeat(np.arange(E) * cap, rows)
        index = np.full(E * cap, x2.shape[0], dtype=np.int64)          # the padding: a zero row
        index[slot] = tokens
        padded = ops.concat([x2, Tensor(np.zeros((1, C), dtype=x2.dtype))], axis=0)
        sent = ops.embedding(index, padded)                             # (E cap, C)
        got = AllToAll.apply(sent, placement.group, None)               # (P El cap, C), source-major
        counts = np.full((Pn, El), cap)
    else:
        sent = ops.embedding(tokens, x2)
        to_rank = rows.reshape(Pn, El).sum(1)
        got = AllToAll.apply(sent, placement.group, to_rank)
        counts = comm.all_to_all(placement.group, rows.astype(np.int64)).reshape(Pn, El)
    mine = placement.rank
    passes = 2 if is_grad_enabled() and x2.requires_grad else 1
    rows_out = 0 if cap is not None else int(rows.sum() - rows.reshape(Pn, El)[mine].sum())
    rows_in = 0 if cap is not None else int(counts.sum() - counts[mine].sum())
    placement.theory_bytes += ep_bytes(Sent(placement.group), C * x2.dtype.itemsize, passes,
                                       sent.data if cap is not None else None, rows_out, rows_in,
                                       rows.astype(np.int64))
    order = expert_major(counts)
    xe = ops.embedding(order, got)
    per_expert = counts.sum(0)
    parts = ops.split(xe, list(np.cumsum(per_expert)[:-1]), axis=0) if El > 1 else [xe]
    out = ops.concat([family.expert_mlp(P, family.expert_prefix(i, e), part)
                      for e, part in zip(placement.local, parts)], axis=0)
    back = AllToAll.apply(ops.embedding(np.argsort(order), out), placement.group,
                          None if cap is not None else counts.sum(1))
    return ops.embedding(slot, back) if cap is not None else back


class ExpertParallelSync:
    """The gradient synchroniser with experts: non-expert parameters summed over the dp
    group, each expert's over its replicas (grid.expert_group), by two data_parallel
    synchronisers; the GradSync protocol of data_parallel.py."""

    def __init__(self, model, grid, mode: str, bucket_mb: float):
        params = model.parameters()
        self.experts = [p for n, p in model.named_parameters() if expert_of(n) is not None]
        ids = {id(p) for p in self.experts}
        self.others = [p for p in params if id(p) not in ids]
        self.ep_group = grid.ep_group
        self.syncs = [data_parallel.make(ps, g, mode, bucket_mb) if g.size > 1 else data_parallel.NoSync(ps)
                      for ps, g in ((self.others, grid.dp_group), (self.experts, grid.expert_group))]

    exposed_seconds = property(lambda self: sum(s.exposed_seconds for s in self.syncs))

    def zero_grad(self):
        for s in self.syncs:
            s.zero_grad()

    def start_step(self):
        for s in self.syncs:
            s.start_step()

    def sync_now(self, on: bool):
        for s in self.syncs:
            s.sync_now(on)

    def finish(self):
        for s in self.syncs:
            s.finish()

    def grad_norm_sq(self, model) -> float:
        """Every rank holds its synced gradients: the non-expert ones are the same on every
        ep rank, the experts differ, so only the experts' sum of squares is added over ep."""
        ids = {id(p) for p in self.experts}
        counted = [(id(p), sum_of_squares(p.grad)) for n, p in model.named_parameters()
                   if p.grad is not None and model.counts_in_norm(n)]        # once over tp and pp
        others = sum(sq for i, sq in counted if i not in ids)
        mine = np.array([sum(sq for i, sq in counted if i in ids)])
        experts = comm.all_reduce(self.ep_group.with_axis("dp"), mine)[0]     # counted as the norm's, on dp
        return model.reduce_norm_sq(others + float(experts))

    def local_found_inf(self, model) -> bool:
        return self.syncs[0].local_found_inf(model)

    def tied_grad(self, w) -> np.ndarray:
        return self.syncs[0].tied_grad(w)


def gather_experts(model, local: dict) -> dict:
    """{name: this rank's array} with every expert's arrays added (all-gathered over the ep
    group, layer by layer): what a layout without ep would hold. Collective over ep."""
    placement = None if model.moe is None else model.moe.placement
    if placement is None:
        return local
    out, family = dict(local), model.family
    layers = sorted({family.expert_of(n)[0] for n in local if family.expert_of(n) is not None})
    for i in layers:
        mine = [n for n in local if (family.expert_of(n) or (None,))[0] == i]
        flat = np.concatenate([np.ravel(local[n]) for n in mine])
        every = comm.all_gather(placement.group, flat).reshape(placement.P, -1)
        first = family.expert_prefix(i, placement.local[0])
        kinds = [n[len(first):] for n in mine if n.startswith(first)]
        for r in range(placement.P):
            off = 0
            for e in range(r * placement.per_rank, (r + 1) * placement.per_rank):
                for kind in kinds:
                    n = family.expert_prefix(i, e) + kind
                    size = int(np.prod(model.full_shapes[n]))
                    out[n] = every[r, off:off + size].reshape(model.full_shapes[n]).copy()
                    off += size
    return out


def summary(rows_log: list, cfg, *, ep: int, expert_replicas: int, moe_layers: int, micro_batches: int,
            recompute: str) -> tuple[dict, list[str]]:
    """The summary's expert-parallel line: the all-to-alls' bytes per step on the "ep" axis of
    the ledger beside ep_bytes for the tokens this rank routed (the rows' ep_theory_bytes).
    moe_layers: the MoE blocks this rank runs; expert_replicas: the ranks each expert is
    summed over."""
    sent = float(np.mean([r["bytes_by_axis"].get("ep", 0) for r in rows_log]))
    want = float(np.mean([r["ep_theory_bytes"] for r in rows_log]))
    out = {"ep": ep, "experts_per_rank": cfg.moe_experts // ep, "bytes_per_step": sent,
           "theory_bytes_per_step": want, "expert_replicas": expert_replicas}
    n = 6 if recompute == "full" else 4          # full recompute: the forward's two again
    how = (f"{n} all-to-alls of (P-1) x E/P x capacity rows" if cfg.moe_capacity_factor
           else f"the routed rows to and from other ranks, {n} all-to-alls, + the row counts")
    return out, [f"  expert parallel: ep={ep}, {out['experts_per_rank']} of {cfg.moe_experts} experts per "
                 f"rank, each summed over {out['expert_replicas']} replica(s); all-to-all sent {sent:,.0f} B/step "
                 f"per rank over {moe_layers} MoE layer(s) x {micro_batches} micro-batch(es), theory ({how}) "
                 f"{want:,.0f} B (ratio {sent / want if want else float('nan'):.3f})"]
