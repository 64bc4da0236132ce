"""Mixture of experts: a block's MLP replaced by E expert MLPs and a router (Shazeer et al.
2017, arXiv:1701.06538; GShard, Lepikhin et al. 2020, arXiv:2006.16668; Switch Transformer,
Fedus et al. 2021, arXiv:2101.03961). --moe-experts E --moe-top-k K --moe-every N: block i is
a MoE block when (i + 1) % N == 0. docs/moe.md; the canonical names in docs/design.md §2.

For the N tokens x (N, C) of a forward:

    z = x W_r                      router logits (N, E), W_r = h.{i}.mlp.router.weight (C, E)
    p = softmax(z)                 over the experts, per token
    e_1..e_K = the K largest p     ties to the lower expert id
    w_k = p_{e_k} / sum_j p_{e_j}  the combine weights, renormalised over the K chosen (K = 1:
                                   w = p_{e_1}, as Switch does, so that the router still learns
                                   from the loss: a renormalised single weight would be 1)
    y = sum over the token's kept (k, e_k) of  w_k MLP_{e_k}(x)

Routing groups. Capacity and the load-balancing loss are defined over a group of tokens, the
rows of one micro-batch on one data-parallel rank: `group_rows` sequences (MoESettings), so
that the single-process twin, which splits its batch into the same groups, decides the same.
(A forward whose rows do not divide into groups, sampling one sequence, is one group.)

Capacity (--moe-capacity-factor F > 0). An expert takes at most cap = ceil(F N_g K / E) of a
group's N_g tokens' assignments. Slots are claimed by choice, then by token: every token's
first choice in token order, then every second choice, ... An assignment that finds its
expert full is dropped: it adds nothing (the token keeps its residual), and the other
weights are not renormalised. F = 0: no capacity, nothing dropped.

Load balancing (Switch Transformer's auxiliary loss, with K choices), per group g:
    f_e = assignments routed to e (before dropping) / (N_g K)     P_e = mean_g p_e
    aux_g = E sum_e f_e P_e                                       (1 when perfectly balanced)
and the router z-loss (ST-MoE, Zoph et al. 2022, arXiv:2202.08906), zloss_g = mean_g lse(z)^2.
The objective is the cross-entropy of docs/design.md §1 plus, for every MoE layer,
aux_coef x the mean of aux_g over the global batch's groups (and z_coef x that of zloss_g).
The trainer's loss row stays the cross-entropy; the summary reports aux. Their gradient
enters in the router's backward (Router.backward: aux_weight, z_weight are the coefficients
over the number of groups, times the loss scale with fp16), so it needs no extra graph edge
and works on any pipeline stage.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from minipar.autograd import ops
from minipar.autograd.dtypes import compute, store
from minipar.autograd.tensor import Function, Tensor, is_grad_enabled


@dataclass
class MoESettings:
    """What a MoE layer needs besides its weights, set by the trainer (or a test)."""
    experts: int
    top_k: int
    capacity_factor: float = 0.0     # 0: no capacity, no drops
    aux_coef: float = 0.0
    z_coef: float = 0.0
    group_rows: int | None = None    # sequences per routing group; None: the whole forward
    groups_total: int = 1            # routing groups in the global batch: the mean's divisor
    loss_scale: float = 1.0          # fp16's loss scale, which the injected gradients carry
    stats: list | None = None        # collects (block, Decisions) of every training forward
    placement: object = None         # --ep: expert_parallel.ExpertPlacement (this rank's experts)
    router: str = "switch"           # the load-balancing loss: "switch" per layer, "mixtral" pooled
    layers: int = 1                  # the model's MoE blocks: Mixtral's pool is over all of them
    pool: object = None              # "mixtral": the Pool of the forward in progress (new_forward)
    shared: int = 0                  # shared experts per MoE block (DeepSeekMoE)
    block_word: str = "h"            # the family's blocks' name, for the summary: "h.3", "layers.3"

    pools: dict = field(default_factory=dict)    # a pipeline's: micro-batch -> its Pool

    def new_forward(self):
        """A forward of the whole model starts: Mixtral's statistics pool afresh."""
        self.pool = Pool() if self.router == "mixtral" else None

    @property
    def pooled(self) -> bool:
        """Does the load-balancing loss need every MoE block's counts (Mixtral's, weighted)?
        On a pipeline they then travel with the activations and gradients (stage.py)."""
        return self.router == "mixtral" and self.aux_coef > 0

    def use_pool(self, mb: int):
        """A pipeline runs a forward or backward of micro-batch mb: its Pool is the one in use
        (forwards and backwards of several micro-batches interleave)."""
        self.pool = self.pools.setdefault(mb, Pool())

    def per_token(self, coef: float, G: int) -> float:
        """d(objective) / d(a group's mean over its G tokens), times the loss scale."""
        return coef / self.groups_total / G * self.loss_scale


def settings_of(cfg, **kw) -> "MoESettings":
    """A MoE model's routing settings from its config (kw: the run's, e.g. the loss weights)."""
    return MoESettings(cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity_factor, router=cfg.moe_router,
                       layers=max(1, cfg.moe_layers), shared=cfg.moe_shared_experts,
                       block_word=cfg.family.block_word, **kw)


@dataclass
class Pool:
    """Mixtral's load-balancing statistics of one forward, pooled over its MoE blocks, per
    routing group: the slots routed to each expert, and the sum of the router's probabilities.
    A block adds its own once (a full recomputation runs the block's forward again: it does not
    add twice)."""
    counts: dict = field(default_factory=dict)       # group -> (E,) slots over the blocks so far
    psum: dict = field(default_factory=dict)         # group -> (E,) sum of p over blocks and tokens
    blocks: set = field(default_factory=set)

    def add(self, block: int, group: int, load: np.ndarray, p_sum: np.ndarray):
        self.counts[group] = self.counts.get(group, 0) + load
        self.psum[group] = self.psum.get(group, 0) + p_sum

    def counts_array(self, experts: int) -> np.ndarray:
        """The counts so far, (groups, E) int64, by group (none yet: (0, E)): what a pipeline
        stage passes on."""
        rows = [np.asarray(self.counts[g], dtype=np.int64) for g in sorted(self.counts)]
        return np.stack(rows) if rows else np.zeros((0, experts), dtype=np.int64)

    def set_counts(self, counts: np.ndarray):
        """The counts of every block before (with a forward's activation) or of the whole
        model (with a backward's gradient) from the neighbouring stage: they replace this
        stage's, which they include."""
        self.counts = {g: np.array(row) for g, row in enumerate(counts)}


def probabilities(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The router's softmax over the experts and its log-sum-exp, from the logits z (N, E):
    (p (N, E), lse (N,))."""
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    return np.exp(z - lse[:, None]), lse


def top_k(logits: np.ndarray, k: int, router: str = "switch") -> tuple[np.ndarray, np.ndarray]:
    """Each token's k experts and their combine weights, from the router's logits (N, E):
    (choice (N, k) int64, the k largest p = softmax(logits) largest first, ties to the lower
    expert id; weights (N, k), the chosen p renormalised over the k). Switch's k = 1 keeps
    p itself (a renormalised single weight would be 1 and carry no gradient); "mixtral"
    renormalises k = 1 too."""
    p, _ = probabilities(logits)
    choice = np.argsort(-p, axis=1, kind="stable")[:, :k]                # ties: the lower id first
    picked = np.take_along_axis(p, choice, 1)
    renormalise = k > 1 or router == "mixtral"
    return choice, (picked / picked.sum(1, keepdims=True) if renormalise else picked)


def capacity(tokens: int, top_k: int, experts: int, factor: float) -> int | None:
    """Slots per expert in a group of `tokens`: ceil(F N K / E); None without a capacity."""
    return None if factor <= 0 else math.ceil(factor * tokens * top_k / experts)


def claim_slots(choice: np.ndarray, experts: int, cap: int | None) -> np.ndarray:
    """kept (N, K) bool for one group: choice by choice, token by token, each assignment
    takes a slot of its expert while the expert has one."""
    kept = np.ones(choice.shape, dtype=bool)
    if cap is None:
        return kept
    used = np.zeros(experts, dtype=np.int64)
    for k in range(choice.shape[1]):
        for e in range(experts):
            tokens = np.flatnonzero(choice[:, k] == e)            # in token order
            free = max(0, cap - used[e])
            kept[tokens[free:], k] = False
            used[e] += len(tokens)
    return kept


@dataclass
class Decisions:
    """What one router call decided (filled by Router.forward): choice (N, K) expert ids,
    kept (N, K), and per group the load before dropping, the drops, aux and zloss."""
    choice: np.ndarray | None = None
    kept: np.ndarray | None = None
    load: list = field(default_factory=list)        # per group: (E,) assignments per expert
    dropped: list = field(default_factory=list)     # per group: assignments dropped
    aux: list = field(default_factory=list)
    zloss: list = field(default_factory=list)


class Router(Function):
    """(x (N, C), w_r (C, E)) -> the combine weights (N, K); the choices in `decisions`."""

    def forward(self, x, w, s: MoESettings, decisions: Decisions, G: int, block: int = 0):
        """G: tokens per routing group (N is a multiple of it); block: the MoE block's index
        (Mixtral's pool adds each block once)."""
        self.dtype, (x, w) = x.dtype, compute(x, w)
        N, E, K = x.shape[0], s.experts, s.top_k
        z = x @ w                                                     # (N, E)
        p, lse = probabilities(z)
        choice, weights = top_k(z, K, s.router)                       # ties: the lower id first
        total = np.take_along_axis(p, choice, 1).sum(1, keepdims=True)
        self.renormalised = K > 1 or s.router == "mixtral"           # Switch's K = 1 keeps p itself
        kept = np.zeros_like(choice, dtype=bool)
        self.f = np.zeros((N, E))                                    # each token's group's f_e (Switch)
        pool = s.pool if s.router == "mixtral" else None
        adding = pool is not None and block not in pool.blocks
        for a in range(0, N, G):
            g = slice(a, a + G)
            load = np.bincount(choice[g].ravel(), minlength=E)
            kept[g] = claim_slots(choice[g], E, capacity(G, K, E, s.capacity_factor))
            f = load / (G * K)
            self.f[g] = f
            decisions.load.append(load)
            decisions.dropped.append(int((~kept[g]).sum()))
            # Switch: E sum f_e P_e (1 when balanced); Mixtral's, this block's share: E sum (load/G) P_e (K)
            decisions.aux.append(float(E * (f * (K if s.router == "mixtral" else 1) * p[g].mean(0)).sum()))
            decisions.zloss.append(float((lse[g] ** 2).mean()))
            if adding:
                pool.add(block, a // G, load, p[g].sum(0))
        if adding:
            pool.blocks.add(block)
        if s.router == "mixtral" and s.aux_coef and pool is None and is_grad_enabled():
            raise RuntimeError("the Mixtral load-balancing loss pools every MoE block of a forward: start "
                               "each forward with MoESettings.new_forward() (Model.__call__ does)")
        decisions.choice, decisions.kept = choice, kept
        self.s, self.G, self.pool = s, G, pool
        self.save(x, w, p, lse, choice, weights, total)
        return store(weights, self.dtype)

    def aux_gradient(self, N: int) -> np.ndarray:
        """d(objective) / d p (N, E) of the load-balancing loss, its f held constant (the choices
        are not differentiable). Switch, per block and group g: aux_coef E f_e / N_g per p[n, e],
        f_e the block's own. Mixtral, per group, pooled over the L MoE blocks: aux_g = E sum_e
        f_e P_e with f_e = slots to e / (L N_g) (summing to K) and P_e = sum of p over the
        blocks and tokens / (L N_g), so d aux_g / d p[l, n, e] = E f_e / (L N_g)."""
        s, G, E = self.s, self.G, self.s.experts
        if s.router != "mixtral":
            return s.per_token(s.aux_coef, G) * E * self.f
        L = s.layers
        f = np.concatenate([np.broadcast_to(self.pool.counts[a // G] / (L * G), (G, E)) for a in range(0, N, G)])
        return s.per_token(s.aux_coef, G) * E * f / L

    def backward(self, g):
        x, w, p, lse, choice, weights, total = self.saved
        s, G = self.s, self.G
        g = compute(g)
        # w_k = p_k / sum_j p_j:  d p_j = (g_j - sum_k g_k w_k) / sum;  Switch's K = 1: w = p, d p = g
        dpicked = (g - (g * weights).sum(1, keepdims=True)) / total if self.renormalised else g
        dp = np.zeros_like(p)
        np.put_along_axis(dp, choice, dpicked, 1)
        if s.aux_coef:
            dp += self.aux_gradient(p.shape[0])                       # the load-balancing loss
        dz = p * (dp - (dp * p).sum(1, keepdims=True))                # softmax backward
        dz += s.per_token(s.z_coef, G) * 2 * lse[:, None] * p         # z-loss: 2 lse p / N_g
        dx = store(dz @ w.T, self.dtype) if self.needs_input_grad[0] else None
        dw = store(x.T @ dz, self.dtype) if self.needs_input_grad[1] else None
        return dx, dw, None, None, None, None


class ScatterRows(Function):
    """y (N, C) = zeros, y[idx[m]] += src[m]: each assignment's output back at its token.
    Backward: g[idx]."""

    def forward(self, src, idx, n):
        self.idx = idx
        out = np.zeros((n, src.shape[1]), dtype=compute(src).dtype)
        np.add.at(out, idx, compute(src))
        return store(out, src.dtype)

    def backward(self, g):
        return g[self.idx], None, None


def assignments(decisions: Decisions, experts: int):
    """The kept (token, choice) assignments ordered by expert (then choice, then token):
    (tokens (M,), slots (M,) = token * K + choice, rows per expert (E,))."""
    choice, kept = decisions.choice, decisions.kept
    K = choice.shape[1]
    tokens, ks = np.nonzero(kept.T)[::-1]                        # choice-major, token order
    experts_of = choice[tokens, ks]
    order = np.argsort(experts_of, kind="stable")
    tokens, ks = tokens[order], ks[order]
    return tokens, tokens * K + ks, np.bincount(experts_of, minlength=experts)


def combine(out: Tensor, tokens, slots, weights: Tensor, n: int) -> Tensor:
    """The experts' outputs back at their tokens, weighted: y (n, C) = zeros, then for each
    kept assignment m, y[tokens[m]] += weights.flat[slots[m]] out[m] (out (M, C) in the order
    of tokens; weights (n, K); a dropped assignment has no row and adds nothing)."""
    K = weights.shape[1]
    gates = ops.embedding(slots, ops.reshape(weights, (n * K, 1)))              # (M, 1)
    return ScatterRows.apply(ops.mul(out, gates), tokens, n)


def moe_mlp(P: dict, i: int, x: Tensor, s: MoESettings, family) -> Tensor:
    """Block i's MoE layer on x (B, t, C) (docs/moe.md): the routed experts (on this process, or
    with --ep on the ranks that hold them) and the shared ones; `family` names the parameters and
    computes an expert's MLP (model/family.py)."""
    B, t, C = x.shape
    x2 = ops.reshape(x, (B * t, C))
    decisions = Decisions()
    # the routing groups; a forward of rows that do not divide into them (sampling) is one
    G = s.group_rows * t if s.group_rows and B % s.group_rows == 0 else B * t
    weights = Router.apply(x2, P[family.router_name(i)], s, decisions, G, i)     # (N, K)
    if s.stats is not None and is_grad_enabled():        # training: once even with full recompute
        s.stats.append((i, decisions))
    tokens, slots, rows = assignments(decisions, s.experts)
    if s.placement is not None:                      # --ep: the experts on the ranks that hold them
        cap = capacity(G, s.top_k, s.experts, s.capacity_factor)    # slots per expert, all groups
        out = s.placement.run(P, i, x2, tokens, rows, None if cap is None else cap * (B * t // G), family)
    else:
        xs = ops.embedding(tokens, x2)                               # (M, C), expert-major
        parts = ops.split(xs, list(np.cumsum(rows)[:-1]), axis=0) if s.experts > 1 else [xs]
        out = ops.concat([family.expert_mlp(P, family.expert_prefix(i, e), part) for e, part in enumerate(parts)],
                         axis=0)
    y = combine(out, tokens, slots, weights, B * t)
    for k in range(s.shared):                        # DeepSeekMoE: every token through each shared expert
        y = y + family.expert_mlp(P, family.shared_prefix(i, k), x2)
    return ops.reshape(y, (B, t, C))


def step_stats(stats: list, s: MoESettings) -> dict:
    """One step's routing on this rank, per MoE block: {"h.i": {"load": assignments per expert
    before dropping, "dropped", "assignments", "aux": the mean of the block's aux_g, "zloss",
    "balanced": what aux is when the load is balanced (Switch 1; Mixtral's share of a block, K)}}."""
    out = {}
    for i, d in stats:
        r = out.setdefault(f"{s.block_word}.{i}", {"load": 0, "dropped": 0, "aux": [], "zloss": []})
        r["load"] = r["load"] + np.sum(d.load, axis=0)
        r["dropped"] += sum(d.dropped)
        r["aux"] += d.aux
        r["zloss"] += d.zloss
    balanced = s.top_k if s.router == "mixtral" else 1
    return {k: {"load": [int(n) for n in r["load"]], "dropped": r["dropped"],
                "assignments": int(np.sum(r["load"])), "aux": float(np.mean(r["aux"])),
                "zloss": float(np.mean(r["zloss"])), "balanced": balanced} for k, r in out.items()}


def summary_lines(rows: list) -> tuple[dict, list[str]]:
    """The summary's MoE figures from the step rows' "moe" (this rank's tokens): per block the
    load per expert over the run, the dropped fraction and the mean aux loss."""
    blocks = {}
    for row in rows:
        for k, r in row.get("moe", {}).items():
            b = blocks.setdefault(k, {"load": np.zeros(len(r["load"]), dtype=np.int64), "dropped": 0,
                                      "assignments": 0, "aux": [], "balanced": r.get("balanced", 1)})
            b["load"] += r["load"]
            b["dropped"] += r["dropped"]
            b["assignments"] += r["assignments"]
            b["aux"].append(r["aux"])
    out, lines = {}, []
    for k, b in blocks.items():
        share = b["load"] / max(1, b["assignments"])
        out[k] = {"load": b["load"].tolist(), "dropped_fraction": b["dropped"] / max(1, b["assignments"]),
                  "aux": float(np.mean(b["aux"]))}
        lines.append(f"  moe {k}: load per expert {'/'.join(f'{x:.2f}' for x in share)} of "
                     f"{b['assignments']:,} assignments (balanced: {1 / len(share):.2f} each); dropped "
                     f"{out[k]['dropped_fraction']:.1%}; aux loss {out[k]['aux']:.4f} ({b['balanced']} when balanced)")
    return out, lines


class collecting:
    """with moe.collecting(model.moe, S) as routing: one training step's routing statistics,
    scoped to the block: on entry the settings take the step's loss scale S (the injected
    gradients carry it) and start collecting (block, Decisions) of every training forward
    (and, with --ep, what the all-to-alls should send, from 0); on exit they stop.
    routing.row() -> the row's "moe" (step_stats) and, with --ep, "ep_theory_bytes"; {} for
    a dense model (settings None)."""

    def __init__(self, settings: MoESettings | None, loss_scale: float):
        self.settings, self.loss_scale = settings, loss_scale
        self.stats, self.theory_bytes = None, None

    def __enter__(self):
        s = self.settings
        if s is not None:
            s.loss_scale, s.stats = self.loss_scale, []
            if s.placement is not None:
                s.placement.theory_bytes = 0
        return self

    def __exit__(self, *exc):
        s = self.settings
        if s is not None:
            self.stats, s.stats = s.stats, None
            if s.placement is not None:
                self.theory_bytes = s.placement.theory_bytes

    def row(self) -> dict:
        if self.settings is None:
            return {}
        row = {"moe": step_stats(self.stats, self.settings)}
        if self.theory_bytes is not None:               # --ep: what the all-to-alls should have sent
            row["ep_theory_bytes"] = self.theory_bytes
        return row
