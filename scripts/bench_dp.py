"""Data-parallel scaling: tokens/s for dp=1 and dp=2 at the same global batch.

    python scripts/bench_dp.py [--steps N] [--configs small,medium]

Runs the trainer itself (`python -m minipar.train`, and `mpirun -n 2 python -m minipar.train`
for dp=2), one BLAS thread per rank, on the small and medium configs of bench_train.py, and
reads the JSONL logs. Reports the median tokens/s, the scaling efficiency
tokens/s(dp2) / (2 * tokens/s(dp1)) (target >= 0.90 on medium) and the exposed
communication fraction (time spent waiting for gradients after backward / step time) for
the naive and the bucketed all-reduce.

The thing to beat, in the same run: `bound`, two independent single processes started
together, each on half the global batch (what dp=2 would be if communication cost
nothing: same cores, same half-batch GEMMs, each repeating the whole optimizer step), as
an efficiency; `of bound` = efficiency / bound.
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


ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")


def trainer(flags, steps, log, extra=()):
    return [sys.executable, "-m", "minipar.train", *flags, "--steps", str(steps), "--sample", "0",
            "--log", log, "--log-every", str(steps), *extra]


def read(log):
    """-> (median tokens/s after two warm-up steps, median exposed fraction, summary)."""
    rows = [json.loads(line) for line in open(log)]
    steps_rows, summary = rows[:-1][2:], rows[-1]
    tok = statistics.median(r["tokens_per_s"] for r in steps_rows)
    exposed = statistics.median(r.get("exposed_comm_s", 0.0) / r["step_time"] for r in steps_rows)
    return tok, exposed, summary


def run(cfg, dp, steps, extra=()):
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = trainer(CONFIGS[cfg], steps, log, extra)
        if dp > 1:
            mpirun = os.path.join(BIN, "mpirun") if os.path.exists(os.path.join(BIN, "mpirun")) else "mpirun"
            cmd = [mpirun, "-n", str(dp), *cmd]
        subprocess.run(cmd, cwd=ROOT, env=ENV, check=True, stdout=subprocess.DEVNULL, timeout=1800)
        return read(log)


def half_batches(cfg, steps):
    """Two single processes at once, each on half the global batch: -> tokens/s of the
    pair (the global batch's tokens per second if their work made one step)."""
    flags = list(CONFIGS[cfg])
    i = flags.index("--batch-size") + 1
    flags[i] = str(int(flags[i]) // 2)
    with tempfile.TemporaryDirectory() as tmp:
        logs = [os.path.join(tmp, f"half{k}.jsonl") for k in range(2)]
        procs = [subprocess.Popen(trainer(flags, steps, log), cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL)
                 for log in logs]
        for p in procs:
            if p.wait(timeout=1800):
                raise SystemExit(f"half-batch run failed with exit code {p.returncode}")
        return sum(read(log)[0] for log in logs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--configs", default="small,medium")
    args = ap.parse_args()
    hdr = (f"{'config':8s} {'dp1 tok/s':>10s} {'dp2 tok/s':>10s} {'efficiency':>10s} {'bound':>6s} {'of bound':>8s} "
           f"{'exposed bucketed':>17s} {'dp2 naive tok/s':>16s} {'exposed naive':>14s}")
    print("dp scaling at the same global batch, float32, 1 BLAS thread per rank")
    print(hdr)
    print("-" * len(hdr))
    for cfg in args.configs.split(","):
        t1, _, _ = run(cfg, 1, args.steps)
        t2, e2, s2 = run(cfg, 2, args.steps)
        tn, en, _ = run(cfg, 2, args.steps, ["--dp-mode", "naive"])
        bound = half_batches(cfg, args.steps) / (2 * t1)
        eff = t2 / (2 * t1)
        print(f"{cfg:8s} {t1:10.0f} {t2:10.0f} {eff:10.3f} {bound:6.3f} {eff / bound:8.3f} {e2:17.1%} {tn:16.0f} {en:14.1%}"
              f"   ({s2['data_parallel']['buckets']} buckets)")
    print("efficiency = tok/s(dp2) / (2 x tok/s(dp1)); target >= 0.90 on medium")
    print("bound = the same for two independent processes on half the batch each, run together (free communication)")


if __name__ == "__main__":
    main()
