"""Lab 10's criteria (labs/framework.py says what a lab is).

Seam: none. The student's functions are formulas, not a mechanism the trainer runs, so no
trainer flag puts them in minipar's place and there is no --verify run. The oracles are
minipar's own: model.param_specs (the tensors a GPT is built from), zero.formula (what
Zero.memory_report sets beside its buffers), model.train_flops_per_token (the trainer's MFU
numerator), plan.flop_components (the planner's Chinchilla count); figures printed in
papers (ZeRO's figure 1, arXiv:1910.02054; GPT-3's training compute, arXiv:2005.14165); and,
last, what a real trainer run on 2 ranks holds: the summary's `memory`, counted from nbytes.
"""
import contextlib
import io
import math
import numbers

import numpy as np

from labs.framework import Criterion, first_difference
from minipar import plan
from minipar.model import GPTConfig, param_specs, train_flops_per_token
from minipar.parallel import zero

TITLE = "the planner's formulas: parameters, ZeRO's model states, Chinchilla's FLOPs, 6ND"
STATES = ("params", "grads", "optimizer")
FLOP_KEYS = ("embeddings", "kqv_projections", "key_query_logits", "softmax", "softmax_value",
             "final_linear", "dense", "logits", "total")
GPT2 = dict(V=50257, T=1024, L=12, H=12, C=768)          # GPT-2 small
GPT3 = dict(V=50257, T=2048, L=96, H=96, C=12288)        # GPT-3 175B
DEFAULT = dict(V=256, T=64, L=4, H=4, C=128)             # the trainer's default model
SHAPES = [GPT2, GPT3, DEFAULT, dict(V=97, T=12, L=3, H=6, C=24), dict(V=10, T=4, L=2, H=2, C=8)]


def config(s: dict, tied: bool = True) -> GPTConfig:
    return GPTConfig(vocab_size=s["V"], block_size=s["T"], n_layer=s["L"], n_head=s["H"], n_embd=s["C"],
                     tie_embeddings=tied)


def shape_text(s: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in s.items())


def whole(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def expect_whole_dict(got, want: dict, keys, what: str):
    """got is a dict holding `keys`, each an int equal to want's; else AssertionError naming
    the first wrong key, the largest difference and the first bad index (in `keys` order)."""
    assert isinstance(got, dict), f"{what}: returned {type(got).__name__}, not a dict"
    missing = [k for k in keys if k not in got]
    assert not missing, f"{what}: no {', '.join(missing)} in the dict (its keys: {', '.join(map(str, got))})"
    for k in keys:
        assert whole(got[k]), f"{what}: {k} is {got[k]!r}, a {type(got[k]).__name__}, not an int " \
                              f"(bytes and FLOPs here are whole numbers: // divides exactly)"
    g = np.array([float(got[k]) for k in keys])
    w = np.array([float(want[k]) for k in keys])
    diff = first_difference(g, w, rtol=0.0)
    if diff is not None:
        bad = next(k for k in keys if got[k] != want[k])
        raise AssertionError(f"{what}: {bad} {got[bad]:,}, want {want[bad]:,}; {diff} (order {', '.join(keys)})")


def expect_close(got, want: float, what: str, rtol: float = 1e-12):
    assert isinstance(got, numbers.Real) and not isinstance(got, bool), \
        f"{what}: returned {got!r}, a {type(got).__name__}, not a number"
    diff = first_difference(float(got), float(want), rtol=rtol)
    assert diff is None, f"{what}: got {float(got):.6g}, want {float(want):.6g}; {diff}"


# --- 1. parameters --------------------------------------------------------------------------

def check_param_count(student):
    """Every tensor of model.param_specs, tied and untied, and GPT-2 small's published count."""
    for s in SHAPES:
        for tied in (True, False):
            want = sum(math.prod(shape) for _, shape, _ in param_specs(config(s, tied)))
            got = student.param_count(s["V"], s["T"], s["L"], s["C"], tied=tied)
            what = f"param_count {shape_text(s)} tied={tied}"
            assert whole(got), f"{what}: returned {got!r}, a {type(got).__name__}, not an int"
            off = got - want
            assert off == 0, f"{what}: got {got:,}, want {want:,} (the sum over model.param_specs); " \
                             f"off by {off:+,} = {off / s['C']:+g} C = {off / (s['V'] * s['C']):+.3g} VC"
    got = student.param_count(**{k: GPT2[k] for k in "VTLC"})
    assert got == 124_439_808, f"param_count GPT-2 small: {got:,}, Hugging Face's gpt2 has 124,439,808"


# --- 2. model states: ZeRO's figure 1 and zero.formula ---------------------------------------

PAPER = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}       # GB (1e9 bytes), psi = 7.5e9, N_d = 64, K = 12


def check_zero_formula(student):
    K = student.optimizer_bytes_per_param(True, 2)
    assert K == 12, f"optimizer_bytes_per_param(mixed=True, itemsize=2) = {K!r}; ZeRO's K for mixed-precision " \
                    f"Adam is 12 (fp32 master weights, m and v: 4 + 4 + 4)"
    psi, N = 7_500_000_000, 64
    for stage, printed in PAPER.items():
        m = student.model_state_bytes(psi, 2, K, stage, N)
        what = f"model_state_bytes(P=7.5e9, itemsize=2, K=12, zero_stage={stage}, N=64)"
        assert isinstance(m, dict) and all(k in m for k in STATES), f"{what}: returned {m!r}, not a dict of {STATES}"
        total = sum(m[k] for k in STATES)
        parts = ", ".join(f"{k} {m[k] / 1e9:.4g}" for k in STATES)
        assert abs(total / 1e9 - printed) <= 0.05, \
            f"{what}: {total / 1e9:.4g} GB in all ({parts}); ZeRO's figure 1 prints {printed:g} GB " \
            f"(arXiv:1910.02054, GB = 1e9 bytes)"
    for P in (834_304, 124_439_808, 7_500_000_000):                 # divisible by every N below
        for itemsize, K in ((2, 12), (4, 8), (8, 16)):
            for N in (1, 2, 4, 8, 64):
                for stage in (0, 1, 2, 3):
                    want = zero.formula(stage, P, P, N, itemsize, K)
                    got = student.model_state_bytes(P, itemsize, K, stage, N)
                    expect_whole_dict(got, want, STATES, f"model_state_bytes(P={P:,}, itemsize={itemsize}, K={K}, "
                                                         f"zero_stage={stage}, N={N}) against zero.formula "
                                                         f"({want['text']})")


# --- 3. FLOPs, component by component ---------------------------------------------------------

# T=4, C=8, H=2, V=10, L=2 by hand: embeddings 2*4*10*8; per layer kqv 2*3*4*64 = 1536,
# logits 2*16*8 = 256, softmax 3*2*16 = 96, softmax-value 256, final linear 2*4*64 = 512,
# dense 2*4*(256 + 256) = 4096 (x2 layers); final logits 2*4*8*10.
BY_HAND = dict(embeddings=640, kqv_projections=3072, key_query_logits=512, softmax=192, softmax_value=512,
               final_linear=1024, dense=8192, logits=640, total=14784)


def check_forward_flops(student):
    s = dict(V=10, T=4, L=2, H=2, C=8)
    got = student.forward_flops(s["T"], s["C"], s["H"], s["V"], s["L"])
    expect_whole_dict(got, BY_HAND, FLOP_KEYS, f"forward_flops {shape_text(s)} (counted by hand)")
    for s in SHAPES:
        c = plan.flop_components(config(s))
        want = {**c, "total": sum(c.values())}
        got = student.forward_flops(s["T"], s["C"], s["H"], s["V"], s["L"])
        expect_whole_dict(got, want, FLOP_KEYS, f"forward_flops {shape_text(s)} against plan.flop_components")


# --- 4. the MFU numerator and 6ND -------------------------------------------------------------

def check_mfu_and_six_nd(student):
    for s in SHAPES:
        T = s["T"]
        want = train_flops_per_token(config(s))
        f = student.forward_flops(T, s["C"], s["H"], s["V"], s["L"])
        matmul = f["total"] - f["embeddings"] - f["softmax"]
        expect_close(3 * matmul, want * T, f"{shape_text(s)}: 3 x forward_flops' matmul part (total - embeddings "
                                          f"- softmax) against model.train_flops_per_token x T")
        got = student.mfu_flops_per_token(T, s["C"], s["H"], s["V"], s["L"])
        expect_close(got, want, f"mfu_flops_per_token {shape_text(s)} against model.train_flops_per_token")
    for N, D in ((7, 11), (124_439_808, 16 * 1024), (10**9, 2 * 10**10)):
        expect_close(student.six_nd(N, D), 6 * N * D, f"six_nd(N={N:,}, D={D:,})")
    # GPT-3 175B on 300B tokens: 3.14e23 FLOPs (arXiv:2005.14165, table D.1)
    P = student.param_count(**{k: GPT3[k] for k in "VTLC"})
    got = student.six_nd(P, 300e9)
    assert abs(got / 1e23 - 3.14) < 0.005, f"six_nd(N={P:,} (GPT-3), D=300e9) = {got:.4g}; " \
                                           f"GPT-3's paper prints 3.14e23 training FLOPs"
    for s in (GPT2, GPT3):                  # Chinchilla's count over 6ND, for one sequence of T tokens
        P = student.param_count(**{k: s[k] for k in "VTLC"})
        ratio = 3 * student.forward_flops(s["T"], s["C"], s["H"], s["V"], s["L"])["total"] / student.six_nd(P, s["T"])
        assert 0.9 < ratio < 1.5, f"{shape_text(s)}: 3 x forward_flops total / six_nd(P, T) = {ratio:.4g}, " \
                                  f"outside (0.9, 1.5) (GPT-2 small 1.456, GPT-3 1.031)"


# --- 5. what the trainer holds ----------------------------------------------------------------

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--steps", "1", "--sample", "0", "--dp", "2"]
RUNS = [   # every ZeRO unit (wte, the block, the rest) divides by 2: no padding
    ["--dtype", "float64"],
    ["--dtype", "float32", "--untied"],
    ["--precision", "fp16"],
    ["--precision", "bf16", "--n-embd", "32", "--untied"],
]
V = 256                                                  # the trainer's vocabulary: bytes


def check_trainer(student):
    """Each rank trains 1 step per case and compares its summary's `memory` (nbytes of what
    it holds) with the student's bytes for N = 2."""
    from mpi4py import MPI                      # noqa: PLC0415 - only this criterion runs the trainer

    from minipar import train                   # noqa: PLC0415
    train.matmul_peak_flops = lambda dtype, seconds=0.1: 1e11     # skip the start-up peak measurement
    N = MPI.COMM_WORLD.Get_size()                               # the runs' dp
    for flags in RUNS:
        for stage in (0, 1, 2, 3):
            argv = TINY + flags + ["--zero", str(stage)]
            args = train.build_parser().parse_args(argv)
            with contextlib.redirect_stdout(io.StringIO()):
                summary = train.run(args)
            held = summary["memory"]
            if stage:
                assert held["zero"]["padding"] == 0, f"grader: {argv} pads ZeRO units ({held['zero']})"
            mixed = args.precision != "fp32"
            itemsize = 2 if mixed else np.dtype(args.dtype).itemsize
            P = student.param_count(V, args.block_size, args.n_layer, args.n_embd, tied=not args.untied)
            K = student.optimizer_bytes_per_param(mixed, itemsize)
            got = student.model_state_bytes(P, itemsize, K, stage, N)
            what = (f"dp={N} --zero {stage} {' '.join(flags)} (V={V} T={args.block_size} L={args.n_layer} "
                    f"C={args.n_embd}, itemsize {itemsize}; the trainer's P={summary['params_count']:,}, yours {P:,}; "
                    f"your K={K}): model_state_bytes against the summary's memory")
            expect_whole_dict(got, held, STATES, what)


def install(student):
    """No seam: lab 10's functions are formulas that no trainer code path calls."""
    raise SystemExit("lab 10 has no trainer seam: its criteria run minipar's trainer themselves "
                     "(python -m labs.grade 10)")


CRITERIA = [
    Criterion("param_count against param_specs", check=check_param_count, timeout=30,
              hint="every tensor of minipar.model.param_specs counts, biases and LayerNorms included; "
                   "with tied embeddings the head is wte itself"),
    Criterion("ZeRO figure 1 and zero.formula", check=check_zero_formula, timeout=30,
              hint="stage 1 divides the optimizer by N, stage 2 also the gradients, stage 3 also the "
                   "parameters (minipar.parallel.zero.formula); K as minipar.precision.optimizer_bytes_per_param"),
    Criterion("forward_flops by component", check=check_forward_flops, timeout=30,
              hint="Chinchilla's appendix F table: attention's two T x T products cost 2TTC each; "
                   "the final logits 2TCV come once, after the last layer"),
    Criterion("MFU numerator and 6ND", check=check_mfu_and_six_nd, timeout=30,
              hint="minipar.model.train_flops_per_token counts matmuls only (no embedding lookup, no "
                   "softmax), forward + backward = 3 x forward"),
    Criterion("bytes the trainer holds, dp 2", ranks=2, check=check_trainer, timeout=60,
              hint="python -m minipar.train --dtype float64 prints 'memory per rank' with its formula; "
                   "AdamW's m and v have the parameters' dtype (minipar.precision.optimizer_bytes_per_param)"),
]
