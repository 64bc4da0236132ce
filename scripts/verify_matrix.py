"""Every layout against the single-process run: the whole dp x tp x pp x ZeRO x schedule x
precision matrix through the CLI, each run with --verify.

    python scripts/verify_matrix.py                  # 4 ranks, then 8 (dp2 x tp2 x pp2): 256 runs,
                                                     # about 15 min on 2 cores
    python scripts/verify_matrix.py --ranks 4 --precisions fp32
    python scripts/verify_matrix.py --match=--cp     # the context-parallel runs only

For 4 ranks every factorisation dp*tp*pp = 4, for 8 ranks dp2 x tp2 x pp2; with each ZeRO
stage the layout allows (0-3 without a pipeline, 0-2 with one), each schedule when pp > 1,
each precision, and --recompute full or selective beside each float64 1F1B (or pipeline-free)
layout. Context parallelism (context_parallel): cp 2 and 4, zig-zag and contiguous, alone
and with dp (each ZeRO stage), tp, pp (four schedules), micro-batches, recomputation and
fp16/bf16, and on 8 ranks dp x cp x tp, cp x tp x pp, dp x cp x pp. A mixture of experts
(experts): ep 1, 2, 4, with and without dropping, with pp, recomputation, ZeRO, fp16/bf16.
Sequence parallelism: beside each float64 layout with tp > 1, the same with --sp
(block size 16 divides over tp 2 and 4), with --recompute by ZeRO stage (SP_RECOMPUTE: none,
selective, full, selective) so that TP+SP and TP+SP+recompute are both covered; and one fp16
and one bf16 --sp run with pp > 1. The schedules past 1F1B (past_1f1b): beside each
pipelined 1F1B layout in float64 (every ZeRO stage) and in fp16/bf16 (ZeRO 0), interleaved
with 2 virtual stages, ZB-H1 and ZB-H2. fp32 runs in float64 and must agree to 1e-10 relative,
losses and every parameter tensor; fp16/bf16 must agree on the losses to 5e-2, as --verify
judges them. The Llama family (llama): 1, 2 and 4 key/value heads across dp, ZeRO, tp (split and
shared heads), sp, pp, cp, recomputation, tied embeddings, fp16/bf16 and its mixture of experts.
Sharding at scale (sharding): hybrid shard groups, ZeRO-3's prefetch and reshard-after-forward.
The model is tiny (2 layers, or 4 with pp = 4; C = 16; 3 steps; gradient clipping on) so that the matrix runs in minutes. Every run also writes a --trace, which must
pass minipar.show.traceview.audit (a valid trace; a process row per rank; comm events equal to
each rank's ledger; forwards and backwards in the schedule's order). Prints one row per run
and the count of failures, and the largest relative differences with and without --sp;
exit 1 if any fails. (tests/test_layouts.py runs a representative 16 of these in
`make test`; tests/test_trace.py audits traces on 1, 4 and 8 ranks.)
"""
import argparse
import itertools
import os
import subprocess
import sys
import tempfile
import time

from minipar.show import traceview

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
TINY = ["--n-head", "4", "--n-embd", "16", "--block-size", "16", "--batch-size", "8", "--steps", "3",
        "--grad-clip", "1", "--sample", "0"]
SP_RECOMPUTE = ("none", "selective", "full", "selective")    # --sp runs' --recompute, by ZeRO stage


def layouts(n):
    if n == 8:
        return [(2, 2, 2)]
    return [(dp, tp, n // (dp * tp)) for dp in (1, 2, 4) for tp in (1, 2, 4) if n % (dp * tp) == 0]


def cases(ranks, precisions):
    mixed_sp = set()                                         # precisions that had their fp16/bf16 --sp run
    for n in ranks:
        for dp, tp, pp in layouts(n):
            for zero, schedule, precision in itertools.product(
                    (0, 1, 2, 3) if pp == 1 else (0, 1, 2),
                    ("1f1b", "gpipe", "naive") if pp > 1 else ("-",), precisions):
                flags = ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--zero", str(zero),
                         "--n-layer", str(max(2, pp))]
                if pp > 1:
                    flags += ["--schedule", schedule, "--micro-batches", "2"]
                flags += ["--dtype", "float64"] if precision == "fp32" else ["--precision", precision]
                yield n, flags
                if precision == "fp32" and schedule in ("1f1b", "-"):    # and with recomputation
                    yield n, flags + ["--recompute", "full" if zero % 2 == 0 else "selective"]
                if tp > 1 and precision == "fp32":                        # and with sequence parallelism
                    recompute = SP_RECOMPUTE[zero]
                    yield n, flags + ["--sp"] + (["--recompute", recompute] if recompute != "none" else [])
                if tp > 1 and pp > 1 and precision != "fp32" and precision not in mixed_sp:
                    mixed_sp.add(precision)
                    yield n, flags + ["--sp"]
                if pp > 1 and schedule == "1f1b" and (precision == "fp32" or zero == 0):
                    yield from past_1f1b(n, dp, tp, pp, zero, precision)
        yield from context_parallel(n, precisions)
        yield from cp_impls(n, precisions)
        yield from experts(n, precisions)
        yield from llama(n, precisions)
        yield from sharding(n, precisions)


def experts(n, precisions):
    """A mixture of experts (E 4, top-2), with and without dropping (capacity factor 1.0):
    ep 1, 2, 4 over dp 4; ep 2 with pp 2 (1F1B, ZB-H1), with tp 2 and with full recomputation; ZeRO
    1, 2, 3 with and without ep (experts sharded over their replicas); fp16/bf16 at ep 2. 8 ranks:
    dp 4 x ep 2 x pp 2."""
    moe = ["--moe-experts", "4", "--moe-top-k", "2"]
    f64 = ["--dtype", "float64"]
    drops = ([], ["--moe-capacity-factor", "1.0"])
    if n == 4:
        for drop in drops:
            for ep in ("1", "2", "4"):
                yield n, moe + drop + ["--dp", "4", "--ep", ep] + f64
            for schedule in ("1f1b", "zb-h1"):
                yield n, moe + drop + ["--dp", "2", "--ep", "2", "--pp", "2", "--micro-batches", "2",
                                       "--schedule", schedule] + f64
            yield n, moe + drop + ["--dp", "4", "--ep", "2", "--micro-batches", "2", "--recompute", "full"] + f64
            yield n, moe + drop + ["--dp", "2", "--ep", "2", "--tp", "2"] + f64
        for zero in ("1", "2", "3"):
            yield n, moe + ["--dp", "4", "--zero", zero, "--moe-capacity-factor", "1.25"] + f64
            yield n, moe + ["--dp", "4", "--ep", "2", "--zero", zero] + f64
        yield n, moe + ["--dp", "2", "--ep", "2", "--pp", "2", "--zero", "1", "--micro-batches", "2"] + f64
        for precision in set(precisions) - {"fp32"}:
            yield n, moe + ["--dp", "4", "--ep", "2", "--precision", precision]
    else:
        for drop in drops:
            yield n, moe + drop + ["--dp", "4", "--ep", "2", "--pp", "2", "--micro-batches", "2"] + f64


def context_parallel(n, precisions):
    """--cp at the block size (16 tokens: 2 per chunk at cp 4), zig-zag and contiguous: alone,
    with dp (every ZeRO stage), tp (heads split), pp (1F1B, GPipe, ZB-H1, interleaved),
    micro-batches and recomputation; on 8 ranks with two other axes at once."""
    f64 = ["--dtype", "float64"]
    if n == 4:
        runs = [["--cp", "4"], ["--cp", "4", "--cp-layout", "contiguous"],
                ["--cp", "2", "--tp", "2"], ["--cp", "2", "--tp", "2", "--cp-layout", "contiguous"],
                ["--cp", "2", "--tp", "2", "--recompute", "full"],
                ["--cp", "2", "--dp", "2", "--micro-batches", "2", "--recompute", "selective"]]
        runs += [["--cp", "2", "--dp", "2", "--zero", str(z)] + (["--cp-layout", "contiguous"] if z % 2 else [])
                 for z in (0, 1, 2, 3)]
        runs += [["--cp", "2", "--pp", "2", "--schedule", s, "--micro-batches", "2"] for s in ("1f1b", "gpipe", "zb-h1")]
        runs += [["--cp", "2", "--pp", "2", "--n-layer", "4", "--schedule", "interleaved", "--virtual-stages", "2",
                  "--micro-batches", "2"]]
        for run in runs:
            yield n, run + f64
        for precision in set(precisions) - {"fp32"}:
            yield n, ["--cp", "2", "--dp", "2", "--zero", "1", "--precision", precision]
            yield n, ["--cp", "2", "--tp", "2", "--precision", precision]
    else:
        for run in (["--dp", "2", "--cp", "2", "--tp", "2", "--zero", "1"],
                    ["--cp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2"],
                    ["--dp", "2", "--cp", "2", "--pp", "2", "--schedule", "zb-h1", "--micro-batches", "2"],
                    ["--cp", "4", "--tp", "2", "--cp-layout", "contiguous"]):
            yield n, run + f64


def cp_impls(n, precisions):
    """--cp-impl ulysses and allgather beside the ring: alone (cp 2 and 4, both layouts), with
    dp and every ZeRO stage, tp (heads split by tp first), pp (every schedule), micro-batches,
    recomputation and fp16/bf16; Llama's grouped-query and multi-query attention
    (Ulysses with the key/value heads copied when cp > Hkv/tp). 8 ranks: dp x cp x tp. hybrid
    (Ulysses over 2 ranks, the ring over the pairs) at cp 4, with recomputation, ZeRO-3,
    micro-batches, multi-query attention and fp16/bf16; on 8 ranks with tp and with dp. --sp with
    --cp (the tp ranks split each cp rank's tokens) for every impl, GPT-2 and Llama; hybrid with
    pp on 8 ranks."""
    f64 = ["--dtype", "float64"]
    llama = ["--arch", "llama", "--ffn-hidden", "24", "--rope-theta", "500"]
    for impl in ("ulysses", "allgather"):
        cp = ["--cp-impl", impl]
        if n == 4:
            runs = [["--cp", "4"], ["--cp", "4", "--cp-layout", "contiguous"],
                    ["--cp", "2", "--tp", "2", "--recompute", "full"],
                    ["--cp", "2", "--dp", "2", "--micro-batches", "2", "--recompute", "selective"]]
            runs += [["--cp", "2", "--dp", "2", "--zero", str(z)] for z in (1, 2, 3)]
            runs += [["--cp", "2", "--pp", "2", "--schedule", s, "--micro-batches", "2"]
                     for s in ("naive", "gpipe", "1f1b", "zb-h1", "zb-h2")]
            runs += [["--cp", "2", "--pp", "2", "--n-layer", "4", "--schedule", "interleaved", "--virtual-stages",
                      "2", "--micro-batches", "2"]]
            runs += [llama + ["--n-kv-head", "2", "--cp", "4"], llama + ["--n-kv-head", "1", "--cp", "2", "--tp", "2"],
                     llama + ["--n-kv-head", "2", "--cp", "2", "--dp", "2", "--zero", "3"]]
            for run in runs:
                yield n, run + cp + f64
            for precision in set(precisions) - {"fp32"}:
                yield n, ["--cp", "2", "--tp", "2", "--precision", precision] + cp
        else:
            yield n, ["--dp", "2", "--cp", "2", "--tp", "2", "--zero", "1"] + cp + f64
    # --sp splits each cp rank's tokens over tp: every impl, GPT-2's learned positions and Llama's
    if n == 4:
        for impl in ("ring", "ulysses", "allgather", "hybrid"):
            yield n, ["--tp", "2", "--sp", "--cp", "2", "--n-head", "4", "--cp-impl", impl] + f64
        yield n, llama + ["--n-head", "4", "--n-kv-head", "1", "--tp", "2", "--sp", "--cp", "2", "--cp-impl",
                          "ulysses", "--recompute", "selective"] + f64
        for precision in set(precisions) - {"fp32"}:
            yield n, ["--tp", "2", "--sp", "--cp", "2", "--n-head", "4", "--cp-impl", "allgather",
                      "--precision", precision]
    else:
        yield n, ["--dp", "2", "--tp", "2", "--sp", "--cp", "2", "--n-head", "4", "--cp-impl", "ulysses",
                  "--zero", "1"] + f64
    hybrid = ["--cp-impl", "hybrid", "--cp-ulysses", "2"]
    if n == 4:
        for run in (["--cp", "4"], ["--cp", "4", "--cp-layout", "contiguous", "--recompute", "full"],
                    ["--cp", "4", "--micro-batches", "2", "--zero", "3"],
                    llama + ["--n-kv-head", "1", "--cp", "4"]):
            yield n, run + hybrid + f64
        for precision in set(precisions) - {"fp32"}:
            yield n, ["--cp", "4", "--precision", precision] + hybrid
    else:
        yield n, ["--cp", "4", "--tp", "2", "--n-head", "8", "--n-embd", "32"] + hybrid + f64
        yield n, ["--dp", "2", "--cp", "4", "--pp", "1"] + hybrid + f64
        yield n, ["--cp", "4", "--pp", "2", "--micro-batches", "2", "--schedule", "zb-h1"] + hybrid + f64


def llama(n, precisions):
    """--arch llama (H 4, F 24, theta 500) with 1, 2 and 4 key/value heads: dp with every ZeRO
    stage; tp 2 and 4 (key/value heads split, or shared by 2 and 4 ranks), with --sp and
    recomputation; pipelines (1F1B, GPipe, interleaved, ZB-H1, ZB-H2) with tp and sp; the ring
    (cp 2 and 4, zig-zag and contiguous) alone and with dp, ZeRO, tp and pp; tied embeddings;
    fp16/bf16; a Mixtral-style mixture of experts (its pooled loss; ep 1, 2, 4; DeepSeekMoE's
    shared and fine-grained experts; ZeRO; tp; capacity; top-1; pipelines, the pooled counts
    crossing the stages). 8 ranks: dp x tp x pp and dp x cp x tp."""
    base = ["--arch", "llama", "--ffn-hidden", "24", "--rope-theta", "500"]
    f64 = ["--dtype", "float64"]

    def kv(k):
        return base + ["--n-kv-head", str(k)]

    if n == 4:
        for zero in ("0", "1", "2", "3"):
            yield n, kv(2) + ["--dp", "4", "--zero", zero] + f64
        for k in (1, 2, 4):
            yield n, kv(k) + ["--dp", "2", "--tp", "2", "--zero", str(k % 4)] + f64
            yield n, kv(k) + ["--tp", "4"] + f64
            yield n, kv(k) + ["--tp", "4", "--sp", "--recompute", "selective"] + f64
            yield n, kv(k) + ["--dp", "2", "--tp", "2", "--sp", "--recompute", "full"] + f64
        for schedule in ("1f1b", "gpipe", "zb-h1", "zb-h2"):
            yield n, kv(1) + ["--tp", "2", "--pp", "2", "--schedule", schedule, "--micro-batches", "2"] + f64
        yield n, kv(2) + ["--tp", "2", "--sp", "--pp", "2", "--n-layer", "4", "--schedule", "interleaved",
                          "--virtual-stages", "2", "--micro-batches", "2"] + f64
        yield n, kv(2) + ["--pp", "4", "--n-layer", "4", "--micro-batches", "4", "--tied"] + f64
        yield n, kv(1) + ["--dp", "2", "--pp", "2", "--zero", "2", "--micro-batches", "2", "--tied"] + f64
        yield n, kv(2) + ["--cp", "4"] + f64
        yield n, kv(1) + ["--cp", "4", "--cp-layout", "contiguous"] + f64
        for zero in ("1", "3"):
            yield n, kv(2) + ["--cp", "2", "--dp", "2", "--zero", zero] + f64
        yield n, kv(1) + ["--cp", "2", "--tp", "2", "--recompute", "full"] + f64
        yield n, kv(4) + ["--cp", "2", "--tp", "2"] + f64
        yield n, kv(2) + ["--cp", "2", "--pp", "2", "--schedule", "zb-h1", "--micro-batches", "2"] + f64
        mixtral = kv(2) + ["--moe-experts", "4", "--moe-top-k", "2"]
        deepseek = mixtral + ["--moe-shared-experts", "1", "--moe-ffn-hidden", "12"]
        for ep in ("1", "2", "4"):
            yield n, mixtral + ["--dp", "4", "--ep", ep] + f64
        for zero in ("1", "3"):
            yield n, deepseek + ["--dp", "4", "--ep", "2", "--zero", zero] + f64
        yield n, deepseek + ["--dp", "2", "--ep", "2", "--tp", "2", "--recompute", "full"] + f64
        yield n, mixtral + ["--dp", "4", "--ep", "2", "--moe-capacity-factor", "1.0", "--micro-batches", "2"] + f64
        yield n, mixtral + ["--moe-top-k", "1", "--dp", "4", "--ep", "2"] + f64
        for schedule in ("1f1b", "zb-h1", "zb-h2"):
            yield n, mixtral + ["--dp", "2", "--ep", "2", "--pp", "2", "--n-layer", "2", "--micro-batches", "2",
                                "--schedule", schedule] + f64
        yield n, deepseek + ["--moe-router", "switch", "--dp", "2", "--ep", "2", "--pp", "2", "--n-layer", "2",
                             "--micro-batches", "2"] + f64
        yield n, mixtral + ["--pp", "2", "--tp", "2", "--n-layer", "4", "--schedule", "interleaved", "--virtual-stages",
                            "2", "--micro-batches", "2", "--moe-every", "2", "--recompute", "full"] + f64
        for precision in set(precisions) - {"fp32"}:
            yield n, kv(2) + ["--dp", "2", "--tp", "2", "--zero", "1", "--precision", precision]
            yield n, kv(1) + ["--cp", "2", "--tp", "2", "--precision", precision]
            yield n, deepseek + ["--dp", "4", "--ep", "2", "--precision", precision]
    else:
        yield n, kv(1) + ["--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2", "--zero", "1"] + f64
        yield n, kv(2) + ["--dp", "2", "--cp", "2", "--tp", "2", "--zero", "3"] + f64


def sharding(n, precisions):
    """ZeRO as it is done at scale (docs/zero.md): hybrid sharding (--shard-group S: shard groups
    of 1 and 2, every stage, micro-batches) alone and with tp, pp (1F1B, ZB-H1, interleaved),
    cp, ep and Llama; ZeRO-3's prefetch (1, 2, past the blocks) and --reshard-after-forward
    off, with --recompute full and hybrid; ZeRO++ (hpZ exact; qwZ and qgZ judged on the losses
    at one code step, 1/127), with tp, hybrid, recomputation, Llama; fp16/bf16. 8 ranks:
    dp x tp x pp, dp x tp with prefetch, dp x cp x tp, ZeRO++ on dp 8."""
    f64 = ["--dtype", "float64"]
    llama = ["--arch", "llama", "--ffn-hidden", "24", "--n-kv-head", "2"]
    if n == 4:
        for zero, S, m in itertools.product(("1", "2", "3"), ("1", "2"), ("1", "2")):
            yield n, ["--dp", "4", "--zero", zero, "--shard-group", S, "--micro-batches", m] + f64
        for zero in ("1", "2", "3"):
            yield n, ["--dp", "2", "--tp", "2", "--zero", zero, "--shard-group", "1"] + f64
            yield n, ["--dp", "2", "--cp", "2", "--zero", zero, "--shard-group", "2" if zero == "3" else "1"] + f64
        for schedule in ("1f1b", "zb-h1"):
            yield n, ["--dp", "2", "--pp", "2", "--zero", "2", "--shard-group", "1", "--schedule", schedule,
                      "--micro-batches", "2"] + f64
        yield n, ["--dp", "2", "--pp", "2", "--n-layer", "4", "--zero", "1", "--shard-group", "1", "--schedule",
                  "interleaved", "--virtual-stages", "2", "--micro-batches", "2"] + f64
        moe = ["--moe-experts", "4", "--moe-top-k", "2"]
        for zero in ("1", "3"):
            yield n, moe + ["--dp", "4", "--ep", "2", "--zero", zero, "--shard-group", "2"] + f64
        for K, reshard in (("1", "on"), ("2", "off"), ("5", "on"), ("0", "off")):
            yield n, ["--dp", "4", "--zero", "3", "--prefetch", K, "--reshard-after-forward", reshard,
                      "--micro-batches", "2"] + f64
        yield n, ["--dp", "4", "--zero", "3", "--shard-group", "2", "--prefetch", "1", "--recompute", "full"] + f64
        yield n, ["--dp", "4", "--zero", "3", "--reshard-after-forward", "off", "--recompute", "full"] + f64
        yield n, llama + ["--dp", "4", "--zero", "3", "--shard-group", "2", "--prefetch", "1"] + f64
        yield n, llama + ["--dp", "2", "--tp", "2", "--zero", "2", "--shard-group", "1"] + f64
        for zpp in (["--hpz"], ["--qwz", "64"], ["--qgz", "64"], ["--qwz", "32", "--qgz", "128", "--hpz"]):
            yield n, ["--dp", "4", "--zero", "3", "--prefetch", "1"] + zpp + f64
        yield n, ["--dp", "2", "--tp", "2", "--zero", "3", "--qwz", "64", "--qgz", "64"] + f64
        yield n, ["--dp", "4", "--zero", "3", "--shard-group", "2", "--qwz", "64", "--qgz", "64",
                  "--recompute", "full"] + f64
        yield n, llama + ["--dp", "4", "--zero", "3", "--qwz", "64", "--hpz"] + f64
        for precision in set(precisions) - {"fp32"}:
            yield n, ["--dp", "4", "--zero", "3", "--qwz", "64", "--qgz", "64", "--precision", precision]
            yield n, ["--dp", "4", "--zero", "2", "--shard-group", "2", "--precision", precision]
            yield n, ["--dp", "4", "--zero", "3", "--shard-group", "2", "--prefetch", "1", "--precision", precision]
    else:
        yield n, ["--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1", "--shard-group", "1",
                  "--micro-batches", "2"] + f64
        yield n, ["--dp", "4", "--tp", "2", "--zero", "3", "--shard-group", "2", "--prefetch", "2"] + f64
        yield n, ["--dp", "2", "--cp", "2", "--tp", "2", "--zero", "3", "--shard-group", "2", "--prefetch", "1"] + f64
        yield n, ["--dp", "8", "--zero", "3", "--qwz", "64", "--qgz", "64", "--hpz"] + f64


def past_1f1b(n, dp, tp, pp, zero, precision):
    """The schedules past 1F1B on a pipelined layout: interleaved (V = 2, so 2p layers and p
    micro-batches), ZB-H1 and ZB-H2 (2 micro-batches, as the others)."""
    base = ["--dp", str(dp), "--tp", str(tp), "--pp", str(pp), "--zero", str(zero)]
    base += ["--dtype", "float64"] if precision == "fp32" else ["--precision", precision]
    yield n, base + ["--n-layer", str(2 * pp), "--schedule", "interleaved", "--virtual-stages", "2",
                     "--micro-batches", str(pp)]
    for schedule in ("zb-h1", "zb-h2"):
        yield n, base + ["--n-layer", str(max(2, pp)), "--schedule", schedule, "--micro-batches", "2"]


def relative(line: str) -> dict:
    """The relative differences of a `verify:` line: loss, grad norm, parameters."""
    loss = float(line.split("(rel ")[1].split(")")[0])
    norm = float(line.split("grad norm rel ")[1].split(",")[0])
    params = float(line.split("parameters max |diff| ")[1].split("(rel ")[1].split(",")[0])
    return {"loss": loss, "norm": norm, "params": params}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8], choices=(4, 8))
    ap.add_argument("--precisions", nargs="+", default=["fp32", "fp16", "bf16"])
    ap.add_argument("--match", metavar="FLAG", help="only the runs whose flags include FLAG, e.g. --match=--cp")
    args = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIPAR_COMM_TIMEOUT="60")
    failed, total, t0, worst = [], 0, time.time(), {}
    trace_file = os.path.join(tempfile.mkdtemp(), "trace.json")
    for n, flags in cases(args.ranks, args.precisions):
        if args.match and args.match not in flags:
            continue
        total += 1
        cmd = [MPIRUN, "-n", str(n), sys.executable, "-m", "minipar.train", *TINY, *flags, "--verify",
               "--trace", trace_file]
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                               stdin=subprocess.DEVNULL)
            out, code = p.stdout, p.returncode
        except subprocess.TimeoutExpired:
            out, code = "", "timeout"
        verdict = [line for line in out.splitlines() if line.startswith("verify: dp=")]
        audit = traceview.audit(traceview.load(trace_file)) if code == 0 else ["no trace"]
        ok = code == 0 and verdict and verdict[0].endswith("-> OK") and not audit
        figures = relative(verdict[0]) if verdict else {}
        print(f"{'ok    ' if ok else 'FAILED'} -n {n} {' '.join(flags):112s} "
              + " ".join(f"{k} {v:.1e}" for k, v in figures.items())
              + "".join(f"\n    trace: {line}" for line in audit[:3]), flush=True)
        if not ok:
            failed.append((n, flags, code))
        else:
            key = ("fp32" if "float64" in flags else "fp16/bf16") \
                + (" zero++" if {"--qwz", "--qgz"} & set(flags) else "") + (" --sp" if "--sp" in flags else "") \
                + (" --cp" if "--cp" in flags else "") \
                + (f" {flags[flags.index('--cp-impl') + 1]}" if "--cp-impl" in flags else "") + (" --moe" if "--moe-experts" in flags else "") \
                + (" llama" if "llama" in flags else "")
            for k, v in figures.items():
                worst.setdefault(key, {})[k] = max(v, worst.get(key, {}).get(k, 0.0))
    print(f"{total - len(failed)} of {total} layouts pass --verify ({time.time() - t0:.0f} s); largest relative "
          "differences: " + "; ".join(f"{key}: " + ", ".join(f"{k} {v:.1e}" for k, v in w.items())
                                      for key, w in worst.items()))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
