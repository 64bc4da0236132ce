"""Lab 10's criteria, judged in the grader's process (labs/framework.py says what a lab is).

Seam: none. The student's functions are formulas, not a mechanism the trainer runs, so no
trainer flag puts them in minipar's place. The oracles are minipar's own, called here:
model.param_specs (the tensors a GPT is built from), mixed_precision.optimizer_bytes_per_param,
zero.formula (what ShardedAdamW.memory_report sets beside its buffers), model.train_flops_per_token
(the trainer's MFU numerator), flops.flop_components (the planner's Chinchilla count); figures
printed in papers (ZeRO's figure 1, arXiv:1910.02054; GPT-3's training compute,
arXiv:2005.14165); and, last, what a real trainer run on 2 ranks holds: the summary's
`memory`, counted from nbytes in the child (drive.trainer) and checked here against
zero.formula before the student's bytes are compared with it.
"""
import math
import numbers
import os

import numpy as np

from labs.framework import Criterion, first_difference, load_drive
from labs.results import key
from labs.scan import Allowed
from minipar.plan import flops
from minipar.optim import mixed_precision
from minipar.config.flags import build_parser
from minipar.model.gpt import GPTConfig, param_specs, train_flops_per_token
from minipar.parallel.zero import formulas as zero

TITLE = "the planner's formulas: parameters, ZeRO's model states, Chinchilla's FLOPs, 6ND"
drive = load_drive(os.path.dirname(os.path.abspath(__file__)))
# the handout gives no minipar name: every import of minipar is refused (the oracle is
# minipar's own param_specs, zero.formula, flops.flop_components, train_flops_per_token)
ALLOWED = Allowed()
STATES = drive.STATES
FLOP_KEYS = ("embeddings", "kqv_projections", "key_query_logits", "softmax", "softmax_value",
             "final_linear", "dense", "logits", "total")


def config(s: dict, tied: bool = True) -> GPTConfig:
    return GPTConfig(vocab_size=s["V"], block_size=s["T"], n_layer=s["L"], n_head=s["H"], n_embd=s["C"],
                     tie_embeddings=tied)


def oracle_params(s: dict, tied: bool = True) -> int:
    return sum(math.prod(shape) for _, shape, _ in param_specs(config(s, tied)))


def oracle_flops(s: dict) -> dict:
    c = flops.flop_components(config(s))
    return {**c, "total": sum(c.values())}


def whole(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def expect_whole(got, want: int, what: str, why: str = ""):
    assert whole(got), f"{what}: returned {got!r}, a {type(got).__name__}, not an int " \
                       f"(counts and bytes are whole numbers: // divides exactly)"
    assert got == want, f"{what}: got {got:,}, want {want:,}{why}; off by {got - want:+,}"


def expect_whole_dict(got, want: dict, keys, what: str):
    """got is a dict holding `keys`, each an int equal to want's; else AssertionError naming
    the first wrong key, the largest difference and the first bad index (in `keys` order)."""
    assert isinstance(got, dict), f"{what}: returned {got!r:.200}, a {type(got).__name__}, not a dict"
    missing = [k for k in keys if k not in got]
    assert not missing, f"{what}: no {', '.join(missing)} in the dict (its keys: {', '.join(map(str, got))})"
    for k in keys:
        assert whole(got[k]), f"{what}: {k} is {got[k]!r}, a {type(got[k]).__name__}, not an int " \
                              f"(bytes and FLOPs here are whole numbers: // divides exactly)"
    bad = [k for k in keys if int(got[k]) != int(want[k])]
    if bad:
        g = np.array([float(got[k]) for k in keys])
        w = np.array([float(want[k]) for k in keys])
        diff = first_difference(g, w, rtol=0.0) or "equal as floats, not as ints"
        raise AssertionError(f"{what}: {bad[0]} {int(got[bad[0]]):,}, want {int(want[bad[0]]):,}; {diff} "
                             f"(order {', '.join(keys)})")


def expect_close(got, want: float, what: str, rtol: float = 1e-12):
    assert real(got), f"{what}: returned {got!r}, a {type(got).__name__}, not a number"
    diff = first_difference(float(got), float(want), rtol=rtol)
    assert diff is None, f"{what}: got {float(got):.6g}, want {float(want):.6g}; {diff}"


# --- 1. parameters --------------------------------------------------------------------------

def judge_param_count(res):
    """Every tensor of model.param_specs, tied and untied, and GPT-2 small's published count."""
    for i, s in enumerate(drive.SHAPES):
        for tied in (True, False):
            want = oracle_params(s, tied)
            got = res.get(0, key("params", i, tied))
            what = f"param_count {drive.text(s)} tied={tied}"
            expect_whole(got, got, what)
            off = got - want
            assert off == 0, f"{what}: got {got:,}, want {want:,} (the sum over model.param_specs); " \
                             f"off by {off:+,} = {off / s['C']:+g} C = {off / (s['V'] * s['C']):+.3g} VC"
    expect_whole(res.get(0, "gpt2 default"), 124_439_808,
                 "param_count(V=50257, T=1024, L=12, C=768) (tied by default)", ", Hugging Face's gpt2 count")


# --- 2. model states: ZeRO's figure 1 and zero.formula ---------------------------------------

PAPER = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}       # GB (1e9 bytes), psi = 7.5e9, N_d = 64, K = 12


def judge_zero_formula(res):
    for mixed, itemsize in drive.K_CASES:
        want = mixed_precision.optimizer_bytes_per_param(mixed, itemsize)
        why = (" (ZeRO's K for mixed-precision Adam: fp32 master weights, m and v, 4 + 4 + 4)" if mixed else
               f" (AdamW's m and v in the parameters' dtype, {itemsize} bytes each, and no master copy)")
        expect_whole(res.get(0, key("K", mixed, itemsize)), want,
                     f"optimizer_bytes_per_param(mixed={mixed}, itemsize={itemsize})", why)
    for stage, printed in PAPER.items():
        m = res.get(0, key("paper", stage))
        what = f"model_state_bytes(P=7.5e9, itemsize=2, K=12, zero_stage={stage}, N=64)"
        assert isinstance(m, dict) and all(k in m and real(m[k]) for k in STATES), \
            f"{what}: returned {m!r:.200}, not a dict of {STATES} holding numbers"
        total = sum(float(m[k]) for k in STATES)
        parts = ", ".join(f"{k} {float(m[k]) / 1e9:.4g}" for k in STATES)
        assert abs(total / 1e9 - printed) <= 0.05, \
            f"{what}: {total / 1e9:.4g} GB in all ({parts}); ZeRO's figure 1 prints {printed:g} GB " \
            f"(arXiv:1910.02054, GB = 1e9 bytes)"
    for P, s, K, N in drive.state_cases():
        for stage in range(4):
            want = zero.formula(stage, P, P, N, s, K)
            expect_whole_dict(res.get(0, key("states", P, s, K, stage, N)), want, STATES,
                              f"model_state_bytes(P={P:,}, itemsize={s}, K={K}, zero_stage={stage}, N={N}) "
                              f"against zero.formula ({want['text']})")


# --- 3. FLOPs, component by component ---------------------------------------------------------

# T=4, C=8, H=2, V=10, L=2 by hand: embeddings 2*4*10*8; per layer kqv 2*3*4*64 = 1536,
# logits 2*16*8 = 256, softmax 3*2*16 = 96, softmax-value 256, final linear 2*4*64 = 512,
# dense 2*4*(256 + 256) = 4096 (x2 layers); final logits 2*4*8*10.
BY_HAND = dict(embeddings=640, kqv_projections=3072, key_query_logits=512, softmax=192, softmax_value=512,
               final_linear=1024, dense=8192, logits=640, total=14784)


def judge_forward_flops(res):
    s = drive.HAND
    expect_whole_dict(res.get(0, key("flops", drive.text(s))), BY_HAND, FLOP_KEYS,
                      f"forward_flops {drive.text(s)} (counted by hand)")
    for s in drive.SHAPES:
        expect_whole_dict(res.get(0, key("flops", drive.text(s))), oracle_flops(s), FLOP_KEYS,
                          f"forward_flops {drive.text(s)} against flops.flop_components")


# --- 4. the MFU numerator and 6ND -------------------------------------------------------------

def judge_mfu_and_six_nd(res):
    for s in drive.SHAPES:
        T, text = s["T"], drive.text(s)
        want = train_flops_per_token(config(s))
        f = res.get(0, key("flops", text))
        what = f"{text}: 3 x forward_flops' matmul part (total - embeddings - softmax)"
        assert isinstance(f, dict) and all(k in f and real(f[k]) for k in ("total", "embeddings", "softmax")), \
            f"{what}: forward_flops returned {f!r:.200}"
        matmul = f["total"] - f["embeddings"] - f["softmax"]
        expect_close(3 * matmul, want * T, f"{what} against model.train_flops_per_token x T")
        expect_close(res.get(0, key("mfu", text)), want, f"mfu_flops_per_token {text} against "
                                                         f"model.train_flops_per_token")
    for N, D in drive.SIX_ND:
        expect_close(res.get(0, key("6nd", N, D)), 6 * N * D, f"six_nd(N={N:,}, D={D:,})")
    # GPT-3 175B on 300B tokens: 3.14e23 FLOPs (arXiv:2005.14165, table D.1)
    P, got = res.get(0, key("P", "GPT-3")), res.get(0, key("6nd P 300e9", "GPT-3"))
    assert real(got) and abs(got / 1e23 - 3.14) < 0.005, \
        f"six_nd(N={P!r} (your GPT-3 param_count), D=300e9) = {got!r}; GPT-3's paper prints 3.14e23 training FLOPs"
    for name, s in (("GPT-2", drive.GPT2), ("GPT-3", drive.GPT3)):  # Chinchilla's count over 6ND, one sequence
        f, six = res.get(0, key("flops", drive.text(s))), res.get(0, key("6nd P T", name))
        ok = isinstance(f, dict) and real(f.get("total")) and real(six) and six
        ratio = 3 * f["total"] / six if ok else float("nan")
        assert 0.9 < ratio < 1.5, f"{drive.text(s)}: 3 x forward_flops total / six_nd(param_count, T) = " \
                                  f"{ratio:.4g}, outside (0.9, 1.5) (GPT-2 small 1.456, GPT-3 1.031)"


# --- 5. what the trainer holds ----------------------------------------------------------------

def judge_trainer(res):
    N = 2
    for r in range(N):
        for i, flags in enumerate(drive.RUNS):
            for stage in range(4):
                args = build_parser().parse_args(drive.TINY + flags + ["--zero", str(stage)])
                argv = " ".join(drive.TINY + flags + ["--zero", str(stage)])
                k = key("run", i, stage)
                held, P_run = res.get(r, key(k, "memory")), res.get(r, key(k, "trainer P"))
                P, K, got = res.get(r, key(k, "P")), res.get(r, key(k, "K")), res.get(r, key(k, "bytes"))
                mixed = args.precision != "fp32"
                itemsize = 2 if mixed else np.dtype(args.dtype).itemsize
                # the trainer's own figures, checked against minipar's formula first
                assert res.get(r, key(k, "padding")) == 0, f"grader: {argv} pads ZeRO units"
                formula = zero.formula(stage, P_run, P_run, N, itemsize,
                                       mixed_precision.optimizer_bytes_per_param(mixed, itemsize))
                assert isinstance(held, dict) and all(held.get(n) == formula[n] for n in STATES), \
                    f"grader: rank {r}, {argv}: the trainer's summary says {held!r:.200}, zero.formula " \
                    f"{ {n: formula[n] for n in STATES} }"
                what = (f"rank {r}: dp={N} --zero {stage} {' '.join(flags)} (V={drive.V}, itemsize {itemsize}; "
                        f"the trainer's P={P_run:,}, yours {P!r}; your K={K!r}): model_state_bytes against the "
                        f"summary's memory")
                expect_whole_dict(got, held, STATES, what)


CRITERIA = [
    Criterion("param_count against param_specs", run="param_count", judge=judge_param_count, timeout=30,
              uses=("param_count",),
              hint="every tensor of minipar.model.gpt.param_specs counts, biases and LayerNorms included; "
                   "with tied embeddings the head is wte itself"),
    Criterion("ZeRO figure 1 and zero.formula", run="zero_formula", judge=judge_zero_formula, timeout=30,
              uses=("optimizer_bytes_per_param", "model_state_bytes"),
              hint="stage 1 divides the optimizer by N, stage 2 also the gradients, stage 3 also the "
                   "parameters (minipar.parallel.zero.formulas.formula), with // on ints; "
                   "K as minipar.optim.mixed_precision.optimizer_bytes_per_param"),
    Criterion("forward_flops by component", run="forward_flops", judge=judge_forward_flops, timeout=30,
              uses=("forward_flops",),
              hint="Chinchilla's appendix F table: attention's two T x T products cost 2TTC each; "
                   "the final logits 2TCV come once, after the last layer"),
    Criterion("MFU numerator and 6ND", run="mfu_and_six_nd", judge=judge_mfu_and_six_nd, timeout=30,
              uses=("forward_flops", "mfu_flops_per_token", "six_nd", "param_count"),
              hint="minipar.model.gpt.train_flops_per_token counts matmuls only (no embedding lookup, no "
                   "softmax), forward + backward = 3 x forward"),
    Criterion("bytes the trainer holds, dp 2", ranks=2, run="trainer", judge=judge_trainer, timeout=60,
              uses=("param_count", "optimizer_bytes_per_param", "model_state_bytes"),
              hint=".venv/bin/python -m minipar.train --dtype float64 prints 'memory per rank' with its formula; "
                   "AdamW's m and v have the parameters' dtype (minipar.optim.mixed_precision.optimizer_bytes_per_param)"),
]
