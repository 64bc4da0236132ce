"""Activation memory: the bytes minipar's ops save for backward, by formula, beside
Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
arXiv:2205.05198, Table 2). The planner prints both; tests hold the formula to
Tensor.saved_bytes and the trainer's measured peak (docs/sequence-parallel.md), which
peak_in_flight_bytes finds by walking a pipeline stage's schedule.

Letters as in the paper: s sequence length (minipar's T), b micro-batch rows, h hidden size
(C), a heads (H), t tensor-parallel ranks, d bytes per element. What one transformer layer
of minipar keeps (ops.py, tensor_parallel.py, sequence_parallel.py; no dropout):

    kept by                       elements                 split by t under
    ln_1, ln_2  xhat, 1/std       2 (sbh + sb)             sp
    c_attn, c_fc  their input     2 sbh                    sp (the shard; gathered again in backward)
    attention   q, k, v           3 sbh                    tp
                softmax P         a s^2 b                  tp            (selective: not kept)
    c_proj      its input         sbh                      tp
    GELU        x, sigmoid        8 sbh                    tp
    mlp c_proj  its input         4 sbh                    tp
    sum                           sbh (20 + 2/h + as/h)

so, per layer (d = 4 in float32; the paper has 2-byte values and 1-byte dropout masks):

    setting            minipar                          Korthikanti Table 2
    none               d sbh (20 + 2/h + as/h)          sbh (34 + 5as/h)
    tp                 d sbh (4 + 2/h + 16/t + as/ht)   sbh (10 + 24/t + 5as/ht)
    tp + sp            d sbh/t (20 + 2/h + as/h)        sbh/t (34 + 5as/h)
    tp + selective     d sbh (4 + 2/h + 16/t)           sbh (10 + 24/t)
    tp + sp + selective  d sbh/t (20 + 2/h)             34 sbh/t
    full               d sbh (block input; /t with sp)  2 sbh

The paper's "10" (LayerNorm inputs, the two linear inputs, two dropout masks) is minipar's
"4 + 2/h" (no masks; LayerNorm keeps its normalised input and 1/std instead of its input),
its "24/t" (12 two-byte values: q, k, v, c_proj's input, GELU's input and output) minipar's
"16/t" (16 values: the same, but GELU keeps its input and its sigmoid, and mlp c_proj its
input, 4 + 4 + 4), its 5as/h minipar's as/h (the softmax alone: no dropout mask, no
dropped copy). Sequence parallelism divides
the first by t, selective recomputation removes the last, full keeps the block's input.
With fp16/bf16 (storage 2 bytes, compute 4) the ops keep some arrays in each width:
layer_bytes says which.

Context parallelism (--cp c: parallel/context/) gives each rank s/c tokens of every sequence;
every per-token term above is divided by c. Attention never keeps the s x s softmax, whatever
--recompute says (full: the block input alone, as always); what it keeps depends on how the cp
group attends (--cp-impl; cp_attention_bytes). Per layer, tp ranks t, no sp:

    kept by                       elements                 with cp c
    ln_1, ln_2  xhat, 1/std       2 (sbh + sb)             / c
    c_attn, c_fc  their input     2 sbh                    / c
    attention   q                 sbh/t                    / c
                k, v   ring       2 sbh/t                  / c   (its own tokens')
                       allgather  2 sbh/t                        (gathered: all s tokens)
                       ulysses    2 sbh/t                  / c   (h/c of the heads, all s tokens)
                       hybrid     2 sbh/t                  / c   (h/u heads, the u s/c tokens of its group)
                o      not ulysses  sbh/t                  / c   (not the softmax)
                lse    not ulysses  a s b/t                / c
    c_proj, GELU, mlp c_proj      (1 + 8 + 4) sbh/t        / c
    sum    ring, hybrid           d sbh/c (4 + 2/h + 17/t + a/ht)
           allgather              d sbh/c (4 + 2/h + (15 + 2c)/t + a/ht)
           ulysses                d sbh/c (4 + 2/h + 16/t)

against d sbh (4 + 2/h + 16/t + as/ht) without cp: the per-token part falls by c, and the
softmax's as/ht, quadratic in s, becomes a/ht, linear (o adds 1/t), or nothing for Ulysses,
which keeps q, k, v of its heads over the whole sequence and makes the softmax again in
backward. The all-gather's K and V do not fall with c: 2c/t where the ring has 2/t. Stage 0
keeps its s/c positions (int64) instead of s. (One trap: with a/t = 1 head, or s/c = 1, and
no fp16/bf16, c_proj's input is a reshaped view of the ring's or the all-gather's o, not a
copy, and is counted once with it.) tests/mpi/test_cp_activations.py holds every
implementation to Tensor.saved_bytes, with tp and without.

A Llama block (--arch llama, model/llama.py) has k key/value heads (n_kv_head) and an MLP f
wide (cfg.hidden), no biases, no positions to keep (RoPE's cos and sin are a cache, not saved):

    kept by                          elements             split by t under
    2 RMSNorms  xhat, 1/rms          2 (sbh + sb)         sp
    [q|k|v], [gate|up]  their input  2 sbh                sp (the shard)
    attention   q                    sbh                  tp
                k, v                 2 sbhk/a             tp (k/t heads; one when t > k)
                softmax P            a s^2 b              tp   (selective: not kept)
    o_proj      its input            sbh                  tp
    SwiGLU      silu, up silu'       2 sbf                tp
    down_proj   its input            sbf                  tp

The fused [q|k|v] and [gate|up] weights cost nothing here: ops.linear takes the rank's shards as
column pieces, joins them for the GEMM and again in backward, and keeps only the pieces, which
are the parameters. Per layer:

    setting            minipar (llama_layer_bytes)
    none               d sbh (6 + 2/h + 2k/a + 3f/h + as/h)
    tp                 d sbh (4 + 2/h + (2 + 2k/a + 3f/h)/t + as/ht)
    tp + sp            d sbh/t (6 + 2/h + 2k/a + 3f/h + as/h)
    tp + selective     d sbh (4 + 2/h + (2 + 2k/a + 3f/h)/t)
    tp + sp + selective  d sbh/t (6 + 2/h + 2k/a + 3f/h)
    full               d sbh (the block input; /t with sp)
    cp c ring          d sbh/c (4 + 2/h + (3 + 2k/a + 3f/h)/t + a/ht)
         allgather     d sbh/c (4 + 2/h + (3 + 2ck/a + 3f/h)/t + a/ht)
         ulysses       d sbh/c (4 + 2/h + (2 + 2max(ct,k)/a + 3f/h)/t)
         hybrid u      d sbh/c (4 + 2/h + (3 + 2max(ut,k)/a + 3f/h)/t + a/ht)

With t > k each rank computes one shared key/value head: read k/t as 1 there (in the k, v
row). The cp rows are GPT-2's with only the rank's k/t key/value heads in k and v; Ulysses
over u ranks (c for ulysses) gives each max(1, k/(tu)) of them, so u max(1, k/(tu)) =
max(u, k/t): a KV head copied to several ranks is kept on each. fp16/bf16: as for GPT-2, the ops keep
their fp32 arrays (the norms' xhat, 1/rms and weight, attention's) in 4 bytes; SwiGLU keeps
its gradient's two factors, silu(gate) and up silu'(gate), in the storage dtype.

A mixture-of-experts layer (--moe-experts E --moe-top-k K, moe.py; not with sp or cp) keeps,
in place of the MLP's last three rows (c_fc's input, GELU, mlp c_proj's input), what its
router, its dispatch, its experts and its combine save. For the N = sb tokens of one
micro-batch on one rank, M the assignments it keeps (K per token, less those dropped at a
capacity) and R the rows its experts run on; d the bytes of a stored element, d' of a
computed one the ops keep (4 with fp16/bf16, else d):

    kept by                       bytes
    router      x (N, h)          N h d'         (fp16/bf16: its fp32 copy; else ln_2's output)
                p (N, E)          N E d'
                lse, the sum      2 N d'
                weights (N, K)    N K d'
                choices (N, K)    8 N E          (int64: a view of the whole (N, E) argsort)
                w_r in fp32       h E d'         (fp16/bf16 only)
    experts     c_fc's input      R h d          (the gathered rows, one array for all experts)
                GELU x, sigmoid   8 R h d'
                c_proj's input    4 R h d
    combine     the outputs       M h d          (weighted by their gates)
                the gates (M, 1)  M d
    row indices (int64)           8 (2M)         one process: the tokens' and the slots' ids
                                  8 (2M + 2R)    --ep: + the order of the rows received, + its inverse
                                  8 (2M + 3R)    --ep with a capacity: + the padded slots' index

M and R depend on the routing. The formula takes them as given (the counts a run made) or
assumes balanced routing, every expert chosen N K / E times: M = N K (min(N K, E cap) with a
capacity of cap slots per expert), R = M, except with --ep and a capacity, where each rank's
experts run on their capacity whatever the routing, R = E cap (E/ep experts x ep sources x
cap rows, padding included). Without a capacity M = N K exactly (nothing is dropped), and on
one process R = M: only --ep without a capacity (R) and a capacity that drops (M) depend on
the data. With balanced routing and no capacity the experts keep K times the dense MLP's
13 N h d, plus the router. Not counted, as Tensor.saved_bytes does not see them: what the
router keeps outside save() (f (N, E), each token's group's load) and the drop decisions.
tp ranks each run the whole MoE layer (the experts are replicated over tp): the same bytes.

A Llama MoE block (--arch llama --moe-experts, model/llama.py's expert_mlp; MoELayer.swiglu)
keeps the same router, dispatch, combine and row indices, and in place of the GELU experts
(and of the dense block's [gate|up] input and SwiGLU rows) SwiGLU experts
F_e wide (moe_ffn_hidden, default the MLP's F), E_r = E/ep of them on the rank, S shared ones
(moe_shared_experts) run on all N tokens (SwiGLU keeps its two factors as stored, d):

    kept by                           bytes
    experts  their rows (R, h)        R h d           (the gathered rows, one array)
             SwiGLU's two factors     2 R F_e d
             w2's input               R F_e d
    shared   SwiGLU, w2's input       S N 3 F_e d
             the input x (N, h)       N h d           fp16/bf16 only (else the router's x)

With balanced routing and no capacity (R = N K) the routed experts keep 3 N K F_e d, against
the dense block's 3 N F d and N h d of its input.
"""
from __future__ import annotations

from dataclasses import dataclass

from minipar.model import moe
from minipar.model.gpt import GPTConfig
from minipar.parallel.context import context_parallel
from minipar.parallel.context.ulysses import head_split
from minipar.parallel.pipeline import schedules

INT64 = 8
SETTINGS = ("none", "tp", "tp+sp", "tp+selective", "tp+sp+selective", "full")


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer's routing on one rank, as its saved bytes see it (the module's third
    table): E experts, top-K, ep ranks, cap slots per expert (None: no capacity); kept (M) and
    received (R) rows if known (a run's counts), else balanced routing's."""
    experts: int
    top_k: int
    ep: int = 1
    cap: int | None = None
    kept: int | None = None
    received: int | None = None
    swiglu: int = 0                  # Llama's experts: SwiGLU F_e wide (the fifth table); 0: GPT-2's 4C GELU
    shared: int = 0                  # Llama's shared experts, on all N tokens

    def rows(self, N: int) -> tuple[int, int]:
        """(M, R) for N tokens: the given counts, or every expert chosen N K / E times:
        M = N K, or min(N K, E cap) with a capacity; R = M, or E cap with --ep and a capacity."""
        E, K, cap = self.experts, self.top_k, self.cap
        M = N * K if cap is None else min(N * K, E * cap)
        R = E * cap if self.ep > 1 and cap is not None else M
        return (M if self.kept is None else self.kept), (R if self.received is None else self.received)


def mlp_bytes(N: int, Ns: int, C: int, tp: int, store: int, comp: int) -> int:
    """The dense MLP's part of layer_bytes: c_fc's input (Ns, C) (or its shard), GELU's x and
    sigmoid (N, 4C/t), mlp c_proj's input (N, 4C/t)."""
    Ct = C // tp
    return Ns * C * store + 2 * N * 4 * Ct * comp + N * 4 * Ct * store


def moe_mlp_bytes(N: int, C: int, m: MoELayer, store: int, comp: int) -> int:
    """A MoE layer's part, in place of mlp_bytes (the module's third table; with m.swiglu a
    Llama block's, the fifth, in place of its SwiGLU MLP and the MLP's input), on N tokens."""
    E, K = m.experts, m.top_k
    M, R = m.rows(N)
    router = N * C * comp + N * E * comp + 2 * N * comp + N * K * comp + INT64 * N * E
    router += C * E * comp if comp != store else 0             # fp16/bf16: w_r computed on in fp32
    if m.swiglu:                                               # Llama's experts (the fifth table)
        F = m.swiglu
        swiglu = 3 * F * store                                 # per row: SwiGLU's two factors; w2's input
        experts = R * C * store + R * swiglu
        experts += m.shared * N * swiglu + (N * C * store if m.shared and comp != store else 0)
    else:
        experts = R * C * store + 2 * R * 4 * C * comp + R * 4 * C * store
    combine = M * C * store + M * store
    ids = 2 * M + (0 if m.ep == 1 else 2 * R + (R if m.cap is not None else 0))
    return router + experts + combine + INT64 * ids


def layer_bytes(rows: int, T: int, C: int, H: int, tp: int = 1, store: int = 4, comp: int | None = None,
                sp: bool = False, recompute: str = "none", cp: int = 1, moe_layer: MoELayer | None = None,
                cp_impl: str = "ring", cp_ulysses: int | None = None) -> int:
    """Bytes one transformer layer keeps for backward, one micro-batch of `rows` sequences
    of T tokens, exactly as Tensor.saved_bytes counts them. store: bytes per stored element
    (activations between ops), comp: of the computed ones the ops keep (4 for fp16/bf16,
    else store). cp: context-parallel ranks, each with Tc = T/cp tokens of every sequence,
    attending by cp_impl (cp_ulysses: hybrid's U; the module's second table and
    cp_attention_bytes). moe_layer: a MoE block's routing (the
    third table), its MLP replaced by the router and experts."""
    comp = store if comp is None else comp
    Tc = T // cp                                              # this rank's tokens of a sequence
    N = rows * Tc
    Ns = N // tp if sp else N                                 # tokens in the LayerNorm regions
    Ct, Ht = C // tp, H // tp
    if recompute == "full":
        return Ns * C * store                                 # the block's input alone
    low = 4 * C if comp != store else 0                       # fp16/bf16: LayerNorm keeps w in fp32
    ln = Ns * C * comp + Ns * comp + low                      # xhat (Ns, C), 1/std (Ns, 1)
    proj_in = N * Ct * store                                  # attention c_proj's input (N, C/t)
    if cp > 1:                                                # q, k, v of cp_impl's heads and tokens, ...
        attention, view = cp_attention_bytes(cp_impl, rows, Tc, cp, Ht, Ct, Ct, C // H, comp, cp_ulysses)
        if view and comp == store and (Ht == 1 or Tc == 1):   # c_proj's input is a view of o
            proj_in = 0
    else:                                                     # q, k, v; the softmax P (b, H/t, T, T)
        attention = 3 * N * Ct * comp + (0 if recompute == "selective" else rows * Ht * T * T * comp)
    mlp = mlp_bytes(N, Ns, C, tp, store, comp) if moe_layer is None else moe_mlp_bytes(N, C, moe_layer, store, comp)
    return (2 * ln
            + Ns * C * store                                  # c_attn's input (or shard)
            + attention
            + proj_in
            + mlp)                                            # c_fc's input, GELU, mlp c_proj's input


def llama_layer_bytes(cfg: GPTConfig, rows: int, tp: int = 1, store: int = 4, comp: int | None = None,
                      sp: bool = False, recompute: str = "none", cp: int = 1,
                      moe_layer: MoELayer | None = None, cp_impl: str = "ring", cp_ulysses: int | None = None) -> int:
    """Bytes one Llama block of cfg keeps for backward (the module's fourth table), exactly as
    Tensor.saved_bytes counts them; the arguments are layer_bytes's. A tp rank computes H/t
    query heads and kv_width's key/value channels (Hkv/t heads, one shared when t > Hkv).
    moe_layer: a MoE block's routing (the fifth table), its MLP replaced by the router and
    the experts (whole on every tp rank)."""
    comp = store if comp is None else comp
    T, C, H = cfg.block_size, cfg.n_embd, cfg.n_head
    Tc = T // cp
    N = rows * Tc
    Ns = N // tp if sp else N                                 # tokens in the norms' regions
    Ht, Ft = H // tp, cfg.hidden // tp
    q, kv = Ht * cfg.head_size, context_parallel.kv_width(cfg, tp)    # this rank's q and k (v) channels
    if recompute == "full":
        return Ns * C * store                                 # the block's input alone
    low = 4 * C if comp != store else 0                       # fp16/bf16: RMSNorm keeps w in fp32
    norm = Ns * C * comp + Ns * comp + low                    # xhat (Ns, C), 1/rms (Ns, 1)
    proj_in = N * q * store                                   # o_proj's input (N, H/t hs)
    if cp > 1:                                                # q, k, v of cp_impl's heads and tokens, ...
        attention, view = cp_attention_bytes(cp_impl, rows, Tc, cp, Ht, q, kv, cfg.head_size, comp, cp_ulysses)
        if view and comp == store and (Ht == 1 or Tc == 1):   # o_proj's input is a view of o
            proj_in = 0
    else:                                                     # q; k, v; the softmax P (b, H/t, T, T)
        attention = N * q * comp + 2 * N * kv * comp + (0 if recompute == "selective" else rows * Ht * T * T * comp)
    mlp = 3 * N * Ft * store                                  # SwiGLU's two factors; down's input
    mlp += Ns * C * store                                     # [gate|up]'s input
    if moe_layer is not None:                                 # the router and the experts instead
        mlp = moe_mlp_bytes(N, C, moe_layer, store, comp)
    return 2 * norm + Ns * C * store + attention + proj_in + mlp


def block_bytes(cfg: GPTConfig, rows: int, tp: int = 1, store: int = 4, comp: int | None = None, sp: bool = False,
                recompute: str = "none", cp: int = 1, moe_layer: MoELayer | None = None, cp_impl: str = "ring",
                cp_ulysses: int | None = None) -> int:
    """Bytes one block of cfg's family keeps: layer_bytes (GPT-2) or llama_layer_bytes."""
    if cfg.arch == "llama":
        return llama_layer_bytes(cfg, rows, tp, store, comp, sp, recompute, cp, moe_layer, cp_impl, cp_ulysses)
    return layer_bytes(rows, cfg.block_size, cfg.n_embd, cfg.n_head, tp, store, comp, sp, recompute, cp, moe_layer,
                       cp_impl, cp_ulysses)


def largest_ulysses(H: int, Hkv: int, cp: int) -> int:
    """The largest U dividing cp that Ulysses can run with H query and Hkv KV heads
    (ulysses.head_split): hybrid's U where the most is kept (k, v grow with U)."""
    return max(U for U in range(1, cp + 1) if cp % U == 0 and H % U == 0 and (Hkv % U == 0 or U % Hkv == 0))


def cp_attention_bytes(impl: str, rows: int, Tc: int, cp: int, Ht: int, q: int, kv: int, hs: int, comp: int,
                       ulysses: int | None = None) -> tuple[int, bool]:
    """(bytes, o kept) context-parallel attention keeps on a rank with Tc tokens of each of `rows`
    sequences, Ht query heads (q = Ht hs channels) and kv key/value channels after tp (the
    module's second table); o kept: its output is kept, and the projection's input may be a
    view of it. U the ranks one Ulysses all-to-all spans, its heads ulysses.head_split's:
        ring       q, o (N q), k, v (N kv), lse (rows Ht Tc)
        allgather  q, o, lse, and the GATHERED K, V: 2 rows T kv, T = cp Tc
        ulysses    q (N q: H/U heads over all T tokens), k, v of its KV heads over T (copied
                   ones counted on every rank that holds them); no o, no lse (the softmax made
                   again in backward from q and k)
        hybrid     the ring's on the U Tc tokens of its Ulysses group, its heads (U None: the
                   hosts not yet known, largest_ulysses, the most it can keep)"""
    N = rows * Tc
    if impl in ("ring", "allgather"):
        keys = N if impl == "ring" else rows * cp * Tc
        return (2 * N * q + 2 * keys * kv + rows * Ht * Tc) * comp, True
    U = cp if impl == "ulysses" else ulysses if ulysses is not None else largest_ulysses(Ht, kv // hs, cp)
    kv_heads = head_split(Ht, kv // hs, U)[1]
    keys = 2 * rows * U * Tc * kv_heads * hs                  # k and v of its heads, over U Tc tokens
    if impl == "ulysses":
        return (N * q + keys) * comp, False
    return (2 * N * q + keys + rows * Ht * Tc) * comp, False


def moe_layers(cfg: GPTConfig, N: int, ep: int = 1, routed: dict | None = None) -> dict:
    """{block i: MoELayer} for the MoE blocks of cfg, N tokens a micro-batch on one rank (one
    routing group: moe.capacity's slots per expert); routed {i: (kept, received)}: a run's counts."""
    E, K = cfg.moe_experts, cfg.moe_top_k
    cap = moe.capacity(N, K, E, cfg.moe_capacity_factor) if E else None
    routed = routed or {}
    F, S = (cfg.expert_hidden, cfg.moe_shared_experts) if cfg.arch == "llama" else (0, 0)
    return {i: MoELayer(E, K, ep, cap, *routed.get(i, (None, None)), swiglu=F, shared=S)
            for i in range(cfg.n_layer) if cfg.is_moe(i)}


def stage_bytes(cfg: GPTConfig, stage: int, pp: int, tp: int, rows: int, itemsize: int,
                compute_itemsize: int, sp: bool = False, recompute: str = "none", owned=None,
                cp: int = 1, ep: int = 1, routed: dict | None = None, cp_impl: str = "ring",
                cp_ulysses: int | None = None) -> int:
    """Bytes one micro-batch of `rows` sequences leaves saved for backward on a device of
    `stage` (Tensor.saved_bytes: parameters and the stage's received input excluded, views
    once): its layers (block_bytes: GPT-2's or Llama's) and its ends. A virtual stage v of p*V (interleaved.py)
    is a stage here: stage_bytes(cfg, v, p*V, ...) is one chunk's. itemsize: storage bytes per element,
    compute_itemsize the compute's (4 for fp16/bf16, else itemsize).

    Exact for tp = 1. With tp > 1 the vocabulary-parallel embedding and cross-entropy keep
    the ids of the tokens (and targets) this rank's vocabulary slice owns, which depends on
    the data: owned = (ids, targets) this rank owns, default ceil(N/tp) each; the formula
    is off by 8 bytes per id from that assumption.
    With full recomputation a stage after the first keeps no copy of its first block's
    input: it is the activation the pipeline received, held whether or not anything is
    saved (a leaf of the graph, like a parameter).
    cp: each rank keeps Tc = T/cp tokens of every sequence (N = rows*Tc) and, on stage 0,
    their Tc positions; its attention is cp_impl's (cp_ulysses: hybrid's U).
    MoE blocks (cfg.moe_experts): moe_layers' routing, ep expert-parallel ranks; routed
    {block i: (kept, received)} gives a run's counts, else balanced routing is assumed."""
    T, C, V = cfg.block_size, cfg.n_embd, cfg.vocab_size
    sp = sp and tp > 1
    Tc = T // cp
    N = rows * Tc
    Ns = N // tp if sp else N
    store, comp = itemsize, compute_itemsize
    layers = list(schedules.partition(cfg.n_layer, pp)[stage])
    if recompute == "full" and stage > 0:
        layers = layers[1:]
    routing = moe_layers(cfg, N, ep, routed)
    total = sum(block_bytes(cfg, rows, tp, store, comp, sp, recompute, cp, routing.get(i), cp_impl, cp_ulysses)
                for i in layers)
    ids, targets = (-(-N // tp),) * 2 if owned is None else owned
    if stage == 0:                                            # token ids (N,), positions (Tc,)
        total += N * INT64 if tp == 1 else ids * INT64 + N    # the masked lookup: owned ids, the mask
        if cfg.family.positions and not sp:                   # sp: each rank slices wpe, keeps nothing
            total += Tc * INT64                               # (rotary positions: nothing kept)
    if stage == pp - 1:                                       # the final norm, the head's input, the loss
        low = 4 * C if comp != store else 0
        Vl = V if tp == 1 else -(-V // tp)
        total += (Ns * C * comp + Ns * comp + low) + Ns * C * store + N * Vl * comp
        total += N * INT64 if tp == 1 else 2 * targets * INT64
    return total


def peak_in_flight_bytes(cfg: GPTConfig, schedule: str, stage: int, pp: int, virtual: int, micro_batches: int,
                         tp: int, rows: int, itemsize: int, compute_itemsize: int, sp: bool = False,
                         recompute: str = "none", owned=None, cp: int = 1, ep: int = 1,
                         routed: dict | None = None, cp_impl: str = "ring",
                         cp_ulysses: int | None = None) -> tuple[int, int]:
    """(bytes, graphs): the saved activations a device of pipeline `stage` holds at its peak,
    and the most (chunk, micro-batch) graphs it holds at once, from its own instruction list
    (schedules.schedule(schedule, stage, p, m, V)): the order on a stage is fixed by its list.
    Walking it, each Forward of chunk c adds stage_bytes of virtual stage v = c*p + stage of
    p*V (its layers, the embedding on v = 0, the head on v = pV-1), its Backward frees them,
    or its WeightGrad when the list has any (W still needs the layers' inputs), as
    pipeline.StepObserver counts the trainer's; the peak is the largest sum on the way. The
    graphs are whole micro-batches for V = 1 (1 naive, m GPipe, min(m, p - stage) 1F1B) and
    chunk-micro-batches for V > 1, schedule_check's peak_in_flight either way. Without a
    pipeline (pp = 1) one micro-batch at a time. owned, cp, ep, routed, cp_impl, cp_ulysses: as
    stage_bytes."""
    def size(v, n):
        return stage_bytes(cfg, v, n, tp, rows, itemsize, compute_itemsize, sp, recompute, owned, cp, ep, routed,
                           cp_impl, cp_ulysses)
    if pp == 1:
        return size(0, 1), 1
    instructions = schedules.schedule(schedule, stage, pp, micro_batches, virtual)
    frees = schedules.WeightGrad if any(isinstance(i, schedules.WeightGrad) for i in instructions) \
        else schedules.Backward
    chunk_bytes = [size(c * pp + stage, pp * virtual) for c in range(virtual)]
    held = graphs = peak = peak_graphs = 0
    for ins in instructions:
        step = +1 if isinstance(ins, schedules.Forward) else -1 if isinstance(ins, frees) else 0
        held += step * chunk_bytes[ins.chunk]
        graphs += step
        peak, peak_graphs = max(peak, held), max(peak_graphs, graphs)
    return peak, peak_graphs


def setting_args(setting: str, tp: int) -> dict:
    """One of SETTINGS as layer_bytes' (tp, sp, recompute); "none" and "full" at tp = 1."""
    return {"none": dict(tp=1), "tp": dict(tp=tp), "tp+sp": dict(tp=tp, sp=True),
            "tp+selective": dict(tp=tp, recompute="selective"),
            "tp+sp+selective": dict(tp=tp, sp=True, recompute="selective"),
            "full": dict(tp=1, recompute="full")}[setting]


def korthikanti(setting: str, s: int, b: int, h: int, a: int, t: int) -> float:
    """Korthikanti et al. 2022, Table 2: activation bytes per layer (2-byte values, 1-byte
    dropout masks)."""
    sbh = s * b * h
    return {"none": sbh * (34 + 5 * a * s / h),
            "tp": sbh * (10 + 24 / t + 5 * a * s / (h * t)),
            "tp+sp": sbh / t * (34 + 5 * a * s / h),
            "tp+selective": sbh * (10 + 24 / t),
            "tp+sp+selective": 34 * sbh / t,
            "full": 2 * sbh}[setting]


FORMULAS = {   # setting: (minipar's, the paper's), as the docstring writes them
    "none": ("d sbh (20 + 2/h + as/h)", "sbh (34 + 5as/h)"),
    "tp": ("d sbh (4 + 2/h + 16/t + as/ht)", "sbh (10 + 24/t + 5as/ht)"),
    "tp+sp": ("d sbh/t (20 + 2/h + as/h)", "sbh/t (34 + 5as/h)"),
    "tp+selective": ("d sbh (4 + 2/h + 16/t)", "sbh (10 + 24/t)"),
    "tp+sp+selective": ("d sbh/t (20 + 2/h)", "34 sbh/t"),
    "full": ("d sbh", "2 sbh"),
}


LLAMA_FORMULAS = {   # setting: llama_layer_bytes', as the docstring's fourth table writes it
    "none": "d sbh (6 + 2/h + 2k/a + 3f/h + as/h)",
    "tp": "d sbh (4 + 2/h + (2 + 2k/a + 3f/h)/t + as/ht)",
    "tp+sp": "d sbh/t (6 + 2/h + 2k/a + 3f/h + as/h)",
    "tp+selective": "d sbh (4 + 2/h + (2 + 2k/a + 3f/h)/t)",
    "tp+sp+selective": "d sbh/t (6 + 2/h + 2k/a + 3f/h)",
    "full": "d sbh",
}


CP_FORMULAS = {   # --cp-impl: (GPT-2's, Llama's) per-layer formula, as the docstring's second table writes it
    "ring": ("d sbh/c (4 + 2/h + 17/t + a/ht)", "d sbh/c (4 + 2/h + (3 + 2k/a + 3f/h)/t + a/ht)"),
    "allgather": ("d sbh/c (4 + 2/h + (15 + 2c)/t + a/ht)", "d sbh/c (4 + 2/h + (3 + 2ck/a + 3f/h)/t + a/ht)"),
    "ulysses": ("d sbh/c (4 + 2/h + 16/t)", "d sbh/c (4 + 2/h + (2 + 2max(ct,k)/a + 3f/h)/t)"),
    "hybrid": ("d sbh/c (4 + 2/h + 17/t + a/ht)", "d sbh/c (4 + 2/h + (3 + 2max(ut,k)/a + 3f/h)/t + a/ht)"),
}


def cp_formula(recompute: str, arch: str = "gpt2", impl: str = "ring") -> str:
    """The per-layer formula with --cp c (tp t, no sp) and --cp-impl impl, as the docstring
    derives it."""
    if recompute == "full":
        return "d sbh/c"
    return CP_FORMULAS[impl][arch == "llama"]


def setting_of(tp: int, sp: bool, recompute: str) -> str | None:
    """Which of SETTINGS a run's flags are (None: one the paper's table has no row for).
    At tp = 1 --sp splits nothing, and selective is the tp+selective row with t = 1."""
    sp = sp and tp > 1
    if recompute == "full":
        return "full" if tp == 1 or not sp else None
    key = "none" if tp == 1 and recompute == "none" else "tp" + ("+sp" if sp else "") \
        + ("+selective" if recompute == "selective" else "")
    return key if key in SETTINGS else None


def family_table(cfg: GPTConfig, b: int, t: int, d: int, comp: int | None = None) -> list[dict]:
    """The six settings for one block of cfg's family: table() for GPT-2; for Llama its own
    bytes and formulas, and no paper's column (Table 2 is a GPT layer's: 4h MLP, multi-head)."""
    if cfg.arch != "llama":
        return table(cfg.block_size, b, cfg.n_embd, cfg.n_head, t, d, comp)
    return [{"setting": k, "minipar": llama_layer_bytes(cfg, b, store=d, comp=comp, **setting_args(k, t)),
             "korthikanti": None, "minipar_formula": LLAMA_FORMULAS[k], "korthikanti_formula": None}
            for k in SETTINGS]


def table(s: int, b: int, h: int, a: int, t: int, d: int, comp: int | None = None) -> list[dict]:
    """The six settings for one layer: minipar's bytes (layer_bytes with d-byte stored
    values, comp-byte computed ones) and Korthikanti's, with their formulas."""
    return [{"setting": k, "minipar": layer_bytes(b, s, h, a, store=d, comp=comp, **setting_args(k, t)),
             "korthikanti": korthikanti(k, s, b, h, a, t),
             "minipar_formula": FORMULAS[k][0], "korthikanti_formula": FORMULAS[k][1]} for k in SETTINGS]
