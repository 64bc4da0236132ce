"""The pipeline schedules side by side: bubble measured against theory, activation peaks, bytes.

    python scripts/bench_pipeline.py [--steps N] [--quick]

For p = 2 and 4 ranks and m = 4 and 8 micro-batches, runs the trainer once per schedule
(`mpirun -n p python -m minipar.train --pp p --schedule S --log ...`; naive, gpipe, 1f1b,
interleaved with V = 2, zb-h1, zb-h2; one BLAS thread per rank) on the default model with
8 layers (p x V = 8 chunks at p = 4) and a global batch of 32, and reads the summary's
`pipeline` object from the log. A micro-batch's F takes tens of ms here, its messages
(b x T x C floats, 128 KiB at m = 8) well under one: compute dominates messages.

Columns (pipeline.py, report.py and schedules.py define each figure):
    measured     bubble_measured: 1 - busy / (p x makespan), mean over stages and over the
                 steps after the first
    theory       schedules.bubble_theory: every op of one length, F = B = W
    from F/B/W   zero_bubble.bubble_from_times with the stages' mean measured F, B, W
    simulated    the schedule checker with each stage's own measured F, B, W, messages free
    vs 1f1b      measured - 1F1B's measured at the same (p, m): the thing to beat
    F/B/W ms     one micro-batch (all its chunks), mean over stages; with an unsplit
                 backward B is the whole backward and W is 0
    peak MiB     saved activations at their peak, per stage
    p2p KiB      point-to-point bytes stage 0 sent per step (headers and the tied
                 embedding's gradient included)
Target: at p = 2, m = 8 the interleaved and zero-bubble bubbles each within 0.05
of theory. After the table, for p = 2, m = 8, where the last step's time went: its bubble as
the theory's assumptions are dropped one at a time (equal op times, equal stages, equal
micro-batches, free messages), down to what was measured.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from minipar.parallel.pipeline import schedules, zero_bubble                       # noqa: E402

SCHEDULES = ("naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")
TARGETS = ("interleaved", "zb-h1", "zb-h2")            # within 0.05 of theory at p = 2, m = 8
MODEL = ["--n-layer", "8", "--batch-size", "32"]       # default C, H, T; 8 layers: p x V at p = 4
TOLERANCE = 0.05


def mpirun() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return here if os.path.exists(here) else "mpirun"


def run(schedule: str, p: int, m: int, steps: int) -> dict:
    """One trainer run -> its summary's `pipeline` object."""
    V = 2 if schedule == "interleaved" else 1
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [mpirun(), "-n", str(p), sys.executable, "-m", "minipar.train", "--pp", str(p),
               "--schedule", schedule, "--virtual-stages", str(V), "--micro-batches", str(m), *MODEL,
               "--steps", str(steps), "--sample", "0", "--log", log, "--log-every", str(steps)]
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, timeout=600)
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
        return [json.loads(line) for line in open(log)][-1]["pipeline"]


def mean(xs):
    return sum(xs) / len(xs)


def row(pl: dict, best: float | None) -> str:
    ops = [mean(col) for col in zip(*pl["op_seconds_per_stage"])]
    gap = abs(pl["bubble_measured"] - pl["bubble_theory"])
    vs = f"{pl['bubble_measured'] - best:+7.3f}" if best is not None else f"{'':>7s}"
    return (f"{pl['schedule']:<11s} {pl['stages']:>1d} {pl['micro_batches']:>2d} {pl['virtual_stages']:>1d} "
            f"{pl['bubble_measured']:8.3f} {pl['bubble_theory']:7.3f} {pl['bubble_theory_from_times']:10.3f} "
            f"{pl['bubble_simulated']:9.3f} {gap:7.3f} {vs} "
            f"{'/'.join(f'{t * 1e3:.0f}' for t in ops):>12s} "
            f"{'/'.join(f'{b / 2**20:.1f}' for b in pl['peak_activation_bytes']):>19s} "
            f"{pl['bytes_sent_per_step'] / 1024:8.0f}")


HEADER = (f"{'schedule':<11s} p  m V {'measured':>8s} {'theory':>7s} {'from F/B/W':>10s} {'simulated':>9s} "
          f"{'|m-th|':>7s} {'vs 1f1b':>7s} {'F/B/W ms':>12s} {'peak MiB /stage':>19s} {'p2p KiB':>8s}")


# --- where the time went (p = 2, m = 8) ----------------------------------------------------------

def stage_ops(timeline, p: int) -> list:
    """The last step's timeline rows [stage, kind, mb, start, end] -> per stage, its ops in the
    order run: (kind letter, chunk, mb, duration)."""
    out = [[] for _ in range(p)]
    for s, kind, mb, a, e in sorted(timeline, key=lambda r: (r[0], r[3])):
        out[s].append((kind[0], int(kind[1:] or 0), mb, e - a))
    return out


def replay(timeline, p: int, V: int) -> float:
    """The makespan of the measured step replayed: each stage runs its ops in the order it
    ran them, each with its own measured duration, at the earliest moment the checker's rule
    allows (F after the previous virtual stage's F of the micro-batch, B after the next
    one's B; messages and the executor's own work free)."""
    ops, done = stage_ops(timeline, p), {}          # (kind, virtual stage, mb) -> end
    clock, pc = [0.0] * p, [0] * p
    while any(pc[s] < len(ops[s]) for s in range(p)):
        moved = False
        for s in range(p):
            while pc[s] < len(ops[s]):
                kind, chunk, mb, d = ops[s][pc[s]]
                peer = {"F": -1, "B": +1}.get(kind)
                other = schedules.neighbour(s, chunk, peer, p, V) if peer else None
                dep = done.get((kind, other[1] * p + other[0], mb), None) if other else 0.0
                if dep is None:
                    break
                clock[s] = max(clock[s], dep) + d
                done[(kind, chunk * p + s, mb)] = clock[s]
                pc[s], moved = pc[s] + 1, True
        if not moved:
            raise RuntimeError("the measured order does not replay: a schedule bug, see schedule_check")
    return max(clock)


def stage_means(pl: dict) -> list:
    """Each stage's mean F, B and W of one op (a chunk's) in the last step, {kind: seconds}."""
    ops = stage_ops(pl["last_step_timeline"], pl["stages"])
    return [{k: mean([d for kk, _, _, d in st if kk == k] or [0.0]) for k in "FBW"} for st in ops]


def where_time_went(pl: dict) -> str:
    """One line for the last step: its bubble (every figure 1 - busy / (p x makespan), the
    same busy time) as each assumption of the theory is dropped in turn: equal op times;
    the measured mean F, B, W (zero_bubble.bubble_from_times); each stage's own means
    (schedules.check); each op's own time (replay); and what was measured, whose makespan
    also holds the messages, the executor's work between ops and the wait for the last sends."""
    p, m, V, name = pl["stages"], pl["micro_batches"], pl["virtual_stages"], pl["schedule"]
    tl = pl["last_step_timeline"]
    t = stage_means(pl)
    f, b, w = (mean([x[k] for x in t]) for k in "FBW")
    split = name.startswith("zb")
    sim = schedules.check(p, m, name, virtual=V, forward_time=[x["F"] for x in t],
                          backward_time=[x["B"] + x["W"] for x in t],
                          weight_time=[x["W"] for x in t] if split else None).makespan
    spans, rep = pl["step_time_s"], replay(tl, p, V)
    busy = sum(e - a for _, _, _, a, e in tl)
    last_end = [max(e for s, _, _, _, e in tl if s == st) for st in range(p)]
    bub = lambda span: 1 - busy / (p * span)                                   # noqa: E731
    return (f"  {name:<11s} theory {pl['bubble_theory']:.3f} -> measured F/B/W "
            f"{zero_bubble.bubble_from_times(name, p, m, f, b, w, V):.3f} -> each stage's own {bub(sim):.3f} "
            f"-> each op's own {bub(rep):.3f} -> measured {bub(max(spans)):.3f}; makespan "
            f"{max(spans) * 1e3:.0f} ms, replayed {rep * 1e3:.0f} ms; after the last op "
            f"{'/'.join(f'{(span - end) * 1e3:.1f}' for span, end in zip(spans, last_end))} ms; F/B/W ms per stage "
            + "; ".join("/".join(f"{x[k] * 1e3:.1f}" for k in "FBW") for x in t))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6, help="steps per run (the first is not measured) [6]")
    ap.add_argument("--quick", action="store_true", help="only p = 2, m = 8, 4 steps")
    args = ap.parse_args()
    steps = 4 if args.quick and args.steps == 6 else args.steps
    grid = [(2, 8)] if args.quick else [(2, 4), (2, 8), (4, 4), (4, 8)]
    cores = len(os.sched_getaffinity(0))
    print(f"minipar pipeline schedules: default model with 8 layers, global batch 32, float32, "
          f"{steps} steps per run (the first not measured); interleaved V = 2")
    print(f"this machine: {cores} cores (nproc). p = 2 runs one rank per core"
          + (" (the cores are shared with whatever else runs)" if cores >= 2 else ": oversubscribed")
          + f"; p = 4 runs 4 ranks on {cores} cores"
          + (f": oversubscribed, {4 / cores:g} ranks per core, so its op times include waiting for a core"
             if cores < 4 else ", one per core"))
    load = os.getloadavg()[0]
    print(f"load average at start {load:.2f}" + ("  (busy: expect noisy times)" if load > 0.5 * cores else ""))
    print(HEADER)
    print("-" * len(HEADER))
    results, t0 = {}, time.time()
    for p, m in grid:
        for name in SCHEDULES:
            pl = results[(name, p, m)] = run(name, p, m, steps)
            print(row(pl, results[("1f1b", p, m)]["bubble_measured"] if name in TARGETS else None), flush=True)
        print()
    if (2, 8) in grid:
        print(f"targets at p = 2, m = 8: within {TOLERANCE} of which theory? and below 1F1B's measured "
              f"{results[('1f1b', 2, 8)]['bubble_measured']:.3f}?")
        for name in TARGETS:
            pl = results[(name, 2, 8)]
            near = "; ".join(f"{what} {pl[key]:.3f}: "
                             + ("yes" if abs(pl["bubble_measured"] - pl[key]) <= TOLERANCE else "no")
                             for what, key in (("theory", "bubble_theory"),
                                               ("from F/B/W", "bubble_theory_from_times"),
                                               ("simulated", "bubble_simulated")))
            beats = pl["bubble_measured"] < results[("1f1b", 2, 8)]["bubble_measured"]
            print(f"  {name:<11s} measured {pl['bubble_measured']:.3f}; {near}; beats 1f1b: "
                  f"{'yes' if beats else 'no'}")
        print("where the last step's time went at p = 2, m = 8: its bubble as the theory's assumptions are "
              "dropped one by one (messages free until the last):")
        for name in SCHEDULES:
            print(where_time_went(results[(name, 2, 8)]))
    print(f"({len(results)} runs in {time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
