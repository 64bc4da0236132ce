"""Pipeline bubble: measured against theory, and activation peaks, on pp=2.

    python scripts/bench_pipeline.py [--steps N] [--micro-batches 1,2,4,8]

Runs the trainer (`mpirun -n 2 python -m minipar.train --pp 2`, one core per stage here,
one BLAS thread per rank) on the default model with a global batch of 32, for GPipe and
1F1B at each m, and reads the summary's `pipeline` object from the JSONL log: the bubble
measured (each stage's idle fraction of the step, averaged over stages and steps after the
first) beside (p-1)/(m+p-1), and the peak bytes of saved activations per stage (GPipe
holds m micro-batches, 1F1B at most p - stage). Target: measured within 0.05 of theory at
m = 4.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)


def run(schedule, m, steps, batch):
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        mpirun = os.path.join(BIN, "mpirun") if os.path.exists(os.path.join(BIN, "mpirun")) else "mpirun"
        cmd = [mpirun, "-n", "2", sys.executable, "-m", "minipar.train", "--pp", "2", "--schedule", schedule,
               "--micro-batches", str(m), "--batch-size", str(batch), "--steps", str(steps), "--sample", "0",
               "--log", log, "--log-every", str(steps)]
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        summary = [json.loads(line) for line in open(log)][-1]
    return summary["pipeline"]


def mib(b):
    return f"{b / 2**20:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--micro-batches", default="1,2,4,8")
    args = ap.parse_args()
    print(f"pp=2, default model, global batch {args.batch_size}, float32, {args.steps} steps per run")
    hdr = (f"{'m':>3s} {'theory':>7s} {'gpipe':>7s} {'1f1b':>7s} {'|1f1b-theory|':>14s} "
           f"{'gpipe peak MiB (st0/st1)':>25s} {'1f1b peak MiB (st0/st1)':>24s}")
    print(hdr)
    print("-" * len(hdr))
    for m in [int(x) for x in args.micro_batches.split(",")]:
        g = run("gpipe", m, args.steps, args.batch_size)
        f = run("1f1b", m, args.steps, args.batch_size)
        gap = abs(f["bubble_measured"] - f["bubble_theory"])
        flag = "" if m != 4 else ("  target <= 0.05: " + ("ok" if gap <= 0.05 else "MISSED"))
        print(f"{m:3d} {f['bubble_theory']:7.3f} {g['bubble_measured']:7.3f} {f['bubble_measured']:7.3f} {gap:14.3f} "
              f"{' / '.join(mib(b) for b in g['peak_activation_bytes']):>25s} "
              f"{' / '.join(mib(b) for b in f['peak_activation_bytes']):>24s}{flag}")
    print("bubble = 1 - busy / (p x makespan) per step, mean over stages and steps after the first")


if __name__ == "__main__":
    main()
