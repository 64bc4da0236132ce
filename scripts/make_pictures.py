"""Regenerate every picture under docs/img/ from real runs (docs/pictures.md and docs/pipeline.md show them).

    python scripts/make_pictures.py            # about three minutes on 2 cores
    python scripts/make_pictures.py schedules  # only part 3 (or: runs, explain)
    python scripts/make_pictures.py fsdp       # only these explain pictures (any WHAT of EXPLAIN)

1. Two training runs on 4 ranks (dp 2 x pp 2, ZeRO-1, 1F1B over 4 micro-batches), fp32 and
   bf16, with --log, --eval-every and --trace; `python -m minipar.plot` overlays their logs
   and draws the fp32 run's pipeline timeline from its trace: docs/img/{loss, throughput,
   comm, memory, timeline}.{png,svg}.
2. `python -m minipar.explain` for each algorithm it draws, ring attention and Ulysses attention
   on 4 cp ranks, one MoE layer's dispatch and combine on 4 ep ranks with a capacity (and
   on 2 without one), ZeRO-3's gathers in three 4-rank trainer runs (fsdp) and hybrid
   sharding's groups in one (hsdp): docs/img/explain-*.{svg,png}.
3. One 4-stage training run per pipeline schedule (8 layers, 8 micro-batches; interleaved
   with 2 virtual stages), its last step drawn by --timeline: docs/img/schedule-*.svg
   (docs/pipeline.md shows them one above the other).
Nothing here is drawn by hand: each picture is what a run recorded.
"""
import glob
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
           ("1f1b", 4), ("ring-attention", 4), ("moe-dispatch", 4),
           ("moe-dispatch", 2, "--capacity-factor", "0"), ("gqa-tp", 4),
           ("ulysses", 4), ("fsdp", 4), ("hsdp", 4)]                      # (what, p, its own flags)
SCHEDULE_RUN = ["--pp", "4", "--n-layer", "8", "--micro-batches", "8", "--steps", "6", "--sample", "0"]
SCHEDULES = [("gpipe", []), ("1f1b", []), ("interleaved", ["--virtual-stages", "2"]), ("zb-h1", []),
             ("zb-h2", [])]


def run(cmd, timeout=600):
    t0 = time.time()
    print("$", " ".join(os.path.relpath(c, REPO) if c.startswith(REPO) else c for c in cmd), flush=True)
    p = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        sys.exit(f"failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    print(f"  ok, {time.time() - t0:.0f} s", flush=True)
    return p.stdout


def training_pictures():
    with tempfile.TemporaryDirectory() as tmp:
        logs = []
        for precision in ("fp32", "bf16"):
            log, tr = os.path.join(tmp, f"{precision}.jsonl"), os.path.join(tmp, f"{precision}.json")
            run([MPIRUN, "-n", "4", PY, "-m", "minipar.train", *TRAIN, "--precision", precision,
                 "--log", log] + (["--trace", tr] if precision == "fp32" else []))
            logs.append(log)
        print(run([PY, "-m", "minipar.plot", *logs, "--label", "fp32", "bf16",
                   "--trace", os.path.join(tmp, "fp32.json"), "--out", IMG]), end="")


def explain_pictures(only=None):
    for what, p, *flags in EXPLAIN:
        if only is not None and what not in only:
            continue
        print(run([PY, "-m", "minipar.explain", what, "--p", str(p), *flags, "--out", IMG]).splitlines()[-1])
        for path in glob.glob(os.path.join(IMG, f"explain-{what}-p{p}*.json*")):    # traces, logs: not pictures
            os.remove(path)


def schedule_pictures():
    """The last step of each schedule, measured; its summary's pipeline lines are printed."""
    for name, extra in SCHEDULES:
        out = run([MPIRUN, "-n", "4", PY, "-m", "minipar.train", *SCHEDULE_RUN, "--schedule", name, *extra,
                   "--timeline", os.path.join(IMG, f"schedule-{name}.svg")])
        print("\n".join(line for line in out.splitlines()
                        if line.lstrip().startswith(("pipeline:", "one micro-batch", "saved activations"))))


PARTS = {"runs": training_pictures, "explain": explain_pictures, "schedules": schedule_pictures}


def main(parts):
    whats = [what for what, *_ in EXPLAIN]
    unknown = [p for p in parts if p not in PARTS and p not in whats]
    if unknown:
        sys.exit(f"usage: make_pictures.py [{' '.join(PARTS)}] [WHAT of explain ...] (all of them when none is "
                 f"named); unknown: {' '.join(unknown)}")
    os.makedirs(IMG, exist_ok=True)
    for name in parts or PARTS:
        if name in PARTS:
            PARTS[name]()
    if any(p in whats for p in parts):
        explain_pictures([p for p in parts if p in whats])


if __name__ == "__main__":
    main(sys.argv[1:])
