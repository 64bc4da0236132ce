"""Regenerate every picture under docs/img/ from real runs (docs/pictures.md shows them).

    python scripts/make_pictures.py            # about a minute and a half on 2 cores

1. Two training runs on 4 ranks (dp 2 x pp 2, ZeRO-1, 1F1B over 4 micro-batches), fp32 and
   bf16, with --log, --eval-every and --trace; `python -m minipar.plot` overlays their logs
   and draws the fp32 run's pipeline timeline from its trace: docs/img/{loss, throughput,
   comm, memory, timeline}.{png,svg}.
2. `python -m minipar.explain` for each algorithm it draws: docs/img/explain-*.{svg,png}.
Nothing here is drawn by hand: each picture is what a run recorded.
"""
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMG = os.path.join(REPO, "docs", "img")
PY = sys.executable
MPIRUN = os.path.join(os.path.dirname(PY), "mpirun")
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
TRAIN = ["--dp", "2", "--pp", "2", "--zero", "1", "--micro-batches", "4", "--steps", "120",
         "--eval-every", "20", "--sample", "0"]
EXPLAIN = [("ring-all-reduce", 4), ("reduce-scatter", 4), ("all-gather", 4),
           ("recursive-doubling", 5), ("broadcast", 4), ("reduce", 4), ("megatron-mlp", 2),
           ("1f1b", 4)]


def run(cmd, timeout=600):
    t0 = time.time()
    print("$", " ".join(os.path.relpath(c, REPO) if c.startswith(REPO) else c for c in cmd), flush=True)
    p = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.exit(f"failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    print(f"  ok, {time.time() - t0:.0f} s", flush=True)
    return p.stdout


def main():
    os.makedirs(IMG, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        logs = []
        for precision in ("fp32", "bf16"):
            log, tr = os.path.join(tmp, f"{precision}.jsonl"), os.path.join(tmp, f"{precision}.json")
            run([MPIRUN, "-n", "4", PY, "-m", "minipar.train", *TRAIN, "--precision", precision,
                 "--log", log] + (["--trace", tr] if precision == "fp32" else []))
            logs.append(log)
        print(run([PY, "-m", "minipar.plot", *logs, "--label", "fp32", "bf16",
                   "--trace", os.path.join(tmp, "fp32.json"), "--out", IMG]), end="")
    for what, p in EXPLAIN:
        print(run([PY, "-m", "minipar.explain", what, "--p", str(p), "--out", IMG]).splitlines()[-1])
        os.remove(os.path.join(IMG, f"explain-{what}-p{p}.json"))       # its trace: not a picture


if __name__ == "__main__":
    main()
