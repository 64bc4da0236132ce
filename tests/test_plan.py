"""The planner (minipar/plan/), on one process: its formulas against minipar's own code.

- parameters: the exact count of the architecture, and each device's share
  (pipeline.local_tensors) equals pipeline.local_param_count and, with one stage,
  tensor_parallel.local_param_count;
- memory: ZeRO's formulas (2P + 2P + KP, each ZeRO stage's division by N) and a
  vocabulary-parallel embedding example; activations equal Tensor.saved_bytes of real forward passes
  with each --recompute mode; activations.layer_bytes against Korthikanti et al. 2022's Table 2
  (arXiv:2205.05198): the paper's formulas worked by hand, and minipar's with their structure;
- FLOPs: Chinchilla's per-component count (arXiv:2203.15556, appendix F), 6ND, and the matmul part equal to a count taken
  by instrumenting minipar's ops (Linear, MatMul, attention) on the whole model and on one
  device of tp and pp layouts;
- context parallelism (--cp): the ring's bytes summed by hand, per-token activations / cp and
  attention linear in T, per-device FLOPs and ZeRO over dp*cp, the sequence-length ceiling of
  --memory-budget (fits, the next multiple of 2cp does not, with cp >= without); the exact
  saved bytes with cp are tests/mpi/test_cp_activations.py's;
- mixture of experts (--moe-experts, --ep): parameters total and active by hand; E/ep experts
  per rank, whole on every tp rank; a MoE block's saved bytes equal Tensor.saved_bytes given
  the routing the forward made, and with no counts given when the routing is exactly balanced
  (dropping at a capacity, and the expert-parallel code path); FLOPs against
  train_flops_per_token and instrumented matmuls; the all-to-all bytes (capacity: exact;
  none: balanced routing's), the split gradient sums and tp's calls, worked by hand;
- the command line: JSON keys, --params mode, the activations-per-layer table, one-line errors
  with exit code 2.
The cross-checks against trainer runs (bytes held, ledger bytes) are in test_plan_trainer.py.
"""
import json
import math

import ml_dtypes
import numpy as np
import pytest

from minipar.plan import activations, comm_bytes, layout, memory, render, table
from minipar import comm
from minipar.model import moe
from minipar.autograd import ops, recompute
from minipar.model.gpt import FAMILY as GPT2_FAMILY
from minipar.model.gpt import GPT, GPTConfig, param_specs, train_flops_per_token
from minipar.comm.protocol import HEADER_BYTES
from minipar.parallel.expert import expert_parallel
from minipar.parallel.pipeline import stage as pipeline, schedules
from minipar.parallel.context import ring_attention
from minipar.parallel.tensor import tensor_parallel
from minipar.parallel.zero import formulas, units as zero_units
from minipar.parallel.pipeline.stage import PipelineStage
from minipar.parallel.parallelize import parts
from minipar.parallel.tensor.tensor_parallel import TensorParallelGPT
from minipar.autograd.tensor import Tensor

MiB = 2 ** 20


def run_plan(*flags):
    """The planner's dict for these flags, as `python -m minipar.plan --json` prints it."""
    cfg, lay, params = table.resolve(table.build_parser().parse_args(list(flags)))
    return table.plan(cfg, lay, params)


def cli(capsys, *flags):
    """main() in process: (exit code, stdout, stderr)."""
    code = 0
    try:
        table.main(list(flags))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


# ---------------------------------------------------------------- parameters

GPT2_PRESETS = [name for name, p in table.PRESETS.items() if p["arch"] == "gpt2"]   # Llama: test_plan_llama.py


def preset_shape(model):
    """(L, H, C, V, T) of a GPT-2 preset."""
    p = table.PRESETS[model]
    return p["n_layer"], p["n_head"], p["n_embd"], p["vocab_size"], p["block_size"]


@pytest.mark.parametrize("model", GPT2_PRESETS)
def test_params_is_the_exact_count_of_each_preset(model):
    L, H, C, V, T = preset_shape(model)
    want = sum(math.prod(s) for _, s, _ in param_specs(GPTConfig(V, T, L, H, C)))
    assert run_plan("--model", model)["params"] == want
    # per layer 12C^2 + 13C, embeddings VC + TC, ln_f 2C: biases, LayerNorms, wpe included
    assert want == L * (12 * C * C + 13 * C) + V * C + T * C + 2 * C
    if model == "gpt2":
        assert want == 124_439_808                       # GPT-2 small, as Hugging Face counts it


def test_params_equals_the_model_num_params():
    for flags, untied in ((["--n-layer", "2", "--n-embd", "32"], False), (["--vocab-size", "100"], True)):
        r = run_plan(*flags, *(["--untied"] if untied else []))
        cfg = GPTConfig(**{k: r["model"][k] for k in (*table.SHAPE_FLAGS, "tie_embeddings")})
        assert r["params"] == GPT(cfg).num_params(), flags


@pytest.mark.parametrize("V,tied", [(256, True), (257, False), (250, True)])
def test_device_params_equal_pipeline_local_param_count(V, tied):
    """Every stage of every (tp, pp): vocabulary padding, the tied copy on the last stage;
    the formula against what a stage model built on that layout holds."""
    cfg = GPTConfig(vocab_size=V, block_size=16, n_layer=5, n_head=6, n_embd=24, tie_embeddings=tied)
    for tp in (1, 2, 3, 6):
        for pp in (1, 2, 3, 5):
            for st in range(pp):
                mine = sum(n for _, n in pipeline.local_tensors(cfg, st, pp, tp))
                assert mine == pipeline.local_param_count(cfg, st, pp, tp), (tp, pp, st)
                assert mine == stage_model(cfg, tp, pp, st, np.float32).num_local_params(), (tp, pp, st)
        assert sum(n for _, n in pipeline.local_tensors(cfg, 0, 1, tp)) == tensor_parallel.local_param_count(cfg, tp)


# ---------------------------------------------------------------- memory: worked examples

def test_embedding_example():
    """A 640000 x 5120 embedding in FP32 takes 640000*5120*4/1024/1024 = 1250MB,
    as much again for gradients and for each of Adam's two moments, 5GB in all, and 2.5GB
    per device split in two along the vocabulary. The expression 640000*5120*4/1024/1024
    evaluates to 12500 (MiB), not 1250: those figures are those of 64,000 rows (a common
    vocabulary size), which we reproduce, in MiB, with 1 GB = 1000 MB."""
    assert 640000 * 5120 * 4 / 1024 / 1024 == 12500      # the expression as printed
    rows, C = 64000, 5120
    r = run_plan("--params", str(rows * C))             # the embedding alone, fp32, AdamW
    m = r["memory"]
    assert m["params"] / MiB == 1250 and m["grads"] / MiB == 1250 and m["optimizer"] / MiB == 2 * 1250
    assert m["model_states"] / MiB == 5000               # "5GB"
    assert run_plan("--params", str(rows * C), "--tp", "2")["memory"]["model_states"] / MiB == 2500   # "2.5GB"
    # the same through the model's own vocabulary-parallel wte (Vp/tp rows on each tp rank)
    cfg = GPTConfig(vocab_size=rows, block_size=1, n_layer=1, n_head=2, n_embd=C)
    wte = dict(pipeline.local_tensors(cfg, 0, 1, 2))["wte.weight"]
    assert wte == rows // 2 * C and memory.model_states(wte, wte, 4, 8, 0, 1)["model_states"] / MiB == 2500


@pytest.mark.parametrize("N", [1, 2, 4, 8])
def test_zero_formulas_fp16(N):
    """2P + 2P + KP with K = 12; ZeRO 1: KP/N; 2: 2P + (2P + KP)/N; 3: (4P + KP)/N, ZeRO's
    Stage 1/2/3 (Rajbhandari et al., arXiv:1910.02054, figure 1). C = 64, T = 64: every ZeRO unit
    (wte, each block, the rest) divides by 8, so no padding."""
    cfg = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "64", "--batch-size", "16"]
    P = run_plan(*cfg)["params"]
    K = 12
    want = {0: 2 * P + 2 * P + K * P, 1: 2 * P + 2 * P + K * P // N, 2: 2 * P + (2 * P + K * P) // N,
            3: (4 * P + K * P) // N}
    assert want[0] == 16 * P and want[1] == 4 * P + 12 * P // N and want[2] == 2 * P + 14 * P // N
    for stage, total in want.items():
        m = run_plan(*cfg, "--precision", "fp16", "--dp", str(N), "--zero", str(stage))["memory"]
        assert m["params_padded"] == P and m["model_states"] == total, (stage, m)
        f = formulas.formula(stage, P, P, N, 2, K)            # what ShardedAdamW.memory_report sets beside its buffers
        assert (m["params"], m["grads"], m["optimizer"]) == (f["params"], f["grads"], f["optimizer"])


def test_zero_pads_each_unit_to_a_multiple_of_dp():
    """Odd unit sizes (C = 18, V = 257): each unit pads to ceil(n/N)*N, as units.padded does."""
    flags = ["--n-layer", "3", "--n-head", "3", "--n-embd", "18", "--vocab-size", "257", "--batch-size", "24"]
    cfg = GPTConfig(vocab_size=257, block_size=64, n_layer=3, n_head=3, n_embd=18)
    padding = 0
    for tp, pp, N in ((1, 1, 8), (3, 1, 3), (1, 3, 4), (3, 3, 8)):
        r = run_plan(*flags, "--tp", str(tp), "--pp", str(pp), "--dp", str(N), "--zero", "2")
        for st, m in enumerate(r["memory_per_stage"]):
            sizes = dict(pipeline.local_tensors(cfg, st, pp, tp))
            units = [sum(sizes[n] for n in u) for u in zero_units.unit_names(list(sizes))]
            assert m["params_padded"] == sum(zero_units.padded(n, N) for n in units) >= m["params_local"]
            padding += m["params_padded"] - m["params_local"]
            assert m["params"] == 4 * m["params_padded"] and m["grads"] == 4 * m["params_padded"] // N
            assert m["optimizer"] == 8 * m["params_padded"] // N
    assert padding > 0


def test_bytes_per_param_follow_dtype_and_precision():
    for flags, s, K in ((["--dtype", "float64"], 8, 16), ([], 4, 8), (["--precision", "bf16"], 2, 12)):
        m = run_plan(*flags)["memory"]
        P = m["params_local"]
        assert (m["params"], m["grads"], m["optimizer"]) == (s * P, s * P, K * P), flags


# ---------------------------------------------------------------- activations: Tensor.saved_bytes

class FakeGroup:
    """A tp or pp group for forward passes that only need shapes: size and rank, no MPI."""

    def __init__(self, size, rank=0):
        self.size, self.rank = size, rank


@pytest.fixture
def no_tp_comm(monkeypatch):
    """Tensor-parallel forwards on one process: every all-reduce returns its input (the
    values are wrong, the shapes and hence the FLOPs and saved bytes are the device's)."""
    monkeypatch.setattr(tensor_parallel, "tp_all_reduce", lambda group, x, op, kind: x)


def stage_model(cfg, tp, pp, stage, dtype, recompute="none", n_chunks=1):
    p = parts(recompute)                              # as parallelize builds them
    inner = (TensorParallelGPT(cfg, FakeGroup(tp), dtype=dtype, parts=p) if tp > 1
             else GPT(cfg, dtype=dtype, parts=p))
    return PipelineStage(inner, stage, pp, FakeGroup(pp, stage), n_chunks)


def stage_input(cfg, stage, rows, dtype, rng):
    if stage == 0:
        return rng.integers(0, cfg.vocab_size, (rows, cfg.block_size))
    return Tensor(rng.standard_normal((rows, cfg.block_size, cfg.n_embd)).astype(dtype), requires_grad=True)


@pytest.mark.parametrize("dtype,s,c", [(np.float64, 8, 8), (np.float32, 4, 4), (np.float16, 2, 4),
                                       (ml_dtypes.bfloat16, 2, 4)])
@pytest.mark.parametrize("pp", [1, 3])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activation_bytes_equal_saved_bytes(dtype, s, c, pp, mode):
    """One micro-batch through each stage (with its loss on the last), with each --recompute
    mode: the planner's bytes equal Tensor.saved_bytes exactly (tp = 1). With full, a stage
    after the first keeps nothing of its first block's input: it is the received activation,
    a leaf of the graph (activations.stage_bytes)."""
    cfg = GPTConfig(vocab_size=97, block_size=12, n_layer=3, n_head=3, n_embd=24)
    rng = np.random.default_rng(0)
    for st in range(pp):
        m = stage_model(cfg, 1, pp, st, dtype, mode)
        y = rng.integers(0, cfg.vocab_size, (2, cfg.block_size))
        out = m.forward(stage_input(cfg, st, 2, dtype, rng), y if st == pp - 1 else None, 24)
        assert out.saved_bytes() == memory.activation_bytes(cfg, st, pp, 1, 2, s, c, sp=False, recompute=mode), \
            (st, np.dtype(dtype).name, mode)


def test_activation_bytes_with_tp_within_5_percent(no_tp_comm):
    """tp = 2: the masked embedding and the vocabulary-parallel cross-entropy keep the ids of
    the tokens tp rank 0's vocabulary half owns, which depends on the data (the planner
    assumes 1/tp of them). Uniform random tokens: within 5% (it is the ids' 8 bytes each,
    beside C*(...) bytes of activations per token)."""
    cfg = GPTConfig(vocab_size=97, block_size=12, n_layer=2, n_head=4, n_embd=16)
    rng = np.random.default_rng(1)
    for pp in (1, 2):
        for st in range(pp):
            m = stage_model(cfg, 2, pp, st, np.float64)
            y = rng.integers(0, cfg.vocab_size, (4, cfg.block_size))
            x = stage_input(cfg, st, 4, np.float64, rng)
            out = m.forward(x, y if st == pp - 1 else None, 48)
            got, est = out.saved_bytes(), memory.activation_bytes(cfg, st, pp, 2, 4, 8, 8)
            assert abs(est / got - 1) < 0.05, (pp, st, got, est)


def test_korthikanti_table_2_for_gpt3_175b():
    """Table 2 of Korthikanti et al. 2022 (arXiv:2205.05198) for GPT-3 175B, s = 2048,
    h = 12288, a = 96, b = 1, t = 8, worked by hand: 5as/h = 5*96*2048/12288 = 80, so per layer
    none sbh (34 + 80), tp sbh (10 + 24/8 + 80/8), tp+sp sbh (34 + 80)/8, tp+selective
    sbh (10 + 24/8), tp+sp+selective 34 sbh/8, full 2 sbh."""
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    want = {"none": 114 * sbh, "tp": 23 * sbh, "tp+sp": 14.25 * sbh, "tp+selective": 13 * sbh,
            "tp+sp+selective": 4.25 * sbh, "full": 2 * sbh}
    assert {k: activations.korthikanti(k, s, b, h, a, t) for k in activations.SETTINGS} == want


@pytest.mark.parametrize("s,b,h,a,t,d", [(12, 2, 24, 6, 2, 8), (16, 3, 32, 4, 4, 4), (48, 1, 48, 6, 3, 2)])
def test_layer_bytes_follow_the_papers_structure(s, b, h, a, t, d):
    """minipar's layer (d bytes per value, computed ones too) in the six settings:
    sequence parallelism divides the whole layer by t (t divides s); selective removes the
    softmax P, b a/t s^2 d bytes; full keeps the block's input, s b h d (/t with sp); each
    setting equals its formula in activations.FORMULAS, written out here in integers."""
    def layer(tp=1, sp=False, recompute="none"):
        return activations.layer_bytes(b, s, h, a, tp, d, d, sp, recompute)
    none, tp, tp_sp = layer(), layer(t), layer(t, True)
    softmax = b * a * s * s * d                                    # P (b, a, s, s)
    assert tp_sp * t == none
    assert tp - layer(t, recompute="selective") == b * (a // t) * s * s * d
    assert layer(recompute="full") == layer(t, recompute="full") == s * b * h * d
    assert layer(t, True, "full") * t == s * b * h * d
    assert layer(t, True, "selective") * t == none - softmax
    sb, sbh = s * b, s * b * h
    formulas = {"none": d * (20 * sbh + 2 * sb + a * s * sb),                      # d sbh (20 + 2/h + as/h)
                "tp": d * (4 * sbh + 2 * sb + 16 * sbh // t + a * s * sb // t),    # d sbh (4 + 2/h + 16/t + as/ht)
                "tp+sp": d * (20 * sbh + 2 * sb + a * s * sb) // t,               # d sbh/t (20 + 2/h + as/h)
                "tp+selective": d * (4 * sbh + 2 * sb + 16 * sbh // t),           # d sbh (4 + 2/h + 16/t)
                "tp+sp+selective": d * (20 * sbh + 2 * sb) // t,                  # d sbh/t (20 + 2/h)
                "full": d * sbh}                                                   # d sbh
    got = {row["setting"]: row["minipar"] for row in activations.table(s, b, h, a, t, d)}
    assert got == formulas
    assert (got["none"], got["tp"], got["tp+sp"]) == (none, tp, tp_sp)


def test_micro_batches_in_flight_follow_the_schedule():
    flags = ["--n-layer", "4", "--pp", "4", "--micro-batches", "8", "--batch-size", "16"]
    held = {s: [m["micro_batches_in_flight"] for m in run_plan(*flags, "--schedule", s)["memory_per_stage"]]
            for s in ("naive", "gpipe", "1f1b")}
    assert held == {"naive": [1, 1, 1, 1], "gpipe": [8, 8, 8, 8], "1f1b": [4, 3, 2, 1]}
    r = run_plan(*flags)
    assert r["memory"] == max(r["memory_per_stage"], key=lambda m: m["total"])   # the largest stage


P4_M8 = ["--n-layer", "8", "--pp", "4", "--micro-batches", "8", "--batch-size", "16"]


def schedule_flags(name):
    """--schedule name, and 2 virtual stages for interleaved."""
    return ["--schedule", name] + (["--virtual-stages", "2"] if name == "interleaved" else [])


@pytest.mark.parametrize("name", list(schedules.SCHEDULES))
def test_in_flight_peak_is_the_checkers(name):
    """p = 4, m = 8: the walk of each stage's own list holds at its peak as many (chunk,
    micro-batch) graphs as schedules.check counts when it runs every stage together; with one
    chunk every graph is a whole micro-batch of the stage's bytes."""
    V = 2 if name == "interleaved" else 1
    r = run_plan(*P4_M8, *schedule_flags(name))
    held = [m["micro_batches_in_flight"] for m in r["memory_per_stage"]]
    assert held == schedules.check(4, 8, name, virtual=V).peak_in_flight, (name, held)
    if V == 1:
        cfg = GPTConfig(**{k: r["model"][k] for k in (*table.SHAPE_FLAGS, "tie_embeddings")})
        assert [m["activations"] for m in r["memory_per_stage"]] == [
            n * memory.activation_bytes(cfg, st, 4, 1, 2, 4, 4) for st, n in enumerate(held)]


def test_zero_bubble_holds_until_w():
    """zb-h1 keeps 1F1B's p micro-batches on stage 0 but frees them at W, not B: a later stage
    holds more than 1F1B's p - stage; zb-h2 lets up to 2p - 1 be in flight."""
    held = {name: [m["micro_batches_in_flight"] for m in run_plan(*P4_M8, "--schedule", name)["memory_per_stage"]]
            for name in ("1f1b", "zb-h1", "zb-h2")}
    assert held["1f1b"] == [4, 3, 2, 1] and held["zb-h1"][0] == 4
    assert all(z >= o for z, o in zip(held["zb-h1"], held["1f1b"])) and held["zb-h1"] != held["1f1b"]
    assert max(held["zb-h2"]) == 7, held


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_chunks_bytes_equal_saved_bytes(recompute):
    """Interleaved, p = 2, V = 2, 4 layers: the forward of each chunk of each rank (a leaf
    input past virtual stage 0, the loss on virtual stage 3) saves exactly
    activations.stage_bytes(cfg, v, p*V) with v = chunk*p + stage, the unit the walk adds."""
    cfg = GPTConfig(vocab_size=97, block_size=12, n_layer=4, n_head=3, n_embd=24)
    rng = np.random.default_rng(0)
    for st in range(2):
        m = stage_model(cfg, 1, 2, st, np.float64, recompute, n_chunks=2)
        for chunk in range(2):
            v = chunk * 2 + st
            y = rng.integers(0, cfg.vocab_size, (2, cfg.block_size))
            out = m.forward(stage_input(cfg, v, 2, np.float64, rng), y if v == 3 else None, 24, chunk)
            assert out.saved_bytes() == activations.stage_bytes(cfg, v, 4, 1, 2, 8, 8, recompute=recompute), \
                (st, chunk, recompute)


# ---------------------------------------------------------------- FLOPs

def test_flops_follow_chinchilla_component_by_component():
    """T=4, C=8, H=2, V=10, L=1, B=3 by hand: Chinchilla's appendix F table, backward 2x, 6ND."""
    T, C, H, V, B = 4, 8, 2, 10, 3
    r = run_plan("--n-layer", "1", "--n-head", "2", "--n-embd", "8", "--block-size", "4",
                 "--vocab-size", "10", "--batch-size", "3")
    want = {"embeddings": 2 * T * V * C, "kqv_projections": 2 * 3 * T * C * C, "key_query_logits": 2 * T * T * C,
            "softmax": 3 * H * T * T, "softmax_value": 2 * T * T * C, "final_linear": 2 * T * C * C,
            "dense": 2 * T * (C * 4 * C + 4 * C * C), "logits": 2 * T * C * V}
    f = r["flops"]
    assert f["components"] == {k: B * v for k, v in want.items()}
    assert f["forward"] == B * sum(want.values()) and f["backward"] == 2 * f["forward"]
    assert f["total"] == 3 * f["forward"] and f["six_nd"] == 6 * r["params"] * B * T
    assert f["matmul_forward"] == f["forward"] - B * (want["embeddings"] + want["softmax"])


@pytest.mark.parametrize("model", ["gpt2", "gpt3-175b"])
def test_matmul_flops_are_the_trainers_mfu_numerator(model):
    r = run_plan("--model", model)
    L, H, C, V, T = preset_shape(model)
    per_token = train_flops_per_token(GPTConfig(V, T, L, H, C))
    assert 3 * r["flops"]["matmul_forward"] == per_token * 16 * T
    assert 0.9 < r["flops"]["total"] / r["flops"]["six_nd"] < 1.5       # 6ND is the approximation


@pytest.fixture
def matmul_counter(monkeypatch):
    """Wraps the forwards of ops.Linear, ops.MatMul and ops.CausalSelfAttention (every matmul
    of the model: the projections, the MLP, the head, and attention's k q^T and P v) and adds
    2*m*n*k per product, read from the operands' shapes. LayerNorm's row-mean GEMV is not a
    model FLOP in Chinchilla's count (a reduction); the embedding is a lookup."""
    count = {"flops": 0}

    def wrap(cls, flops_of):
        real = cls.forward

        def forward(self, *args, **kwargs):
            out = real(self, *args, **kwargs)
            count["flops"] += flops_of(self, args, out)
            return out
        monkeypatch.setattr(cls, "forward", forward)

    wrap(ops.Linear, lambda self, a, out: 2 * out.size * a[0].shape[-1])        # (N, Cin) @ (Cin, Cout)
    wrap(ops.MatMul, lambda self, a, out: 2 * out.size * a[0].shape[-1])        # (..., K) @ (K, M)
    def attention(self, a, out):
        q, k, v, pt = self.saved                          # P^T (..., Tk, Tq): one entry per (key, query)
        return 2 * 2 * pt.size * q.shape[-1]              # k @ q^T and P @ v, hs multiply-adds per entry
    wrap(ops.CausalSelfAttention, attention)
    return count


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 3), (2, 2), (3, 3)])
def test_forward_flops_equal_instrumented_matmuls(matmul_counter, no_tp_comm, tp, pp):
    """The matmul FLOPs of the forward pass equal the instrumented count: the whole model on
    one process (B sequences), and each device of a dp=2 x tp x pp layout (B/dp sequences
    through its stage, vocabulary padded to tp*ceil(V/tp) rows)."""
    cfg = GPTConfig(vocab_size=97, block_size=12, n_layer=3, n_head=6, n_embd=24)
    flags = ["--vocab-size", "97", "--block-size", "12", "--n-layer", "3", "--n-head", "6", "--n-embd", "24",
             "--batch-size", "4"]
    assert_forward_flops(matmul_counter, cfg, flags, tp, pp, stage_model)


def assert_forward_flops(counter, cfg, flags, tp, pp, make_stage):
    """The instrumented matmul FLOPs of cfg's forward (4 sequences of 12 tokens of a 97-token
    vocabulary) equal the planner's for `flags`: the whole model when tp = pp = 1, else each
    stage that make_stage(cfg, tp, pp, stage, dtype) builds, on dp = 2."""
    rng = np.random.default_rng(0)
    if (tp, pp) == (1, 1):
        GPT(cfg)(rng.integers(0, 97, (4, 12)))
        assert counter["flops"] == run_plan(*flags)["flops"]["matmul_forward"]
        return
    r = run_plan(*flags, "--dp", "2", "--tp", str(tp), "--pp", str(pp))
    for st in range(pp):
        counter["flops"] = 0
        make_stage(cfg, tp, pp, st, np.float64).forward(stage_input(cfg, st, 2, np.float64, rng))
        assert counter["flops"] == r["flops_per_stage"][st]["matmul_forward"], (tp, pp, st)


# ---------------------------------------------------------------- communication formulas, bubble

def test_all_reduce_bytes_follow_comm_algorithms():
    """Recursive doubling up to 64 KiB: log2(p) b (p a power of two), fix-up pairs send one
    more b, the extra ranks b; above: np.array_split pieces, direct exchange (p <= 8) or ring."""
    ar = comm_bytes.all_reduce_sent
    assert ar(1000, 8, 4) == 2 * 8000 and ar(1000, 8, 2) == 8000
    assert [ar(10, 8, 3, r) for r in range(3)] == [160, 80, 80]          # q = 2: rank 0 folds in rank 2
    n = 10_001                                                            # 80 KB: direct exchange
    assert ar(n, 8, 4, 0) == 8 * ((n - 2501) + 3 * 2501) and ar(n, 8, 4, 3) == 8 * ((n - 2500) + 3 * 2500)
    assert ar(n, 8, 9, 0) == 8 * ((n - 1112) + (n - 1112))                # ring: all but own, all but next
    assert ar(n, 8, 9, 1) == 8 * ((n - 1112) + (n - 1111))                # (pieces 1112, 1112, 1111 ...)
    assert comm_bytes.reduce_scatter_sent(16, 2, 4) == 24 and comm_bytes.all_gather_sent(4, 2, 4) == 24
    assert comm_bytes.broadcast_sent(8, 4, 3, 3) == 2 * 136 and comm_bytes.broadcast_sent(8, 4, 0, 3) == 0


def test_bubble():
    base = ["--n-layer", "4", "--batch-size", "8"]
    assert run_plan(*base)["bubble"] == 0.0
    assert run_plan(*base, "--pp", "4", "--micro-batches", "8")["bubble"] == pytest.approx(3 / 11)
    assert run_plan(*base, "--pp", "4", "--micro-batches", "8", "--schedule", "naive")["bubble"] == 0.75


@pytest.mark.parametrize("name", list(schedules.SCHEDULES))
def test_bubble_is_bubble_theory_of_the_schedule(name):
    """Each schedule at p = 4, m = 8 (V = 2 interleaved): schedules.bubble_theory, e.g.
    3/19 interleaved, 3/27 zero bubble."""
    V = 2 if name == "interleaved" else 1
    r = run_plan(*P4_M8, *schedule_flags(name))
    assert r["bubble"] == schedules.bubble_theory(name, 4, 8, V) and r["layout"]["virtual_stages"] == V
    assert r["bubble"] == {"interleaved": 3 / 19, "zb-h1": 3 / 27, "zb-h2": 3 / 27}.get(name, r["bubble"])


@pytest.mark.parametrize("name", list(schedules.SCHEDULES))
def test_pp_messages_follow_the_instruction_lists(name):
    """One message of b*T*C*s bytes + the header per send: M down and M up per boundary
    (2M on a middle stage, M at either end), V times as many with V chunks, minus the M the
    ends do not send (virtual stage 0 has no previous, pV-1 no next): 2VM - M at the ends.
    --untied: no wte exchange; 1 for the naive schedule alike. The rest is the loss broadcast."""
    V = 2 if name == "interleaved" else 1
    r = run_plan(*P4_M8, *schedule_flags(name), "--untied")
    act = 2 * 64 * 128 * 4 + HEADER_BYTES                                   # b = 2, T = 64, C = 128, fp32
    broadcast = [comm_bytes.broadcast_sent(8, 4, st, 3) for st in range(4)]
    want = [(2 * V * 8 - (8 if st in (0, 3) else 0)) * act + broadcast[st] for st in range(4)]
    assert [c["pp"] for c in r["comm_per_stage"]] == want, name


# ---------------------------------------------------------------- context parallelism (--cp)

CP_SMALL = ["--n-layer", "3", "--n-head", "4", "--n-embd", "32", "--block-size", "16", "--batch-size", "8",
            "--micro-batches", "2", "--tp", "2"]


@pytest.mark.parametrize("cp,recompute", [(2, "none"), (4, "none"), (2, "full")])
def test_cp_bytes_are_ring_traffic_summed_by_hand(cp, recompute):
    """L = 3 layers, M = 2 micro-batches of b = 4, T = 16, C = 32, tp = 2, fp32: each layer's
    ring sends, per micro-batch, with n = b (T/cp) C/tp elements of q, forward cp - 1
    messages of K and V (2n), backward cp - 1 of K, V, dK, dV (4n) and one of dK, dV home
    (2n); --recompute full runs the forward again. Each message has its 128-byte header."""
    r = run_plan(*CP_SMALL, "--cp", str(cp), "--recompute", recompute)
    n = 4 * (16 // cp) * 32 // 2
    forwards = 2 if recompute == "full" else 1
    messages = forwards * (cp - 1) + (cp - 1) + 1
    elements = forwards * (cp - 1) * 2 * n + (cp - 1) * 4 * n + 2 * n
    per_call = elements * 4 + messages * HEADER_BYTES
    assert per_call == ring_attention.ring_traffic(n, cp, 4, forwards)[1]
    row = r["comm"]
    assert row["cp"] == 3 * 2 * per_call, (row["cp"], per_call)
    assert row["bytes_by_axis"]["cp"] == row["cp"]
    assert row["bytes_per_step"] == sum(row[k] for k in ("dp", "cp", "tp", "pp", "other"))


def test_cp_bytes_follow_the_stage_and_the_layers():
    """With a pipeline each stage's ring carries its own layers (5 layers over 2 stages,
    schedules.partition: 2 and 3); without --cp there is no cp traffic and no "cp" in the
    ledger's axes."""
    flags = ["--n-layer", "5", "--pp", "2", "--micro-batches", "2", "--batch-size", "4"]
    sent = [c["cp"] for c in run_plan(*flags, "--cp", "2")["comm_per_stage"]]
    layers = [len(stage) for stage in schedules.partition(5, 2)]
    assert sent[0] * layers[1] == sent[1] * layers[0] and sent[0] > 0 and layers[0] != layers[1]
    r = run_plan(*flags)
    assert all(c["cp"] == 0 and "cp" not in c["bytes_by_axis"] for c in r["comm_per_stage"])


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_divides_per_token_activations_and_makes_attention_linear(cp):
    """A layer with --cp c keeps what a layer of T/c tokens keeps without its softmax, plus
    the ring's output o (N, C) and log-sum-exp (b, H, T/c): every per-token term falls by
    c. Its bytes are linear in T (the same per token at T and 2T) where the plain layer's
    grow by the softmax's b H T^2 d. Stage 0 keeps T/c positions. Full: the block input / c."""
    b, T, C, H, d = 2, 64, 48, 6, 4
    t = T // cp

    def layer(T, **kw):
        return activations.layer_bytes(b, T, C, H, store=d, **kw)
    assert layer(T, cp=cp) == layer(t, recompute="selective") + (b * t * C + b * H * t) * d
    assert layer(T, cp=cp, recompute="selective") == layer(T, cp=cp)       # the ring keeps no softmax
    assert layer(2 * T, cp=cp) == 2 * layer(T, cp=cp)                       # linear in T
    assert layer(2 * T) - 2 * layer(T) == b * H * (2 * T) ** 2 * d - 2 * b * H * T * T * d   # quadratic
    assert layer(T, cp=cp, recompute="full") * cp == layer(T, recompute="full")
    cfg = GPTConfig(vocab_size=97, block_size=T, n_layer=2, n_head=H, n_embd=C)
    first_only = activations.stage_bytes(cfg, 0, 2, 1, b, d, d, cp=cp) - layer(T, cp=cp)    # 1 layer of 2
    assert first_only == (b * t + t) * 8                                    # ids (b, T/c), positions (T/c,)


def test_cp_per_device_flops_memory_and_layout():
    """--cp 2: every device computes T/2 of the rows of every product (the same total), ZeRO
    shards over dp*cp (--cp 2 --zero 3 holds what --dp 2 --zero 3 does), world dp*cp*tp*pp."""
    base = ["--n-layer", "2", "--batch-size", "8", "--pp", "2"]
    one, two = run_plan(*base), run_plan(*base, "--cp", "2")
    assert [2 * f["total"] for f in two["flops_per_stage"]] == [f["total"] for f in one["flops_per_stage"]]
    assert two["flops"]["total"] == one["flops"]["total"]
    zero3 = run_plan(*base[:4], "--cp", "2", "--zero", "3")["memory"]
    assert {k: zero3[k] for k in ("params", "grads", "optimizer")} == \
        {k: v for k, v in run_plan(*base[:4], "--dp", "2", "--zero", "3")["memory"].items()
         if k in ("params", "grads", "optimizer")}
    lay = two["layout"]
    assert (lay["cp"], lay["cp_layout"], lay["world"]) == (2, "zigzag", 4)


BUDGET_MODEL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--batch-size", "4", "--dp", "2"]


@pytest.mark.parametrize("cp", [2, 4])
def test_seq_ceiling_fits_and_the_next_does_not(cp):
    """The ceiling T (a multiple of 2cp) fits the budget and T + 2cp does not, the block size
    taken to be T; with cp it is at least the ceiling without; and the bisection finds what
    a scan over every multiple of 2cp finds."""
    cfg, lay, _ = table.resolve(table.build_parser().parse_args([*BUDGET_MODEL, "--cp", str(cp)]))
    budget = 64 * MiB
    c = memory.ceilings(cfg, lay, budget)
    with_cp, without = c["with_cp"], c["without_cp"]
    assert with_cp["T"] >= without["T"] > 0 and (with_cp["step"], without["step"]) == (2 * cp, 2)

    def peak(T, cp):
        return memory.peak_memory(GPTConfig(**{**vars(cfg), "block_size": T}), lay.but(cp=cp))
    for s, step, cp_ in ((with_cp, 2 * cp, cp), (without, 2, 1)):
        T = s["T"]
        assert T % step == 0 and peak(T, cp_) == s["bytes_at_T"] <= budget < peak(T + step, cp_) == s["bytes_at_next"]
    scan = next(T for T in range(2 * cp, 10 ** 6, 2 * cp) if peak(T + 2 * cp, cp) > budget)
    assert scan == with_cp["T"]


def test_seq_ceiling_none_when_the_shortest_does_not_fit(capsys):
    """A budget below the model states: no T fits, with or without cp, said so."""
    code, out, _ = cli(capsys, *BUDGET_MODEL, "--cp", "2", "--memory-budget", "1MiB", "--json")
    c = json.loads(out)["seq_ceiling"]
    assert code == 0 and c["memory_budget"] == MiB
    assert c["without_cp"]["T"] is None and c["with_cp"]["T"] is None and c["with_cp"]["bytes_at_next"] > MiB
    code, out, _ = cli(capsys, *BUDGET_MODEL, "--cp", "2", "--memory-budget", "1MiB")
    assert code == 0 and "none: T = 4 already needs" in out


def test_cp_in_the_table_and_the_json(capsys):
    code, out, _ = cli(capsys, "--model", "gpt2", "--cp", "4", "--dp", "2", "--memory-budget", "16GiB")
    assert code == 0
    for text in ("dp=2 cp=4 (ring, zigzag) tp=1 pp=1 (8 devices)", "cp (ring)",
                 "d sbh/c (4 + 2/h + 17/t + a/ht)", "longest sequence T in 16.00 GiB per device",
                 "without cp", "with cp=4"):
        assert text in out, text
    code, out, _ = cli(capsys, "--model", "gpt2", "--cp", "4", "--dp", "2", "--memory-budget", "16GiB", "--json")
    r = json.loads(out)
    assert r["seq_ceiling"]["memory_budget"] == 16 * 2 ** 30 and r["seq_ceiling"]["with_cp"]["cp"] == 4
    assert r["comm"]["cp"] > 0 and r["activations_per_layer"]["setting"] is None
    assert r["activations_per_layer"]["this_run"] == activations.layer_bytes(8, 1024, 768, 12, 1, 4, 4, cp=4)
    code, out, _ = cli(capsys, "--n-layer", "2")
    assert code == 0 and "cp (ring attention)" not in out and "longest sequence" not in out


# ---------------------------------------------------------------- mixture of experts (--moe-*, --ep)

MOE_SMALL = ["--n-layer", "4", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
             "--moe-experts", "4", "--moe-top-k", "2", "--moe-every", "2"]


def moe_cfg(E=4, K=2, F=0.0, L=2, every=1, V=97, T=12, H=3, C=24):
    return GPTConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C, moe_experts=E, moe_top_k=K,
                     moe_every=every, moe_capacity_factor=F)


def test_moe_params_total_and_active_by_hand():
    """L = 4, C = 16, E = 4, K = 2, MoE blocks h.1 and h.3: each replaces one MLP (8C^2 + 5C
    parameters) by E of them and a router (C, E); a token goes through K of them."""
    C, E, K = 16, 4, 2
    dense = run_plan(*MOE_SMALL[:10])["params"]
    r = run_plan(*MOE_SMALL)
    mlp = 8 * C * C + 5 * C
    assert r["params"] == dense + 2 * ((E - 1) * mlp + C * E)
    assert r["params_active"] == dense + 2 * ((K - 1) * mlp + C * E)
    assert r["params"] == GPT(moe_cfg(E, K, L=4, every=2, V=256, T=16, H=2, C=16)).num_params()
    assert (dense, r["params"], r["params_active"]) == (17_504, 30_400, 21_888)
    assert r["moe"]["blocks"] == [1, 3] and "30,400 parameters (21,888 active per token)" in render.table(r)


def test_moe_memory_holds_e_over_ep_experts_and_all_of_them_on_tp():
    """--ep 2: a rank holds 2 of the 4 experts of each MoE block (the same count as a model
    placed by parallelize: only its experts held); --tp 2 splits attention but not the experts, which every
    tp rank holds whole (tensor_parallel.layout_of: replicated)."""
    cfg = moe_cfg(L=4, every=2)
    flags = ["--vocab-size", "97", "--block-size", "12", "--n-layer", "4", "--n-head", "3", "--n-embd", "24",
             "--moe-experts", "4", "--moe-every", "2", "--dp", "2"]
    one, ep2 = run_plan(*flags)["memory"], run_plan(*flags, "--ep", "2")["memory"]
    expert = 8 * 24 * 24 + 5 * 24
    assert one["params_local"] - ep2["params_local"] == 2 * 2 * expert          # 2 blocks x 2 experts
    placement = expert_parallel.ExpertPlacement(FakeGroup(2), 4)                     # ep rank 0: experts 0, 1
    model = GPT(cfg, parts=parts(moe=moe.MoESettings(4, 2, placement=placement), holds=placement.owns))
    assert model.num_local_params() == ep2["params_local"]
    assert ep2["params"] == 4 * ep2["params_local"] and ep2["optimizer"] == 8 * ep2["params_local"]
    tp2 = run_plan(*flags, "--tp", "3")["memory"]
    assert tp2["params_local"] == stage_model(cfg, 3, 1, 0, np.float32).num_local_params()
    experts = sum(math.prod(shape) for n, shape, _ in param_specs(cfg) if ".mlp." in n and ".experts." in n)
    assert experts == 2 * 4 * expert and tp2["params_local"] > experts        # whole on the tp rank


def moe_stage(cfg, pp, stage, dtype, recompute="none"):
    """A stage of a MoE model whose routing records its decisions (MoESettings.stats)."""
    settings = moe.MoESettings(cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity_factor, stats=[])
    inner = GPT(cfg, dtype=dtype, parts=parts(recompute, moe=settings))
    return PipelineStage(inner, stage, pp, FakeGroup(pp, stage)), settings


@pytest.mark.parametrize("dtype,s,c", [(np.float64, 8, 8), (np.float32, 4, 4), (np.float16, 2, 4),
                                       (ml_dtypes.bfloat16, 2, 4)])
@pytest.mark.parametrize("F", [0.0, 1.0, 0.5])
def test_moe_activation_bytes_equal_saved_bytes_given_the_routing(dtype, s, c, F):
    """Two stages of a model whose blocks are MoE (E = 4, K = 2), one micro-batch each: the
    planner's bytes equal Tensor.saved_bytes given the assignments each MoE layer kept (the
    counts the run made, from its decisions). Without a capacity nothing is dropped, so the
    default (no counts) is already exact; with F = 0.5 it drops and the counts differ."""
    cfg = moe_cfg(F=F, L=3, every=1)
    rng = np.random.default_rng(0)
    for st in range(2):
        m, settings = moe_stage(cfg, 2, st, dtype)
        y = rng.integers(0, cfg.vocab_size, (2, cfg.block_size))
        out = m.forward(stage_input(cfg, st, 2, dtype, rng), y if st == 1 else None, 24)
        kept = {i: int(d.kept.sum()) for i, d in settings.stats}
        routed = {i: (k, k) for i, k in kept.items()}                # one process: the experts run the kept rows
        got = out.saved_bytes()
        assert got == activations.stage_bytes(cfg, st, 2, 1, 2, s, c, routed=routed), (st, F)
        if F == 0.0:
            assert got == activations.stage_bytes(cfg, st, 2, 1, 2, s, c) and set(kept.values()) == {2 * 12 * 2}
    assert F != 0.5 or min(kept.values()) < 2 * 12 * 2                         # F = 0.5 did drop


def balanced_moe_forward(E, K, F, ep_group=None, dtype=np.float64):
    """One MoE layer (moe.moe_mlp) on N = 24 tokens whose routing is exactly balanced: token n's
    logits are 5 for expert n % E, 4 for (n + 1) % E, ... (router weight: the identity on the
    first E channels), so every expert is chosen N K / E times. -> (saved bytes, N, C)."""
    N, C = 24, 24
    cfg = moe_cfg(E, K, F, L=1, C=C)
    P = GPT(cfg, dtype=dtype).params
    w = np.zeros((C, E), dtype)
    w[:E, :E] = np.eye(E)
    P["h.0.mlp.router.weight"] = Tensor(w, requires_grad=True)
    x = np.zeros((N, C), dtype)
    for n in range(N):
        for j in range(K):
            x[n, (n + j) % E] = 5 - j
    s = moe.MoESettings(E, K, F, stats=[])
    if ep_group is not None:
        s.placement = expert_parallel.ExpertPlacement(ep_group, E)
    leaf = Tensor(x.reshape(2, 12, C), requires_grad=True)
    y = moe.moe_mlp(P, 0, leaf + 0.0, s, GPT2_FAMILY)     # + 0: an activation, as ln_2's output is
    load = s.stats[0][1].load[0]
    assert list(load) == [N * K // E] * E, load
    return y.saved_bytes(), N, C


@pytest.mark.parametrize("E,K,F", [(4, 2, 0.0), (4, 2, 0.5), (4, 2, 1.0), (4, 2, 1.25), (6, 3, 0.75), (3, 1, 0.0)])
@pytest.mark.parametrize("placed", [False, True])
def test_moe_layer_bytes_assume_balanced_routing(E, K, F, placed):
    """With routing exactly balanced the formula needs no counts: M = min(N K, E cap) kept
    (F = 0.5, 0.75 drop half, a quarter), and on the expert-parallel code path (placed: an
    ExpertPlacement over a group of one rank, whose all-to-alls are local copies but whose
    dispatch keeps the same index arrays as on P ranks) R = E cap padded rows with a capacity
    (F = 1.25: 60 rows for M = 48 kept)."""
    from mpi4py import MPI
    group = comm.Group(MPI.COMM_SELF, axis="ep") if placed else None
    got, N, C = balanced_moe_forward(E, K, F, group)
    cap = moe.capacity(N, K, E, F)
    layer = activations.MoELayer(E, K, ep=2 if placed else 1, cap=cap)   # ep > 1: the placed code path
    assert got == activations.moe_mlp_bytes(N, C, layer, 8, 8), (E, K, F, placed)
    M, R = layer.rows(N)
    assert M == (N * K if cap is None else min(N * K, E * cap)) and R == (E * cap if placed and cap else M)


def test_moe_layer_bytes_by_hand():
    """The third table of activations.py, float64, N = 24 tokens, C = 24, E = 4, K = 2, no
    capacity, balanced: M = R = 48. Router: x N C + p N E + lse, sum 2N + weights N K values, and
    the (N, E) argsort the choices are a view of; experts R C (1 + 4) stored + 8 R C computed;
    combine M C + M; ids 2M (one process) or 2M + 2R (ep)."""
    N, C, E, K, M, d = 24, 24, 4, 2, 48, 8
    router = d * (N * C + N * E + 2 * N + N * K) + 8 * N * E
    experts = d * (5 * M * C + 8 * M * C)
    combine = d * (M * C + M)
    assert activations.moe_mlp_bytes(N, C, activations.MoELayer(E, K), d, d) == router + experts + combine + 8 * 2 * M
    assert activations.moe_mlp_bytes(N, C, activations.MoELayer(E, K, ep=2), d, d) == \
        router + experts + combine + 8 * 4 * M
    dense = activations.mlp_bytes(N, N, C, 1, d, d)
    assert dense == 13 * N * C * d                      # c_fc's input, GELU's two, mlp c_proj's input
    assert activations.layer_bytes(2, 12, C, 3, store=d, moe_layer=activations.MoELayer(E, K)) == \
        activations.layer_bytes(2, 12, C, 3, store=d) - dense + router + experts + combine + 8 * 2 * M


def test_moe_flops_are_the_active_experts():
    """A MoE block's dense block is K experts' MLPs, 2 T K 8C^2 a sequence, plus the router's
    2 T C E; 3 x the matmul forward per token is train_flops_per_token (the MFU numerator, active
    parameters); the experts are replicated over tp, so a tp device does all of their FLOPs;
    6ND takes N active."""
    T, C, E, K, B = 16, 16, 4, 2, 8
    r = run_plan(*MOE_SMALL)
    f = r["flops"]["components"]
    assert f["experts"] == B * 2 * K * 2 * T * 8 * C * C and f["router"] == B * 2 * 2 * T * C * E
    assert f["dense"] == B * 2 * 2 * T * 8 * C * C                         # the two dense blocks
    cfg = moe_cfg(E, K, L=4, every=2, V=256, T=T, H=2, C=C)
    assert 3 * r["flops"]["matmul_forward"] == train_flops_per_token(cfg) * B * T == r["flops"]["per_token"] * B * T
    assert r["flops"]["six_nd"] == 6 * r["params_active"] * B * T
    tp = run_plan(*MOE_SMALL, "--tp", "2")["flops_per_stage"][0]["components"]
    assert tp["experts"] == f["experts"] and tp["router"] == f["router"] and 2 * tp["dense"] == f["dense"]
    full = run_plan(*MOE_SMALL, "--recompute", "full")["flops"]["recompute_added"]
    dense_full = recompute.added_flops(4, B, T, C, "full")
    assert full - dense_full == B * T * 2 * (2 * (K - 1) * 8 * C * C + 2 * C * E)   # 2 MoE blocks again


def test_moe_matmul_flops_equal_instrumented(matmul_counter, monkeypatch):
    """The instrumented count (fixture matmul_counter, + the router's x @ w_r, 2 N C E) of a MoE
    model's forward equals the planner's matmul FLOPs: no capacity, so every token runs K experts."""
    real = moe.Router.forward

    def router(self, x, w, *a):
        matmul_counter["flops"] += 2 * x.shape[0] * x.shape[1] * w.shape[1]
        return real(self, x, w, *a)
    monkeypatch.setattr(moe.Router, "forward", router)
    GPT(moe_cfg(L=4, every=2))(np.random.default_rng(0).integers(0, 97, (4, 12)))
    r = run_plan("--vocab-size", "97", "--block-size", "12", "--n-layer", "4", "--n-head", "3", "--n-embd", "24",
                 "--batch-size", "4", "--moe-experts", "4", "--moe-every", "2")
    assert matmul_counter["flops"] == r["flops"]["matmul_forward"]


@pytest.mark.parametrize("F,recompute", [(1.0, "none"), (1.0, "full"), (0.0, "none")])
def test_moe_all_to_all_bytes_by_hand(F, recompute):
    """dp 4, ep 2, 2 MoE blocks, M = 2 micro-batches of b = 1 sequence, n = 16 tokens, C = 16,
    fp32. With F = 1: cap = ceil(n K / E) = 8 slots, each all-to-all sends (P-1)/P of the
    (E cap, C) tensor; 4 per layer and micro-batch, 6 with --recompute full. Without a
    capacity, balanced routing: n K (P-1)/P = 16 rows each way per all-to-all, + each variable
    all-to-all's 8 (P-1) count bytes, + one equal all-to-all of the E row counts, 8 (P-1) E/P."""
    r = run_plan(*MOE_SMALL, "--dp", "4", "--ep", "2", "--micro-batches", "2", "--moe-capacity-factor", str(F),
                 "--recompute", recompute)
    P, E, K, C, n, d = 2, 4, 2, 16, 16, 4
    if F:
        cap = 8
        per_layer = (6 if recompute == "full" else 4) * (P - 1) * (E * cap // P) * C * d
    else:
        per_layer = 4 * n * K * (P - 1) // P * C * d + 4 * 8 * (P - 1) + 8 * (P - 1) * E // P
    row = r["comm"]
    assert row["ep"] == 2 * 2 * per_layer and row["bytes_by_axis"]["ep"] == row["ep"]
    assert row["bytes_per_step"] == sum(row[k] for k in ("dp", "cp", "tp", "pp", "ep", "other"))
    assert r["moe"]["all_to_all_exact"] == bool(F)
    assert all("ep" not in c["bytes_by_axis"] and c["ep"] == 0 for c in run_plan(*MOE_SMALL)["comm_per_stage"])


def test_moe_gradients_summed_over_dp_and_experts_over_their_replicas():
    """dp 4, ep 2 (one bucket each): the non-expert gradients all-reduced over the 4 dp ranks,
    the rank's experts' over their dp/ep = 2 replicas; the norm's 8 bytes over ep (not dp)."""
    r = run_plan(*MOE_SMALL, "--dp", "4", "--ep", "2", "--bucket-mb", "100")
    m = r["memory"]
    C, E = 16, 4
    experts = 2 * (E // 2) * (8 * C * C + 5 * C)                # 2 blocks x 2 experts on the rank
    others = m["params_local"] - experts
    c = r["comm"]
    assert c["dp"] == comm_bytes.all_reduce_sent(others, 4, 4) + comm_bytes.all_reduce_sent(experts, 4, 2)
    # loss over dp, norm over ep
    assert c["other"] == comm_bytes.all_reduce_sent(1, 8, 4) + comm_bytes.all_reduce_sent(1, 8, 2)
    assert r["moe"]["expert_replicas"] == 2 and r["moe"]["experts_per_rank"] == 2


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_moe_zero_shards_the_experts_over_their_replicas(stage):
    """ZeRO with --ep (dp 4, ep 2, fp32, K = 8): each block's experts are a unit of their own,
    padded for and sharded over their dp/ep = 2 replicas; the rest over the 4 dp ranks
    (formulas.formula of each part, summed). Each unit's reduce-scatters and all-gathers run on its
    own group; the gradient norm over dp (each element in exactly one shard)."""
    r = run_plan(*MOE_SMALL, "--dp", "4", "--ep", "2", "--zero", str(stage), "--micro-batches", "2")
    cfg, lay, _ = table.resolve(table.build_parser().parse_args([*MOE_SMALL, "--dp", "4", "--ep", "2"]))
    tensors = layout.device_tensors(cfg, lay, 0)
    experts = [(n, k) for n, k in tensors if expert_parallel.expert_of(n) is not None]
    others = [(n, k) for n, k in tensors if expert_parallel.expert_of(n) is None]
    assert sum(k for _, k in experts) == 2 * 2 * (8 * 16 * 16 + 5 * 16)
    plain_units, expert_units = layout.zero_units(others, 4), layout.zero_units(experts, 2)
    assert len(expert_units) == 2                                         # blocks h.1 and h.3
    want = {k: formulas.formula(stage, sum(n for _, n in others), sum(plain_units), 4, 4, 8)[k]
            + formulas.formula(stage, sum(n for _, n in experts), sum(expert_units), 2, 4, 8)[k]
            for k in ("params", "grads", "optimizer")}
    m = r["memory"]
    assert {k: m[k] for k in want} == want and m["params_padded"] == sum(plain_units) + sum(expert_units)
    rs, ag = formulas.collectives_per_step(stage, 2)
    sent = (sum(rs * comm_bytes.reduce_scatter_sent(n, 4, 4) + ag * comm_bytes.all_gather_sent(n // 4, 4, 4)
                for n in plain_units)
            + sum(rs * comm_bytes.reduce_scatter_sent(n, 4, 2) + ag * comm_bytes.all_gather_sent(n // 2, 4, 2)
                  for n in expert_units))
    assert r["comm"]["dp"] == sent
    assert r["comm"]["other"] == 2 * comm_bytes.all_reduce_sent(1, 8, 4)      # loss and norm over dp


def test_moe_blocks_have_half_the_tp_all_reduces():
    """tp 2, 4 blocks of which 2 are MoE: a MoE block runs its MLP whole on every tp rank, so it
    has attention's f and g only; the dense blocks Megatron's 4 (4 x 2 + 2 x 2 + the ends' 2
    calls on b T C, the cross-entropy's 3 on b T)."""
    r = run_plan(*MOE_SMALL, "--tp", "2")
    b, T, C = 8, 16, 16
    want = (4 * 2 + 2 * 2 + 2) * comm_bytes.all_reduce_sent(b * T * C, 4, 2) \
        + 3 * comm_bytes.all_reduce_sent(b * T, 4, 2) + comm_bytes.all_reduce_sent(1, 8, 2)
    assert r["comm"]["tp"] == want


def test_moe_in_the_table_and_the_json(capsys):
    code, out, _ = cli(capsys, "--model", "gpt2", "--moe-experts", "8", "--moe-every", "2", "--dp", "8", "--ep", "4",
                       "--moe-capacity-factor", "1.25")
    assert code == 0
    for text in ("active per token", "dp=8 tp=1 pp=1 ep=4 (8 devices)", "moe: E=8 experts, top-2, in 6 of 12 blocks",
                 "640 slots per expert", "2 experts per rank, each summed over 2 replica(s)", "ep (all-to-all)",
                 "experts", "router", "6ND (N active)", "moe E=8 K=2", "assume balanced routing",
                 "ep all-to-all bytes exact"):
        assert text in out, text
    code, out, _ = cli(capsys, "--model", "gpt2", "--moe-experts", "8", "--dp", "8", "--ep", "4", "--json")
    r = json.loads(out)
    m = r["moe"]
    assert code == 0 and m["capacity"] is None and not m["all_to_all_exact"] and m["blocks"] == list(range(12))
    assert r["model"]["moe_experts"] == 8 and r["layout"]["ep"] == 4
    assert any("depends on the routing" in n for n in r["notes"])
    code, out, _ = cli(capsys, "--n-layer", "2")
    assert code == 0 and "moe" not in out and "ep (all-to-all)" not in out and json.loads(
        cli(capsys, "--n-layer", "2", "--json")[1])["moe"] is None


# ---------------------------------------------------------------- the command line

def test_json_has_every_key(capsys):
    code, out, _ = cli(capsys, "--model", "gpt2", "--dp", "2", "--tp", "2", "--pp", "2", "--json",
                       "--device-tflops", "100")
    r = json.loads(out)
    assert code == 0
    for key in ("params", "memory", "memory_per_stage", "flops", "comm", "bubble", "step_time_s"):
        assert key in r, key
    for m in (r["memory"], *r["memory_per_stage"]):
        assert {"params", "grads", "optimizer", "model_states", "activations", "total"} <= set(m)
        assert m["model_states"] == m["params"] + m["grads"] + m["optimizer"]
        assert m["total"] == m["model_states"] + m["activations"]
    assert {"forward", "backward", "total", "six_nd"} <= set(r["flops"])
    assert {"bytes_per_step", "dp", "tp", "pp"} <= set(r["comm"]) and len(r["memory_per_stage"]) == 2
    assert r["step_time_s"] == pytest.approx(r["flops"]["per_device"]["total"] / 100e12)


def test_params_alone_gives_model_states_and_nulls(capsys):
    code, out, _ = cli(capsys, "--params", "7.5e9", "--precision", "fp16", "--dp", "8", "--zero", "3", "--json")
    r = json.loads(out)
    assert code == 0 and r["params"] == 7_500_000_000
    assert r["memory"]["model_states"] == 16 * 7_500_000_000 // 8
    assert r["flops"] is None and r["comm"] is None and r["memory"]["activations"] is None
    assert any("--params" in n for n in r["notes"])
    code, out, _ = cli(capsys, "--params", "7.5e9", "--dp", "64")        # no batch to divide
    assert code == 0 and "model states only" in out


def test_table_shows_every_section(capsys):
    code, out, _ = cli(capsys, "--model", "gpt2-large", "--dp", "2", "--tp", "4", "--pp", "4",
                       "--precision", "fp16", "--micro-batches", "4", "--device-tflops", "100")
    assert code == 0
    for text in ("774,030,080 parameters", "memory per device", "model states", "activations",
                 "FLOPs per step", "kqv projections", "6ND", "comm sent per step", "bubble 0.429", "step time"):
        assert text in out, text


@pytest.mark.parametrize("flags,setting", [([], "none"), (["--tp", "2"], "tp"), (["--tp", "2", "--sp"], "tp+sp"),
                                           (["--tp", "2", "--recompute", "selective"], "tp+selective"),
                                           (["--tp", "2", "--sp", "--recompute", "selective"], "tp+sp+selective"),
                                           (["--recompute", "full"], "full")])
def test_activations_per_layer_mark_the_runs_setting(capsys, flags, setting):
    """The table lists the six settings, minipar's beside Korthikanti's, and marks this run's
    with " <"; --json has the same under activations_per_layer, this run's bytes being its row's."""
    code, out, _ = cli(capsys, "--n-layer", "2", *flags)
    assert code == 0
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "activations per layer" in line)
    rows = {line.split()[0]: line for line in lines[start + 2:start + 2 + len(activations.SETTINGS)]}
    assert list(rows) == list(activations.SETTINGS), lines[start:start + 8]
    assert [k for k, line in rows.items() if line.endswith(" <")] == [setting], rows
    code, out, _ = cli(capsys, "--n-layer", "2", *flags, "--json")
    a = json.loads(out)["activations_per_layer"]
    assert code == 0 and a["setting"] == setting
    assert [row["setting"] for row in a["table"]] == list(activations.SETTINGS)
    assert a["this_run"] == next(row["minipar"] for row in a["table"] if row["setting"] == setting)


def test_defaults_are_the_trainers():
    from minipar.config import flags as config
    t, p = config.build_parser(), table.build_parser()
    for key in ("batch_size", "micro_batches", "schedule", "virtual_stages", "dtype", "precision", "tp", "pp",
                "zero", "cp", "ep"):
        assert p.get_default(key) == t.get_default(key), key
    r = run_plan()
    resolved = GPTConfig(vocab_size=256, **config.MODEL_DEFAULTS)          # as the trainer resolves them
    assert {k: r["model"][k] for k in config.MODEL_DEFAULTS} == {k: getattr(resolved, k) for k in config.MODEL_DEFAULTS}
    assert all(a.help for a in p._actions), [a.dest for a in p._actions if not a.help]


@pytest.mark.parametrize("flags,message", [
    (["--n-head", "3"], "--n-embd 128 is not divisible by --n-head 3"),
    (["--tp", "3"], "--n-head 4 is not divisible by --tp 3: each tensor-parallel rank needs whole heads"),
    (["--model", "gpt2-xl", "--tp", "4"], "--n-head 25 is not divisible by --tp 4: each tensor-parallel rank"),
    (["--batch-size", "6", "--dp", "2", "--micro-batches", "2"],
     "--batch-size 6 is not divisible by dp*micro-batches = 2*2 = 4"),
    (["--batch-size", "8", "--micro-batches", "3"], "--batch-size 8 is not divisible by --micro-batches 3"),
    (["--pp", "5"], "--pp 5 is more than --n-layer 4: every pipeline stage needs at least one layer"),
    (["--precision", "fp16", "--dtype", "float64"], "--precision fp16 needs --dtype float32"),
    (["--zero", "1", "--bucket-mb", "2"], "--bucket-mb is for plain data parallelism"),
    (["--params", "1e9", "--n-layer", "2"], "--params gives the size alone; drop --n-layer"),
    (["--params", "0"], "--params must be a count >= 1"),
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--tp", "2", "--sp", "--block-size", "15"],
     "--sp splits each sequence over --tp 2: --block-size 15 is not divisible by 2"),
    (["--zero", "4"], "argument --zero: invalid choice"),
    (["--virtual-stages", "0"], "--virtual-stages must be >= 1, got 0"),
    (["--pp", "2", "--virtual-stages", "2"], "--virtual-stages 2 is for --schedule interleaved, not 1f1b"),
    (["--pp", "2", "--schedule", "interleaved", "--micro-batches", "3", "--batch-size", "12"],
     "--schedule interleaved takes micro-batches in groups of --pp 2: --micro-batches 3 is not a multiple of 2"),
    (["--params", "1e9", "--pp", "2", "--schedule", "interleaved", "--micro-batches", "3", "--batch-size", "12"],
     "--micro-batches 3 is not a multiple of 2"),
    (["--pp", "2", "--micro-batches", "2", "--schedule", "interleaved", "--virtual-stages", "3"],
     "= 2 x 3 = 6 chunks: --n-layer 4 is too few"),
    (["--schedule", "zb-h3"], "argument --schedule: invalid choice"),
    (["--model", "gpt5"], "argument --model: invalid choice"),
    (["--cp", "3"], "--cp 3 cuts each sequence into 2 x cp = 6 chunks: --block-size 64 is not divisible by 6"),
    (["--cp", "2", "--block-size", "18"], "--block-size 18 is not divisible by 4"),
    (["--world", "8", "--dp", "2", "--cp", "2"], "world size 8 != dp*cp*tp*pp = 2*2*1*1 = 4"),
    (["--world", "6", "--cp", "4"], "world size 6 is not divisible by cp*tp*pp = 4*1*1 = 4"),
    (["--cp", "0"], "--cp must be >= 1, got 0"),
    (["--cp", "2", "--tp", "4", "--sp", "--block-size", "12"],
     "--sp splits each cp rank's 6 tokens (--block-size 12 / --cp 2) over --tp 4: 6 is not divisible by 4"),
    (["--cp-layout", "contiguous"], "--cp-layout contiguous places the tokens of a cp group: it needs --cp > 1"),
    (["--memory-budget", "16XB"], "--memory-budget wants a size such as 16GiB, 512MiB or 8e9 (bytes), got '16XB'"),
    # mixture of experts: config.check_moe's lines, as the trainer prints them
    (["--ep", "2"], "--ep 2 splits the experts of a mixture of experts: it needs --moe-experts > 0"),
    (["--moe-experts", "4", "--ep", "0"], "--ep must be >= 1, got 0"),
    (["--moe-top-k", "1"], "--moe-top-k is for a mixture of experts: it needs --moe-experts > 0"),
    (["--moe-experts", "4", "--moe-top-k", "5"], "--moe-top-k 5 must be between 1 and --moe-experts 4"),
    (["--moe-experts", "4", "--moe-every", "5"], "--moe-every 5 must be between 1 and --n-layer 4"),
    (["--moe-experts", "4", "--moe-capacity-factor", "-1"], "--moe-capacity-factor must be a finite number >= 0"),
    (["--moe-experts", "4", "--cp", "2"], "--moe-experts does not combine with --cp 2 yet"),
    (["--moe-experts", "4", "--tp", "2", "--sp"], "--moe-experts does not combine with --sp yet"),
    (["--moe-experts", "4", "--dp", "2", "--ep", "4"],
     "--ep 4 must divide both dp = 2 (its groups are carved out of the dp group) and --moe-experts 4"),
    (["--moe-experts", "3", "--dp", "2", "--ep", "2"], "--ep 2 must divide both dp = 2"),
    (["--world", "4", "--moe-experts", "4", "--ep", "8"], "--ep 8 must divide both dp = 4"),
    (["--params", "1e9", "--moe-experts", "4"], "--params gives the size alone; drop --moe-experts"),
    (["--params", "1e9", "--ep", "2"], "--ep 2 splits the experts of a mixture of experts"),
    (["--params", "1e9", "--memory-budget", "1GiB"], "--memory-budget searches over the sequence length"),
])
def test_bad_flags_exit_2_with_one_line(capsys, flags, message):
    code, out, err = cli(capsys, *flags)
    assert code == 2 and out == "", (code, out)
    assert err.count("\n") == 1 and err.startswith("minipar.plan: error: ") and message in err, err
