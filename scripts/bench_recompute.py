"""Korthikanti's six settings side by side on the default model (L 4, H 4, C 128, T 64, B 16,
float32), 4 ranks, each a 2-stage 1F1B pipeline so that the summary measures the peak:

    python scripts/bench_recompute.py            # about 2.5 minutes on 2 cores
    python scripts/bench_recompute.py --steps 20 --repeats 3

    setting            the trainer's flags
    none               --dp 2 --pp 2 --micro-batches 4
    tp                 --tp 2 --pp 2 --micro-batches 8
    tp+sp              --tp 2 --pp 2 --micro-batches 8 --sp
    tp+selective       --tp 2 --pp 2 --micro-batches 8 --recompute selective
    tp+sp+selective    --tp 2 --pp 2 --micro-batches 8 --sp --recompute selective
    full               --dp 2 --pp 2 --micro-batches 4 --recompute full

Fair comparison: every setting trains the same global batch (B = 16 sequences) on the same 4
ranks and the same pipeline, and every rank's micro-batch has the same rows,
b = B/(dp*M) = 16/(2*4) = 16/(1*8) = 2 sequences: dp 2 splits the batch in two, so the tp
layouts (dp 1) take twice the micro-batches. 1F1B then holds min(M, pp - stage) = 2
micro-batches on stage 0 and 1 on stage 1 in every setting, so the peaks differ only by what
a micro-batch keeps. What still differs is the bubble, (p-1)/(m+p-1) = 1/5 with M 4 and 1/9
with M 8 (schedules.bubble_theory), and the communication each layout needs.

For each setting:
  step ms       the median of the log's step_time with the first step left out, then the
                median over --repeats runs, the settings alternated so that the machine's
                drift hits all alike
  measured      the peak saved-activation bytes of each stage (the summary's
                pipeline.peak_activation_bytes, Tensor.saved_bytes of the graphs in flight;
                the summary comes from rank 0, so tp rank 0 of each stage)
  formula       the planner's for the same flags (minipar.plan: memory_per_stage[i]
                ["activations"], micro-batches in flight x activations.stage_bytes)
  ratio         measured / formula: 1.000000 for tp = 1 (exact). With tp > 1 the
                vocabulary-parallel embedding and cross-entropy keep the ids (and targets)
                of the tokens the rank's vocabulary slice owns, 8 bytes each, which the
                formula takes as ceil(N/tp). tp rank 0 owns byte values 0-127, which is every
                token of the built-in text, so it keeps 8(N - N/tp) bytes more per id array:
                N = b*T = 128, so 64 ids more on stage 0 (the ids) and 128 on stage 1 (ids of
                the targets, twice) per micro-batch in flight, 128 on each stage at its peak
                (the "ids" column: measured - formula, / 8); ratio 1.0003-1.0008
  FLOPs added   the matmul FLOPs recomputation adds per step (recompute.added_flops, which
                tests/test_recompute.py holds to an instrumented count), beside the model's
                (model.train_flops_per_token x B x T)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from minipar.plan import activations, table
from minipar.autograd import recompute
from minipar.model.gpt import train_flops_per_token

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
TP1 = ["--dp", "2", "--pp", "2", "--micro-batches", "4"]
TP2 = ["--tp", "2", "--pp", "2", "--micro-batches", "8"]
FLAGS = {"none": TP1, "tp": TP2, "tp+sp": TP2 + ["--sp"],
         "tp+selective": TP2 + ["--recompute", "selective"],
         "tp+sp+selective": TP2 + ["--sp", "--recompute", "selective"],
         "full": TP1 + ["--recompute", "full"]}


def run(flags, steps, log):
    """(median step time after the first step, peak saved bytes per stage) of one training run."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [MPIRUN, "-n", "4", sys.executable, "-m", "minipar.train", *flags, "--steps", str(steps),
           "--sample", "0", "--log", log]
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
                       stdin=subprocess.DEVNULL)
    if p.returncode:
        sys.exit(f"{' '.join(cmd)}: exit {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]}")
    with open(log) as f:
        objs = [json.loads(line) for line in f]
    rows, summary = objs[:-1], objs[-1]
    return statistics.median(r["step_time"] for r in rows[1:]), summary["pipeline"]["peak_activation_bytes"]


def planned(flags):
    """The planner's result for the trainer's flags (its flags have the same names)."""
    cfg, lay, _ = table.resolve(table.build_parser().parse_args(flags))
    return cfg, lay, table.plan(cfg, lay)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="steps per run (the first is left out) [%(default)s]")
    ap.add_argument("--repeats", type=int, default=2, help="runs per setting, alternated [%(default)s]")
    a = ap.parse_args()
    if a.steps < 2 or a.repeats < 1:
        ap.error(f"--steps must be >= 2 and --repeats >= 1, got {a.steps} and {a.repeats}")
    log = os.path.join(tempfile.mkdtemp(), "log.jsonl")
    times = {s: [] for s in activations.SETTINGS}
    peaks = {}
    for _ in range(a.repeats):
        for setting in activations.SETTINGS:
            t, peaks[setting] = run(FLAGS[setting], a.steps, log)
            times[setting].append(t)
    base = statistics.median(times["none"])
    cfg, lay, _ = planned(FLAGS["none"])
    B, T = lay.batch_size, cfg.block_size
    model = train_flops_per_token(cfg, T) * B * T
    print(f"the default model (L {cfg.n_layer}, H {cfg.n_head}, C {cfg.n_embd}, T {T}, B {B}, float32) on 4 ranks, "
          f"{a.steps} steps, median of {a.repeats} alternated runs; model FLOPs per step {model:.3e}")
    stage_head = "".join(f"  {'stage ' + str(i) + ' measured':>17} {'formula':>10} {'ratio':>8} {'ids':>4}"
                         for i in range(lay.pp))
    print(f"{'setting':16} {'rows':>4} {'step ms':>8} {'x none':>6}{stage_head}  {'FLOPs added':>11} {'of model':>8}")
    for setting in activations.SETTINGS:
        cfg, lay, r = planned(FLAGS[setting])
        assert activations.setting_of(lay.tp, lay.sp, lay.recompute) == setting, FLAGS[setting]
        t = statistics.median(times[setting])
        cells = ""
        for stage, measured in enumerate(peaks[setting]):
            formula = r["memory_per_stage"][stage]["activations"]
            cells += f"  {measured:17,d} {formula:10,d} {measured / formula:8.6f} {(measured - formula) // 8:4d}"
        added = recompute.added_flops(cfg.n_layer, lay.batch_size, cfg.block_size, cfg.n_embd, lay.recompute)
        print(f"{setting:16} {lay.rows:4d} {t * 1e3:8.1f} {t / base:6.2f}{cells}  {added:11.3e} {added / model:8.1%}")


if __name__ == "__main__":
    main()
