"""What --recompute costs and saves, side by side, on `make run`'s layout (4 ranks: dp 2 x pp 2,
ZeRO-1, 1F1B over 4 micro-batches, the default model, float32):

    python scripts/bench_recompute.py            # about 2 minutes on 2 cores
    python scripts/bench_recompute.py --steps 20 --repeats 3

For each of none, selective and full: the step time (the median of the log's step_time, the
first step left out, then the median over --repeats runs, alternated so that the machine's
drift hits all alike), the peak saved-activation bytes of each pipeline stage (the summary's
pipeline.peak_activation_bytes, measured with Tensor.saved_bytes), and the matmul FLOPs that
recomputation adds per step beside the model's (recompute.added_flops, which
tests/test_recompute.py holds to an instrumented count).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from minipar import recompute
from minipar.model import GPTConfig, train_flops_per_token

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
LAYOUT = ["--dp", "2", "--pp", "2", "--zero", "1", "--micro-batches", "4"]


def run(mode, steps, log):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    subprocess.run([MPIRUN, "-n", "4", sys.executable, "-m", "minipar.train", *LAYOUT, "--steps", str(steps),
                    "--recompute", mode, "--sample", "0", "--log", log], cwd=REPO, env=env, check=True,
                   capture_output=True, timeout=900)
    with open(log) as f:
        objs = [json.loads(line) for line in f]
    rows, summary = objs[:-1], objs[-1]
    return statistics.median(r["step_time"] for r in rows[1:]), summary["pipeline"]["peak_activation_bytes"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    log = os.path.join(tempfile.mkdtemp(), "log.jsonl")
    times = {m: [] for m in recompute.MODES}
    peaks = {}
    for _ in range(a.repeats):
        for mode in recompute.MODES:
            t, peaks[mode] = run(mode, a.steps, log)
            times[mode].append(t)
    cfg = GPTConfig()
    B, T = 16, cfg.block_size
    model = train_flops_per_token(cfg, T) * B * T
    base = statistics.median(times["none"])
    print(f"make run's layout, {a.steps} steps, median of {a.repeats} alternated runs; model FLOPs per step "
          f"{model:.3e}")
    print(f"{'--recompute':12} {'step ms':>8} {'x none':>7} {'peak saved, stage 0':>20} {'stage 1':>12} "
          f"{'FLOPs added/step':>17} {'of the model':>13}")
    for mode in recompute.MODES:
        t = statistics.median(times[mode])
        added = recompute.added_flops(cfg.n_layer, B, T, cfg.n_embd, mode)
        print(f"{mode:12} {t * 1e3:8.1f} {t / base:7.3f} {peaks[mode][0]:20,d} {peaks[mode][1]:12,d} "
              f"{added:17.3e} {added / model:13.1%}")


if __name__ == "__main__":
    main()
