"""Lab 10, the student's side (labs/framework.py says what a lab is): the cases the child runs
on the student's formulas. Nothing here judges; lab.py does, in the grader, against minipar's
own formulas (model.param_specs, zero.formula, flops.flop_components,
model.train_flops_per_token) and figures printed in papers.

Every case is a fixed list of shapes and numbers written here. The last criterion also runs
minipar's trainer on 2 ranks, in this process, once per set of flags and ZeRO stage, and
records the bytes its summary says each rank holds beside the student's formulas for the
run's shape (the grader checks those figures against zero.formula too).

No seam: the student's functions are formulas that no trainer code path calls.
"""
import contextlib
import io

import numpy as np

from labs.results import key

# minipar's own formulas, the oracle: reached from the student's file, each raises (labs/child.py)
OWN = ["minipar.model.gpt:param_specs", "minipar.model.gpt:train_flops_per_token",
       "minipar.parallel.zero.formulas:formula", "minipar.plan.flops:flop_components", "minipar.plan.memory:model_states", "minipar.plan.layout:active_params",
       "minipar.optim.mixed_precision:optimizer_bytes_per_param"]
STATES = ("params", "grads", "optimizer")
GPT2 = dict(V=50257, T=1024, L=12, H=12, C=768)          # GPT-2 small
GPT3 = dict(V=50257, T=2048, L=96, H=96, C=12288)        # GPT-3 175B
DEFAULT = dict(V=256, T=64, L=4, H=4, C=128)             # the trainer's default model
SHAPES = [GPT2, GPT3, DEFAULT, dict(V=97, T=12, L=3, H=6, C=24), dict(V=10, T=4, L=2, H=2, C=8),
          dict(V=5, T=7, L=1, H=1, C=3),                  # one layer, one head, T > C
          dict(V=3, T=1, L=5, H=4, C=16)]                 # one token, V < C
HAND = dict(V=10, T=4, L=2, H=2, C=8)                    # the case counted by hand (lab.py)

K_CASES = [(True, 2), (False, 4), (False, 8)]            # (mixed, itemsize): fp16/bf16, float32, float64
PAPER_P, PAPER_N = 7_500_000_000, 64                     # ZeRO's figure 1
# P divisible by every N of STATE_NS (of ODD_NS: the last four); the last two so large that a float division (/ then int())
# is no longer exact: 64 x (2^53 + 1) and 3 x 2^60 + 192
STATE_PS = (834_304, 124_439_808, 7_500_000_000, 64 * (2 ** 53 + 1), 3 * 2 ** 60 + 192)
STATE_SK = ((2, 12), (4, 8), (8, 16))
STATE_NS = (1, 2, 4, 8, 64)
# group sizes that are not powers of two, with each P above they divide: a division by
# shifting log2(N) bits, exact for 1, 2, 4, 8 and 64, shows only here
ODD_NS = (3, 5, 6, 12)
EXACT_LIMIT = [(64, 2, 12, 64), (1, 8, 16, 1), (3, 2, 12, 3)]   # (P, s, K, N): one parameter per rank

SIX_ND = [(7, 11), (124_439_808, 16 * 1024), (10 ** 9, 2 * 10 ** 10), (1, 1)]
TOKENS_GPT3 = 300e9                                      # GPT-3's training tokens

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--steps", "1", "--sample", "0", "--dp", "2"]
RUNS = [   # every ZeRO unit (wte, the block, the rest) divides by 2: no padding
    ["--dtype", "float64"],
    ["--dtype", "float32", "--untied"],
    ["--precision", "fp16"],
    ["--precision", "bf16", "--n-embd", "32", "--untied"],
]
V = 256                                                  # the trainer's vocabulary: bytes


def state_cases() -> list:
    """(P, s, K, N) of model_state_bytes against formulas.formula: every P, s/K and power-of-two
    N; every N of ODD_NS that divides P; one parameter per rank."""
    return [(P, s, K, N) for P in STATE_PS for s, K in STATE_SK for N in STATE_NS] + \
           [(P, s, K, N) for P in STATE_PS for s, K in STATE_SK for N in ODD_NS if P % N == 0] + EXACT_LIMIT


def text(s: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in s.items())


# --- what the child runs ----------------------------------------------------------------------

def param_count(student, out):
    for i, s in enumerate(SHAPES):
        for tied in (True, False):
            out.case(f"param_count {text(s)} tied={tied}")
            out.put(key("params", i, tied), student.param_count(s["V"], s["T"], s["L"], s["C"], tied=tied))
    out.case("param_count(V=50257, T=1024, L=12, C=768), tied by default")
    out.put("gpt2 default", student.param_count(**{k: GPT2[k] for k in "VTLC"}))


def zero_formula(student, out):
    for mixed, itemsize in K_CASES:
        out.case(f"optimizer_bytes_per_param(mixed={mixed}, itemsize={itemsize})")
        out.put(key("K", mixed, itemsize), student.optimizer_bytes_per_param(mixed, itemsize))
    for stage in range(4):
        out.case(f"model_state_bytes(P=7.5e9, itemsize=2, K=12, zero_stage={stage}, N=64)")
        out.put(key("paper", stage), student.model_state_bytes(PAPER_P, 2, 12, stage, PAPER_N))
    for P, s, K, N in state_cases():
        for stage in range(4):
            out.case(f"model_state_bytes(P={P:,}, itemsize={s}, K={K}, zero_stage={stage}, N={N})")
            out.put(key("states", P, s, K, stage, N), student.model_state_bytes(P, s, K, stage, N))


def forward_flops(student, out):
    for s in [HAND] + SHAPES:
        out.case(f"forward_flops {text(s)}")
        out.put(key("flops", text(s)), student.forward_flops(s["T"], s["C"], s["H"], s["V"], s["L"]))


def mfu_and_six_nd(student, out):
    for s in SHAPES:
        out.case(f"forward_flops {text(s)}")
        out.put(key("flops", text(s)), student.forward_flops(s["T"], s["C"], s["H"], s["V"], s["L"]))
        out.case(f"mfu_flops_per_token {text(s)}")
        out.put(key("mfu", text(s)), student.mfu_flops_per_token(s["T"], s["C"], s["H"], s["V"], s["L"]))
    for N, D in SIX_ND:
        out.case(f"six_nd(N={N:,}, D={D:,})")
        out.put(key("6nd", N, D), student.six_nd(N, D))
    for name, s in (("GPT-2", GPT2), ("GPT-3", GPT3)):
        out.case(f"param_count {text(s)} and six_nd(P, T) and six_nd(P, 300e9)")
        P = student.param_count(**{k: s[k] for k in "VTLC"})
        out.put(key("P", name), P)
        out.put(key("6nd P T", name), student.six_nd(P, s["T"]))
        out.put(key("6nd P 300e9", name), student.six_nd(P, TOKENS_GPT3))


def trainer(student, out):
    """Each rank trains 1 step per case and records its summary's `memory` (nbytes of what it
    holds) beside the student's bytes for the run's shape and N = 2."""
    from mpi4py import MPI                      # noqa: PLC0415 - only this criterion runs the trainer

    from minipar.train import trainer as train                   # noqa: PLC0415
    train.matmul_peak_flops = lambda dtype, seconds=0.1: 1e11     # skip the start-up peak measurement
    N = MPI.COMM_WORLD.Get_size()                               # the runs' dp
    for i, flags in enumerate(RUNS):
        for stage in range(4):
            argv = TINY + flags + ["--zero", str(stage)]
            out.case(f"the trainer on {N} ranks: {' '.join(argv)}")
            args = train.build_parser().parse_args(argv)
            with contextlib.redirect_stdout(io.StringIO()):
                summary = train.run(args)
            held = summary["memory"]
            k = key("run", i, stage)
            out.put(key(k, "memory"), {n: int(held[n]) for n in STATES})
            out.put(key(k, "padding"), int(held["zero"]["padding"]) if stage else 0)
            out.put(key(k, "trainer P"), int(summary["params_count"]))
            mixed = args.precision != "fp32"
            itemsize = 2 if mixed else np.dtype(args.dtype).itemsize
            out.case(f"your formulas for {' '.join(argv)}: V={V} T={args.block_size} L={args.n_layer} "
                     f"C={args.n_embd} tied={not args.untied}, mixed={mixed}, itemsize {itemsize}, N={N}")
            P = student.param_count(V, args.block_size, args.n_layer, args.n_embd, tied=not args.untied)
            K = student.optimizer_bytes_per_param(mixed, itemsize)
            out.put(key(k, "P"), P)
            out.put(key(k, "K"), K)
            out.put(key(k, "bytes"), student.model_state_bytes(P, itemsize, K, stage, N))


def install(student):
    """No seam: lab 10's functions are formulas that no trainer code path calls."""
    raise SystemExit("lab 10 has no trainer seam: its last criterion runs minipar's trainer itself "
                     "(.venv/bin/python -m labs.grade 10)")
