"""The planner for the Llama family (--arch llama, --model llama*), on one process: its
formulas against minipar's own code, as tests/test_plan.py holds GPT-2's.

- presets: the published parameter counts of Llama 2 7B, Llama 3 8B, 70B and 405B (Llama
  3.1's), each MLP width from Llama's rule, every family field in the JSON's "model";
- activations: Tensor.saved_bytes of real forward passes equals activations.stage_bytes to
  the byte, on one process (float64, float32, fp16, bf16; pp 1 and 3; --recompute none,
  selective, full; multi-head, grouped-query and multi-query), under tp (stand-in groups: the
  all-reduces return their input, the shapes are the device's), with key/value heads shared
  by tp > n_kv_head ranks, with sequence parallelism (stand-in gathers and scatters) and with
  context parallelism (a stand-in ring that hands each rank its own K and V back: the values
  are wrong, the shapes right); the layer's bytes against activations.py's fourth table,
  written out in integers;
- FLOPs: the components by hand (K and V with Hkv heads, SwiGLU's three matrices),
  3 x the matmul forward = Family.train_flops_per_token x B T, an instrumented count on the
  whole model and on each device of tp x pp layouts (shared key/value heads included), what
  --recompute full runs again;
- communication: tp's all-reduces and the shared heads' gradient sums, sequence
  parallelism's sums of the two RMSNorm weights (not GPT-2's six), the ring's K and V of the
  Hkv heads, the tied embed_tokens between the pipeline's ends, ZeRO's units by Llama's names;
- the command line: the shape line, the activations table's Llama formulas, one-line errors.
The trainer runs with --arch llama (bytes sent, memory, peak activations, the summary's own
formula lines) are in tests/test_plan_trainer.py.
"""
import json
import math

import ml_dtypes
import numpy as np
import pytest

from minipar import comm
from minipar.autograd.tensor import Tensor
from minipar.comm.protocol import HEADER_BYTES
from minipar.model import moe
from minipar.model.llama import FAMILY as LLAMA
from minipar.model.gpt import GPT, GPTConfig, param_specs, train_flops_per_token
from minipar.parallel.context import context_parallel, ring_attention
from minipar.parallel.expert import expert_parallel
from minipar.parallel.context.context_parallel import ContextSplit
from minipar.parallel.parallelize import parts
from minipar.parallel.pipeline.stage import PipelineStage
from minipar.parallel.tensor import sequence_parallel, tensor_parallel
from minipar.parallel.tensor.sequence_parallel import SequenceParallelGPT
from minipar.parallel.zero import units as zero_units
from minipar.plan import activations, comm_bytes, flops, hosts as plan_hosts, layout, table

from test_plan import (FakeGroup, assert_forward_flops, cli, matmul_counter, no_tp_comm,  # noqa: F401 - fixtures
                       run_plan, stage_input)

PUBLISHED = {"llama2-7b": (6_738_415_616, 11008), "llama3-8b": (8_030_261_248, 14336),
             "llama3-70b": (70_553_706_496, 28672), "llama3-405b": (405_853_388_800, 53248)}
DTYPES = [(np.float64, 8, 8), (np.float32, 4, 4), (np.float16, 2, 4), (ml_dtypes.bfloat16, 2, 4)]
SMALL = ["--arch", "llama", "--n-layer", "3", "--n-head", "4", "--n-kv-head", "2", "--n-embd", "32",
         "--ffn-hidden", "48", "--block-size", "16", "--batch-size", "8", "--vocab-size", "97"]


def llama(n_kv_head=2, n_head=6, n_layer=3, T=12, C=24, F=36, V=97, **kw):
    return GPTConfig(vocab_size=V, block_size=T, n_layer=n_layer, n_head=n_head, n_embd=C, arch="llama",
                     n_kv_head=n_kv_head, ffn_hidden=F, **kw)


def owned(x, y, tp, stage):
    """The ids and targets tp rank 0's vocabulary slice [0, ceil(V/tp)) owns (97: every layout here)."""
    n = -(-97 // tp)
    return (int((np.asarray(x) < n).sum()) if stage == 0 else 0), int((y < n).sum())


class StandInComm:
    """What TensorParallelGPT asks of its tp group's communicator: Split, for the group of the
    ranks that hold its key/value head when tp > n_kv_head."""

    def Split(self, color, key):
        return None


@pytest.fixture
def shared_kv_groups(monkeypatch):
    """tp > n_kv_head on one process: the key/value head's group is a stand-in too (only its
    gradient sums use it, tp_all_reduce's, which no_tp_comm answers)."""
    monkeypatch.setattr(FakeGroup, "comm", StandInComm(), raising=False)
    monkeypatch.setattr(comm, "Group", lambda c, axis=None: FakeGroup(2))


@pytest.fixture
def no_sp_comm(monkeypatch, no_tp_comm):
    """Sequence parallelism on one process: the gathers tile this rank's piece, the
    reduce-scatters keep a copy of it (a fresh array, as comm's is)."""
    monkeypatch.setattr(sequence_parallel, "tp_collective", lambda kind, elements, run: run())
    monkeypatch.setattr(comm, "all_gather", lambda group, x: np.tile(np.ravel(x), group.size))
    monkeypatch.setattr(comm, "reduce_scatter", lambda group, pieces: pieces[group.rank].copy())


@pytest.fixture
def no_ring(monkeypatch):
    """The ring on one process: every step hands the rank its own K and V back (ring_attention's
    blocks keep their shapes; the values are not the model's)."""
    monkeypatch.setattr(ring_attention, "_ring_step", lambda group, outgoing: outgoing)
    monkeypatch.setattr(ring_attention, "_finish", lambda handles, which: handles)
    monkeypatch.setattr(ring_attention, "_progress", lambda handles: None)


def stage_of(cfg, tp, pp, stage, dtype, recompute="none", sp=False):
    """A stage of a tp x pp layout on stand-in groups (test_plan.stage_model's, and with --sp)."""
    p = parts(recompute)
    layers = SequenceParallelGPT if sp else tensor_parallel.TensorParallelGPT
    inner = layers(cfg, FakeGroup(tp), dtype=dtype, parts=p) if tp > 1 else GPT(cfg, dtype=dtype, parts=p)
    return PipelineStage(inner, stage, pp, FakeGroup(pp, stage), 1)


# ---------------------------------------------------------------- presets

@pytest.mark.parametrize("model", list(PUBLISHED))
def test_presets_are_the_published_counts(model):
    """The parameter counts Meta and Hugging Face publish, by the model's param_specs and by
    hand: per layer two RMSNorms 2C, q and o C^2 each, k and v C Hkv hs each, SwiGLU 3CF;
    embed_tokens and lm_head V C each (untied), the final norm C. F from Llama's rule."""
    count, F = PUBLISHED[model]
    r = run_plan("--model", model)
    m, C = r["model"], r["model"]["n_embd"]
    kv = m["n_kv_head"] * C // m["n_head"] if m["n_kv_head"] else C
    assert r["shape"]["hidden"] == F and m["ffn_hidden"] == 0            # F from the rule, not given
    by_hand = m["n_layer"] * (2 * C + 2 * C * C + 2 * C * kv + 3 * C * F) + 2 * m["vocab_size"] * C + C
    assert r["params"] == by_hand == count == sum(math.prod(s) for _, s, _ in param_specs(GPTConfig(**m)))


def test_presets_set_every_family_field_and_flags_override_them():
    """A preset is GPTConfig fields: the JSON's "model" is the whole GPTConfig (arch, the kv
    heads, the rule's multiplier and rounding, the rotary base, untied); a shape or family
    flag beside --model overrides its field."""
    r = run_plan("--model", "llama3-8b")
    assert GPTConfig(**r["model"]) == GPTConfig(**table.PRESETS["llama3-8b"])
    assert {k: r["model"][k] for k in ("arch", "n_kv_head", "ffn_multiplier", "multiple_of", "rope_theta",
                                       "tie_embeddings", "block_size")} == \
        {"arch": "llama", "n_kv_head": 8, "ffn_multiplier": 1.3, "multiple_of": 1024, "rope_theta": 500000.0,
         "tie_embeddings": False, "block_size": 8192}
    assert r["shape"]["description"] == "Llama L=32 H=32 Hkv=8 C=4096 F=14336 theta=500000"
    m = run_plan("--model", "llama3-8b", "--n-kv-head", "4", "--block-size", "2048", "--tied")["model"]
    assert (m["n_kv_head"], m["block_size"], m["tie_embeddings"], m["rope_theta"]) == (4, 2048, True, 500000.0)
    assert run_plan("--model", "gpt2")["model"]["arch"] == "gpt2"


@pytest.mark.parametrize("kv,tied", [(2, False), (3, True)])
def test_device_params_equal_what_a_stage_model_holds(shared_kv_groups, kv, tied):
    """Every stage of tp x pp layouts (tp > Hkv included: a shared head's copy on each of its
    ranks, tensor_parallel.local_size): the planner's params_local, pipeline.local_tensors,
    is what a stage model built on that layout holds."""
    cfg = llama(kv, n_layer=5, F=48, tie_embeddings=tied)
    for tp in (1, kv, 6):
        for pp in (1, 2, 5):
            flags = ["--arch", "llama", "--vocab-size", "97", "--block-size", "12", "--n-layer", "5", "--n-head", "6",
                     "--n-kv-head", str(kv), "--n-embd", "24", "--ffn-hidden", "48", "--tp", str(tp), "--pp", str(pp),
                     "--tied" if tied else "--untied"]
            held = [m["params_local"] for m in run_plan(*flags)["memory_per_stage"]]
            assert held == [stage_of(cfg, tp, pp, st, np.float32).num_local_params() for st in range(pp)], (tp, pp)


# ---------------------------------------------------------------- activations: Tensor.saved_bytes

@pytest.mark.parametrize("dtype,s,c", DTYPES)
@pytest.mark.parametrize("pp", [1, 3])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activation_bytes_equal_saved_bytes(dtype, s, c, pp, mode):
    """One micro-batch through each stage, one process: multi-head (Hkv = H = 6), grouped-query
    (2) and multi-query (1) attention; the planner's bytes equal Tensor.saved_bytes exactly,
    and none for the fused weights (the linear keeps their pieces, the parameters)."""
    rng = np.random.default_rng(0)
    for kv in (0, 2, 1):
        cfg = llama(kv)
        for st in range(pp):
            y = rng.integers(0, 97, (2, 12))
            out = stage_of(cfg, 1, pp, st, dtype, mode).forward(stage_input(cfg, st, 2, dtype, rng),
                                                                  y if st == pp - 1 else None, 24)
            assert out.saved_bytes() == activations.stage_bytes(cfg, st, pp, 1, 2, s, c, recompute=mode), \
                (kv, st, np.dtype(dtype).name, mode)


@pytest.mark.parametrize("dtype,s,c", [DTYPES[0], DTYPES[2]])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("tp,kv", [(2, 0), (3, 3), (6, 2), (2, 1), (3, 1)],
                         ids=["tp2", "tp3-kv3", "tp6-kv2-shared", "tp2-kv1-shared", "tp3-kv1-shared"])
def test_activation_bytes_with_tp_equal_saved_bytes(no_tp_comm, shared_kv_groups, dtype, s, c, mode, tp, kv):
    """tp rank 0 of each stage (pp 1 and 2), given the ids its vocabulary slice owns (the one
    data-dependent term): exact, with the rank's Hkv/tp key/value heads, or one shared head
    when tp > Hkv (a copy of it on tp/Hkv ranks)."""
    rng = np.random.default_rng(1)
    cfg = llama(kv)
    for pp in (1, 2):
        for st in range(pp):
            x, y = stage_input(cfg, st, 2, dtype, rng), rng.integers(0, 97, (2, 12))
            out = stage_of(cfg, tp, pp, st, dtype, mode).forward(x, y if st == pp - 1 else None, 24)
            want = activations.stage_bytes(cfg, st, pp, tp, 2, s, c, recompute=mode, owned=owned(x, y, tp, st))
            assert out.saved_bytes() == want, (pp, st, np.dtype(dtype).name)


@pytest.mark.parametrize("dtype,s,c", [DTYPES[0], DTYPES[3]])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("tp,kv", [(2, 0), (3, 3), (2, 1), (6, 2)], ids=["tp2", "tp3-kv3", "tp2-kv1", "tp6-kv2"])
def test_activation_bytes_with_sp_equal_saved_bytes(no_sp_comm, shared_kv_groups, dtype, s, c, mode, tp, kv):
    """--sp: the norms and the inputs of [q|k|v] and [gate|up] on the rank's T/tp tokens (a
    later stage receives (b, T/tp, C)); no position table to slice."""
    rng = np.random.default_rng(2)
    cfg = llama(kv)
    for pp in (1, 2):
        for st in range(pp):
            x = rng.integers(0, 97, (2, 12)) if st == 0 else \
                stage_input(llama(kv, T=12 // tp), 1, 2, dtype, rng)
            y = rng.integers(0, 97, (2, 12))
            out = stage_of(cfg, tp, pp, st, dtype, mode, sp=True).forward(x, y if st == pp - 1 else None, 24)
            want = activations.stage_bytes(cfg, st, pp, tp, 2, s, c, sp=True, recompute=mode,
                                           owned=owned(x, y, tp, st))
            assert out.saved_bytes() == want, (pp, st, np.dtype(dtype).name)


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("cp,tp,kv,H,cp_layout", [(2, 1, 0, 6, "zigzag"), (4, 1, 2, 6, "contiguous"),
                                                  (2, 2, 1, 6, "zigzag"), (4, 2, 0, 2, "zigzag")],
                         ids=["cp2", "cp4-kv2-contiguous", "cp2-tp2-kv1-shared", "cp4-tp2-one-head"])
def test_activation_bytes_with_cp_equal_saved_bytes(no_tp_comm, shared_kv_groups, no_ring, mode, cp, tp, kv, H,
                                                    cp_layout):
    """--cp: every cp rank's forward on its T/cp tokens (B = 2, T = 16), the ring keeping q,
    k, v (the rank's key/value heads only), o and the log-sum-exp whatever --recompute says
    (full: the block inputs alone). One query head per rank (H = 2, tp = 2) in float64 and
    float32: o_proj's input is a view of the ring's o, counted once."""
    rng = np.random.default_rng(3)
    cfg = llama(kv, n_head=H, T=16)
    for dtype, s, c in DTYPES[:3]:
        for rank in range(cp):
            split = ContextSplit(FakeGroup(cp, rank), cp_layout)
            p = parts(mode, context=split)
            model = tensor_parallel.TensorParallelGPT(cfg, FakeGroup(tp), dtype=dtype, parts=p) if tp > 1 \
                else GPT(cfg, dtype=dtype, parts=p)
            x, y = (split.local(a) for a in rng.integers(0, 97, (2, 2, 16)))
            got = model(x, y, loss_denom=32).saved_bytes()
            want = activations.stage_bytes(cfg, 0, 1, tp, 2, s, c, recompute=mode, cp=cp,
                                           owned=owned(x, y, tp, 0) if tp > 1 else None)
            assert got == want, (rank, np.dtype(dtype).name)


@pytest.mark.parametrize("s,b,h,a,k,f,t,d", [(12, 2, 24, 6, 2, 40, 2, 8), (16, 3, 32, 4, 4, 48, 4, 4),
                                             (48, 1, 48, 6, 1, 66, 3, 2)])
def test_layer_bytes_follow_the_fourth_table(s, b, h, a, k, f, t, d):
    """llama_layer_bytes in the six settings and with cp c = 2, against activations.py's
    fourth table written out in integers: sp divides every per-token term by t, selective
    removes P (b a/t s^2 d), full keeps the block's input; nothing for the fused weights.
    With t > k (the last case) each rank keeps one key/value head: k/t is 1
    (the tp + sp rows are then not none's / t). With one head a rank (the second) the ring's o
    and o_proj's input are one array."""
    cfg = llama(k, n_head=a, T=s, C=h, F=f)
    sb, sbh, hs = s * b, s * b * h, h // a
    kt = max(1, k // t) * hs                              # a tp rank's key (value) channels
    per_token = 6 * sbh + 2 * sb + 2 * sb * k * hs + 3 * sb * f      # sbh (6 + 2/h + 2k/a + 3f/h)
    split = 2 * sbh // t + 2 * sb * kt + 3 * sb * f // t             # sbh (2 + 2k/a + 3f/h)/t
    want = {"none": d * (per_token + a * s * sb),
            "tp": d * (4 * sbh + 2 * sb + split + a // t * s * sb),
            "tp+sp": d * (4 * sbh + 2 * sb + split * t + a * s * sb) // t if k >= t else None,
            "tp+selective": d * (4 * sbh + 2 * sb + split),
            "tp+sp+selective": d * (4 * sbh + 2 * sb + split * t) // t if k >= t else None,
            "full": d * sbh}
    got = {row["setting"]: row["minipar"] for row in activations.family_table(cfg, b, t, d)}
    assert {key: v for key, v in got.items() if want[key] is not None} == {key: v for key, v in want.items()
                                                                           if v is not None}
    assert k < t or per_token == 4 * sbh + 2 * sb + split * t        # the tp+sp row: all of none's / t
    c = 2                                                 # the ring: q, o, k, v, lse on s/c tokens; no P
    ring = d * (4 * sbh + 2 * sb + split + sbh // t + a // t * sb) // c
    if a // t == 1:                                       # one head a rank: o_proj's input is a view of o
        ring -= d * sbh // t // c
    assert activations.llama_layer_bytes(cfg, b, t, d, cp=c) == ring
    assert activations.llama_layer_bytes(cfg, b, t, d, cp=c, recompute="selective") == ring


# ---------------------------------------------------------------- mixture of experts (Mixtral's, shared experts)

def llama_moe(F=0.0, S=0, every=1, E=4, K=2, **kw):
    """E = 4 SwiGLU experts of F_e = 20 (the dense MLP: 36), top-2, Mixtral's router."""
    return llama(moe_experts=E, moe_top_k=K, moe_every=every, moe_capacity_factor=F, moe_ffn_hidden=20,
                 moe_shared_experts=S, **kw)


def moe_stage_of(cfg, tp, pp, stage, dtype, recompute):
    """stage_of with the routing recording its decisions (MoESettings.stats)."""
    settings = moe.settings_of(cfg, stats=[])
    p = parts(recompute, moe=settings)
    inner = tensor_parallel.TensorParallelGPT(cfg, FakeGroup(tp), dtype=dtype, parts=p) if tp > 1 \
        else GPT(cfg, dtype=dtype, parts=p)
    return PipelineStage(inner, stage, pp, FakeGroup(pp, stage), 1), settings


@pytest.mark.parametrize("dtype,s,c", DTYPES)
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("tp", [1, 2])
def test_moe_activation_bytes_equal_saved_bytes(no_tp_comm, dtype, s, c, mode, tp):
    """Blocks 1 and 2 of 3 MoE (every = 2: block 1; with a shared expert every block), each
    stage of pp 1 and 2, tp rank 0 (the experts whole on it): exact given the assignments each
    MoE layer kept; without a capacity that is N K, the formula's default."""
    rng = np.random.default_rng(4)
    for F, S in ((0.0, 0), (0.5, 1)):
        cfg = llama_moe(F, S, every=1 if S else 2)
        for pp in (1, 2):
            for st in range(pp):
                m, settings = moe_stage_of(cfg, tp, pp, st, dtype, mode)
                x, y = stage_input(cfg, st, 2, dtype, rng), rng.integers(0, 97, (2, 12))
                out = m.forward(x, y if st == pp - 1 else None, 24)
                kept = {i: int(d.kept.sum()) for i, d in settings.stats}
                own = owned(x, y, tp, st) if tp > 1 else None
                want = activations.stage_bytes(cfg, st, pp, tp, 2, s, c, recompute=mode, owned=own,
                                               routed={i: (k, k) for i, k in kept.items()})
                assert out.saved_bytes() == want, (F, S, pp, st)
                if F == 0.0:
                    assert want == activations.stage_bytes(cfg, st, pp, tp, 2, s, c, recompute=mode, owned=own)


@pytest.mark.parametrize("dtype,s,c", DTYPES)
@pytest.mark.parametrize("E,K,F,S", [(4, 2, 0.0, 0), (4, 2, 0.5, 1), (4, 2, 1.25, 2), (3, 1, 0.0, 1)])
@pytest.mark.parametrize("placed", [False, True])
def test_moe_layer_bytes_with_balanced_routing(dtype, s, c, E, K, F, S, placed):
    """One Llama MoE layer on N = 24 tokens routed exactly evenly (test_plan.balanced_moe_forward's
    router): moe_mlp_bytes' fifth table with no counts given. placed: the expert-parallel code
    path on a group of one rank (ep = 2's index arrays; its E experts all local, local = E)."""
    from mpi4py import MPI
    N, C, Fe = 24, 24, 20
    cfg = llama_moe(F, S, E=E, K=K, n_layer=1, C=C)
    P = GPT(cfg, dtype=dtype).params
    w = np.zeros((C, E), dtype)
    w[:E, :E] = np.eye(E)
    P[LLAMA.router_name(0)] = Tensor(w, requires_grad=True)
    x = np.zeros((N, C), dtype)
    for n in range(N):
        for j in range(K):
            x[n, (n + j) % E] = 5 - j
    settings = moe.settings_of(cfg, stats=[])
    if placed:
        settings.placement = expert_parallel.ExpertPlacement(comm.Group(MPI.COMM_SELF, axis="ep"), E)
    y = moe.moe_mlp(P, 0, Tensor(x.reshape(2, 12, C), requires_grad=True) + 0.0, settings, LLAMA)
    assert list(settings.stats[0][1].load[0]) == [N * K // E] * E
    layer = activations.MoELayer(E, K, 2 if placed else 1, moe.capacity(N, K, E, F), swiglu=Fe, shared=S)
    assert y.saved_bytes() == activations.moe_mlp_bytes(N, C, layer, s, c)


def test_moe_layer_bytes_by_hand():
    """The fifth table in float64, N = 24, C = 24, E = 4, K = 2, F_e = 20, no capacity: M = R =
    N K = 48; no bytes for the experts' weights (the fused [w1|w3] is never kept); a shared
    expert adds its SwiGLU on all N; --ep 2 the 2R ids of the received rows' order."""
    N, C, E, K, Fe, M, d = 24, 24, 4, 2, 20, 48, 8
    router = d * (N * C + N * E + 2 * N + N * K) + 8 * N * E
    rows = d * M * C + d * M * (2 * Fe + Fe)                   # gathered rows; [w1|w3]'s output, w2's input
    combine = d * (M * C + M)
    one = activations.MoELayer(E, K, swiglu=Fe)
    assert activations.moe_mlp_bytes(N, C, one, d, d) == router + rows + combine + 8 * 2 * M
    shared = activations.MoELayer(E, K, swiglu=Fe, shared=1)
    assert activations.moe_mlp_bytes(N, C, shared, d, d) - activations.moe_mlp_bytes(N, C, one, d, d) == \
        d * N * 3 * Fe
    ep = activations.MoELayer(E, K, ep=2, swiglu=Fe)
    assert activations.moe_mlp_bytes(N, C, ep, d, d) == router + rows + combine + 8 * 4 * M


def test_mixtral_8x7b_is_the_published_count():
    """Mixtral 8x7B: 46,702,792,704 parameters (Hugging Face's MixtralForCausalLM), by hand:
    per layer two RMSNorms, q and o C^2, k and v C Hkv hs, the router C E, 8 experts 3 C F;
    active per token 2 of the 8 experts (12,879,925,248: "12.9B active")."""
    r = run_plan("--model", "mixtral-8x7b")
    m = r["model"]
    C, L, V, F, E = m["n_embd"], m["n_layer"], m["vocab_size"], m["ffn_hidden"], m["moe_experts"]
    assert (C, L, V, F, E, m["moe_top_k"], m["n_kv_head"], m["block_size"]) == (4096, 32, 32000, 14336, 8, 2, 8, 32768)
    attention = 2 * C * C + 2 * C * (C // 4)
    by_hand = L * (2 * C + attention + C * E + E * 3 * C * F) + 2 * V * C + C
    assert r["params"] == by_hand == 46_702_792_704
    assert r["params_active"] == by_hand - L * 6 * 3 * C * F == 12_879_925_248
    assert m["moe_router"] == "mixtral" and m["rope_theta"] == 1e6 and not m["tie_embeddings"]


@pytest.mark.parametrize("flags", [["--model", "mixtral-8x7b"],
                                   [*SMALL, "--moe-experts", "4", "--moe-every", "2", "--moe-shared-experts", "2",
                                    "--moe-ffn-hidden", "20"]])
def test_moe_flops_are_the_trainers_mfu_numerator(flags):
    """The components' matmuls (K routed and the shared experts, F_e wide, and the router) are
    Family.train_flops_per_token, per token of the batch."""
    r = run_plan(*flags)
    cfg = GPTConfig(**r["model"])
    assert 3 * r["flops"]["matmul_forward"] == train_flops_per_token(cfg) * r["layout"]["batch_size"] * cfg.block_size


def test_mixtral_counts_follow_every_pipeline_message():
    """--moe-router mixtral over pp 2, blocks 1 and 3 of 4 MoE, M = 2: stage 0 sends 2
    activations, each followed by (1, E) counts (block 1 is on it), stage 1 2 gradients, each
    followed by the whole model's; with block 0 alone dense on stage 0 (every 4: block 3)
    stage 0's counts are (0, E), a header alone. Switch's loss sends none."""
    flags = [*SMALL, "--n-layer", "4", "--moe-experts", "4", "--pp", "2", "--micro-batches", "2"]
    E, header = 4, HEADER_BYTES

    def pp(*more):
        cfg, lay, _ = table.resolve(table.build_parser().parse_args([*flags, *more]))
        return [comm_bytes.pp_bytes(cfg, st, lay, 4) for st in range(2)]
    switch = pp("--moe-every", "2", "--moe-router", "switch")
    assert [a - b for a, b in zip(pp("--moe-every", "2"), switch)] == [2 * (header + 8 * E)] * 2
    assert [a - b for a, b in zip(pp("--moe-every", "4"), switch)] == [2 * header, 2 * (header + 8 * E)]


# ---------------------------------------------------------------- FLOPs

def test_flops_by_hand():
    """T = 4, C = 8, H = 2 heads of hs = 4, Hkv = 1, F = 12, V = 10, L = 1, B = 3: Chinchilla's
    items with K and V one head wide and SwiGLU's three matrices; 3 x the matmul forward is
    the family's train_flops_per_token x B T (the trainer's MFU numerator)."""
    T, C, H, hs, F, V, B = 4, 8, 2, 4, 12, 10, 3
    r = run_plan("--arch", "llama", "--n-layer", "1", "--n-head", "2", "--n-kv-head", "1", "--n-embd", "8",
                 "--ffn-hidden", "12", "--block-size", "4", "--vocab-size", "10", "--batch-size", "3")
    want = {"embeddings": 2 * T * V * C, "kqv_projections": 2 * T * C * (C + 2 * hs),
            "key_query_logits": 2 * T * T * C, "softmax": 3 * H * T * T, "softmax_value": 2 * T * T * C,
            "final_linear": 2 * T * C * C, "dense": 2 * T * 3 * C * F, "logits": 2 * T * C * V}
    f = r["flops"]
    assert f["components"] == {k: B * v for k, v in want.items()}
    assert 3 * f["matmul_forward"] == train_flops_per_token(GPTConfig(**r["model"])) * B * T == f["per_token"] * B * T
    assert f["six_nd"] == 6 * r["params"] * B * T and flops.mlp_weights(GPTConfig(**r["model"])) == 3 * C * F


@pytest.mark.parametrize("tp,pp,kv", [(1, 1, 2), (2, 1, 2), (4, 1, 2), (2, 2, 1), (4, 2, 2)],
                         ids=["whole", "tp2", "tp4-shared", "tp2-pp2-shared", "tp4-pp2-shared"])
def test_forward_flops_equal_instrumented_matmuls(matmul_counter, no_tp_comm, shared_kv_groups, tp, pp, kv):
    """The matmul FLOPs of a forward pass (Linear, MatMul, attention's two products, wrapped
    by test_plan's counter) equal the planner's: the whole model, and each device of a dp=2 x
    tp x pp layout, where a shared key/value head is computed on each of its tp/Hkv ranks."""
    cfg = llama(kv, n_head=4, C=16, F=24)
    flags = ["--arch", "llama", "--vocab-size", "97", "--block-size", "12", "--n-layer", "3", "--n-head", "4",
             "--n-kv-head", str(kv), "--n-embd", "16", "--ffn-hidden", "24", "--batch-size", "4"]
    assert_forward_flops(matmul_counter, cfg, flags, tp, pp, stage_of)


def test_recompute_adds_the_blocks_forward():
    """--recompute full runs every block's forward again: the family's FLOPs per token less
    the head's 3 x 2 C V, a third of it, for B T tokens; selective the Q K^T, 2 B T^2 C a layer."""
    r = run_plan(*SMALL, "--recompute", "full")
    cfg, (B, T, C, V) = GPTConfig(**r["model"]), (8, 16, 32, 97)
    assert r["flops"]["recompute_added"] * 3 == (train_flops_per_token(cfg) - 3 * 2 * C * V) * B * T
    assert run_plan(*SMALL, "--recompute", "selective")["flops"]["recompute_added"] == 3 * 2 * B * T * T * C


# ---------------------------------------------------------------- communication

def test_tp_bytes_and_the_shared_heads_sums_by_hand():
    """L = 3, b = 8, T = 16, C = 32, H = 4, Hkv = 2, fp32. tp 2: each rank its own key/value
    head, Megatron's 4L + 2 all-reduces of b T C and the cross-entropy's 3 of b T. tp 4: each
    head on 2 ranks, whose k_proj and v_proj gradients (C x hs) are all-reduced over those 2,
    2 per block (tensor_parallel.kv_grad_count, the summary's megatron_count)."""
    L, n, ar = 3, 8 * 16 * 32, comm_bytes.all_reduce_sent
    for tp, kv_share in ((2, 1), (4, 2)):
        want = (4 * L + 2) * ar(n, 4, tp) + 3 * ar(8 * 16, 4, tp) + ar(1, 8, tp)
        if kv_share > 1:
            want += 2 * L * ar(32 * 8, 4, kv_share)
        assert run_plan(*SMALL, "--tp", str(tp))["comm"]["tp"] == want, tp
        cfg = GPTConfig(**run_plan(*SMALL)["model"])
        assert tensor_parallel.megatron_count(cfg, 8, 16, tp=tp)[0] == 4 * L + 5 + (2 * L if kv_share > 1 else 0)


def test_sp_sums_two_norm_weights_a_block():
    """--tp 2 --sp: the gathers and scatters of sp_count, then the gradient sums of what
    every rank holds whole: Llama's two RMSNorm weights a block and the final norm's (GPT-2:
    six a block, two at the end, and wpe's rows gathered), each a (C,) vector."""
    L, rows, T, C, ar = 3, 8, 16, 32, comm_bytes.all_reduce_sent
    n = rows * T * C
    want = ((6 * L + 3) * comm_bytes.all_gather_sent(n // 2, 4, 2)
            + (4 * L + 2) * comm_bytes.reduce_scatter_sent(n, 4, 2)
            + (2 * L + 1) * ar(C, 4, 2) + 3 * ar(rows * T, 4, 2) + ar(1, 8, 2))
    assert run_plan(*SMALL, "--tp", "2", "--sp")["comm"]["tp"] == want
    assert sequence_parallel.replicated_sums(GPTConfig(**run_plan(*SMALL)["model"])) == ((2, 2 * C), (1, C), 0)


def test_cp_ring_carries_the_kv_heads_only():
    """--cp 2: the ring passes K and V of the rank's Hkv heads, n = b (T/cp) Hkv hs elements
    each (not C: half of it here, Hkv = H/2); one call per layer and micro-batch."""
    for cp, tp in ((2, 1), (2, 4)):
        n = 8 * (16 // cp) * context_parallel.kv_width(GPTConfig(**run_plan(*SMALL)["model"]), tp)
        assert n == 8 * (16 // cp) * (16 if tp == 1 else 8)        # 2 heads of 8; tp 4: one shared
        r = run_plan(*SMALL, "--cp", str(cp), "--tp", str(tp))
        assert r["comm"]["cp"] == 3 * ring_attention.ring_traffic(n, cp, 4)[1], (cp, tp)


def test_pp_sends_the_tied_embed_tokens_between_the_ends():
    """--tied --pp 2: each end sends the other embed_tokens' gradient (V x C, its ZeRO shard
    with --zero), one message more than untied."""
    base = [*SMALL, "--pp", "2", "--micro-batches", "2"]
    untied, tied = (run_plan(*base, *flag)["comm_per_stage"] for flag in ([], ["--tied"]))
    assert [t["pp"] - u["pp"] for t, u in zip(tied, untied)] == [97 * 32 * 4 + HEADER_BYTES] * 2
    untied, tied = (run_plan(*base, *flag, "--dp", "2", "--zero", "1")["comm_per_stage"] for flag in ([], ["--tied"]))
    shard = zero_units.padded(97 * 32, 2) // 2
    assert [t["pp"] - u["pp"] for t, u in zip(tied, untied)] == [shard * 4 + HEADER_BYTES] * 2


def test_zero_units_are_llamas_names():
    """ZeRO's units by the family's names: embed_tokens alone, one a layer, the rest (the final
    norm and lm_head), each padded for dp; as many as the trainer's ZeRO makes."""
    r = run_plan(*SMALL, "--dp", "3", "--zero", "2", "--batch-size", "12")
    cfg, lay, _ = table.resolve(table.build_parser().parse_args([*SMALL, "--dp", "3", "--batch-size", "12"]))
    tensors = layout.device_tensors(cfg, lay, 0)
    names = zero_units.unit_names([n for n, _ in tensors], cfg.family)
    assert [u[0] for u in names] == ["embed_tokens.weight", "layers.0.input_layernorm.weight",
                                     "layers.1.input_layernorm.weight", "layers.2.input_layernorm.weight",
                                     "norm.weight"]
    assert r["memory"]["params_padded"] == sum(layout.zero_units(tensors, 3, cfg.family))
    assert len(layout.zero_units(tensors, 3, cfg.family)) == 5


def test_shared_heads_sums_stay_inside_their_host():
    """--tp 4 --n-kv-head 2: each key/value head on 2 ranks, tp rank 0's group its first 2
    ranks. With 2 ranks per host that group is inside host 0: across hosts the tp group sends
    what it sends without shared heads (--n-kv-head 4, the same other messages); with 1 rank
    per host, that and the 2 L sums of (C, hs) more."""
    def tp_row(kv, k):
        args = table.build_parser().parse_args([*SMALL, "--n-kv-head", str(kv), "--tp", "4",
                                                "--ranks-per-host", str(k)])
        cfg, lay, _ = table.resolve(args)
        return table.plan(cfg, lay, hosts=plan_hosts.Hosts.from_args(args))["comm"]
    sums = 2 * 3 * comm_bytes.all_reduce_sent(32 * 8, 4, 2)
    assert tp_row(2, 2)["tp"] - tp_row(4, 2)["tp"] == sums
    assert tp_row(2, 2)["inter_host"]["tp"] == tp_row(4, 2)["inter_host"]["tp"] > 0
    assert tp_row(2, 1)["inter_host"]["tp"] - tp_row(4, 1)["inter_host"]["tp"] == sums


# ---------------------------------------------------------------- the command line

def test_the_table_names_the_family(capsys):
    code, out, _ = cli(capsys, *SMALL, "--tp", "2")
    assert code == 0
    for text in ("minipar.plan: Llama L=3 H=4 Hkv=2 C=32 F=48 theta=10000 T=16 V=97 (untied)",
                 "(s=16 b=8 h=32 a=4 k=2 f=48 t=2, d=4)", "d sbh (4 + 2/h + (2 + 2k/a + 3f/h)/t + as/ht) <",
                 "(k/t is 1 when t > k)", "kqv projections", "dense"):
        assert text in out, text
    assert "Korthikanti" not in out
    code, out, _ = cli(capsys, *SMALL, "--cp", "2")
    assert code == 0 and "d sbh/c (4 + 2/h + (3 + 2k/a + 3f/h)/t + a/ht)   (c = 2" in out
    code, out, _ = cli(capsys, *SMALL, "--json")
    r = json.loads(out)
    assert GPTConfig(**r["model"]).validate().family.name == "llama" and r["shape"]["kv_heads"] == 2


@pytest.mark.parametrize("flags,message", [
    (["--model", "llama3-8b", "--arch", "gpt2"], "--model llama3-8b is a llama model: drop --arch gpt2"),
    (["--model", "gpt2", "--arch", "llama"], "--model gpt2 is a gpt2 model: drop --arch llama"),
    (["--n-kv-head", "2"], "--n-kv-head is a setting of the Llama family: it needs --arch llama"),
    (["--model", "llama2-7b", "--n-kv-head", "3"], "--n-kv-head 3 must divide --n-head 32"),
    (["--arch", "llama", "--n-head", "6", "--n-embd", "48", "--n-kv-head", "3", "--tp", "2"],
     "--n-kv-head 3 and --tp 2: tensor parallelism needs --tp to divide --n-kv-head"),
    (["--arch", "llama", "--n-embd", "18", "--n-head", "2"], "must be even"),
])
def test_bad_flags_exit_2_with_one_line(capsys, flags, message):
    code, out, err = cli(capsys, *flags)
    assert code == 2 and out == "", (code, out)
    assert err.count("\n") == 1 and err.startswith("minipar.plan: error: ") and message in err, err
