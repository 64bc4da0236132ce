"""Data-parallel scaling: tokens/s for dp=1 and dp=2 at the same global batch.

    python scripts/bench_dp.py [--steps N] [--configs small,medium]

Runs the trainer itself (`python -m minipar.train`, and `mpirun -n 2 python -m minipar.train`
for dp=2), one BLAS thread per rank, on the small and medium configs of bench_train.py, and
reads the JSONL logs. Reports the median tokens/s, the scaling efficiency
tokens/s(dp2) / (2 * tokens/s(dp1)) (target >= 0.90 on medium) and the exposed
communication fraction (time spent waiting for gradients after backward / step time) for
the naive and the bucketed all-reduce.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)
CONFIGS = {  # name: trainer flags (the shapes of bench_train.py)
    "small": ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--block-size", "64", "--batch-size", "16"],
    "medium": ["--n-layer", "6", "--n-head", "6", "--n-embd", "384", "--block-size", "128", "--batch-size", "8"],
}


def run(cfg, dp, steps, extra=()):
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, "-m", "minipar.train", *CONFIGS[cfg], "--steps", str(steps), "--sample", "0",
               "--log", log, "--log-every", str(steps), *extra]
        if dp > 1:
            mpirun = os.path.join(BIN, "mpirun") if os.path.exists(os.path.join(BIN, "mpirun")) else "mpirun"
            cmd = [mpirun, "-n", str(dp), *cmd]
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        rows = [json.loads(line) for line in open(log)]
    steps_rows, summary = rows[:-1][2:], rows[-1]          # drop two warm-up steps
    tok = statistics.median(r["tokens_per_s"] for r in steps_rows)
    exposed = statistics.median(r.get("exposed_comm_s", 0.0) / r["step_time"] for r in steps_rows)
    return tok, exposed, summary


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--configs", default="small,medium")
    args = ap.parse_args()
    hdr = (f"{'config':8s} {'dp1 tok/s':>10s} {'dp2 tok/s':>10s} {'efficiency':>10s} "
           f"{'exposed bucketed':>17s} {'dp2 naive tok/s':>16s} {'exposed naive':>14s}")
    print("dp scaling at the same global batch, float32, 1 BLAS thread per rank")
    print(hdr)
    print("-" * len(hdr))
    for cfg in args.configs.split(","):
        t1, _, _ = run(cfg, 1, args.steps)
        t2, e2, s2 = run(cfg, 2, args.steps)
        tn, en, _ = run(cfg, 2, args.steps, ["--dp-mode", "naive"])
        eff = t2 / (2 * t1)
        print(f"{cfg:8s} {t1:10.0f} {t2:10.0f} {eff:10.3f} {e2:17.1%} {tn:16.0f} {en:14.1%}"
              f"   ({s2['data_parallel']['buckets']} buckets)")
    print("efficiency = tok/s(dp2) / (2 x tok/s(dp1)); target >= 0.90 on medium")


if __name__ == "__main__":
    main()
