"""ZeRO-3's gathers in the trainer: the exposed all-gather waits with and without prefetch, and
with the parameters kept after forward, against prefetch 0 (minipar's ZeRO-3 before prefetch):

    python scripts/bench_zero.py                # about 2 minutes on 2 cores
    python scripts/bench_zero.py --quick        # a smaller model, 2 timed steps: the smoke test
    python scripts/bench_zero.py --ranks 2 --prefetch 0 1 --steps 8

Each run is `mpirun -n R python -m minipar.train --zero 3 --prefetch K --reshard-after-forward
on|off` on one model (GPT-2, L 6, H 4, C 256, T 128, B 8, float32; --quick: L 4, C 64, T 32),
one BLAS thread per rank, 1 warm-up step then --steps timed ones, read from the trainer's
--log; --repeats runs of each setting, one setting after another in rounds so that the
machine's drift hits all alike.

Columns (rank 0's log; medians over the timed steps of all runs of a setting):
  step ms       step_time, and prefetch 0's step ms / this one (above 1: faster)
  wait fwd/bwd  the exposed waits for all-gathers in forward and in backward (zero_gather_wait_s):
                what prefetch is for
  gathered      the peak of gathered parameters in use (zero_gathered_peak) beside
                formulas.gathered_peak (the summary's gathered_peak_formula), and their ratio
  zero bytes    ZeRO's bytes per step (the ledger) beside the formula (theory_bytes_per_step);
                reshard off sends one all-gather per micro-batch fewer
Any ratio of bytes or of the gathered peak other than 1 makes the script exit 1; nothing of
time is asserted (the machine is shared and noisy). With more ranks than cores the ranks
take turns on them, and a gather in flight moves only when its ranks run: the output says so.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--n-layer", "6", "--n-head", "4", "--n-embd", "256", "--block-size", "128", "--batch-size", "8"]
QUICK = ["--n-layer", "4", "--n-head", "2", "--n-embd", "64", "--block-size", "32", "--batch-size", "8"]
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
MiB = 1 << 20


def run(model, ranks, K, reshard, args) -> dict:
    """One trainer run -> its rows' figures and its summary's zero object."""
    label = f"{ranks} ranks, prefetch {K}, reshard {reshard}"
    print(f"# {label}, load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpirun"), "-n", str(ranks), sys.executable, "-m",
               "minipar.train", *model, "--zero", "3", "--prefetch", str(K), "--reshard-after-forward", reshard,
               "--steps", str(args.steps + 1), "--sample", "0", "--log", log, "--log-every", str(args.steps + 1)]
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **ENV), stdin=subprocess.DEVNULL,
                               capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            sys.exit(f"bench_zero: {label} ran past --timeout {args.timeout:g} s")
        if p.returncode:
            last = (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or ["no output"])[-1]
            sys.exit(f"bench_zero: {label} failed (exit {p.returncode}): {last}")
        with open(log) as f:
            *rows, summary = [json.loads(line) for line in f]
    rows = rows[1:]                                     # the warm-up step left out
    return {"step": [r["step_time"] for r in rows], "fwd": [r["zero_gather_wait_s"]["forward"] for r in rows],
            "bwd": [r["zero_gather_wait_s"]["backward"] for r in rows], "zero": summary["zero"]}


def pooled(runs: list[dict]) -> dict:
    med = {f: statistics.median(x for r in runs for x in r[f]) for f in ("step", "fwd", "bwd")}
    zs = [r["zero"] for r in runs]
    return {**med, "peak": max(z["gathered_peak_bytes"] for z in zs), "peak_formula": zs[0]["gathered_peak_formula"],
            "sent": max(z["bytes_per_step"] for z in zs), "theory": zs[0]["theory_bytes_per_step"],
            "exact": all(z["gathered_peak_bytes"] == z["gathered_peak_formula"]
                         and z["bytes_per_step"] == z["theory_bytes_per_step"] for z in zs)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the smoke test: a smaller model, 2 timed steps, 1 round")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="dp ranks of each setting [2 4]")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[0, 1, 2], metavar="K", help="[0 1 2]")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run [6; --quick 2]")
    ap.add_argument("--repeats", type=int, default=None, help="rounds of runs [2; --quick 1]")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run [600]")
    a = ap.parse_args(argv)
    a.steps = a.steps if a.steps is not None else 2 if a.quick else 6
    a.repeats = a.repeats if a.repeats is not None else 1 if a.quick else 2
    bad = [f"--{k} {v}" for k, v in (("ranks", min(a.ranks)), ("prefetch", min(a.prefetch) + 1),
                                      ("steps", a.steps), ("repeats", a.repeats)) if v < 1]
    if bad or not a.timeout > 0:
        ap.error(f"{bad[0] if bad else f'--timeout {a.timeout}'}: must be >= 1 (--prefetch >= 0, --timeout > 0)")
    if 0 not in a.prefetch:
        a.prefetch = [0, *a.prefetch]                   # the thing to beat
    model = QUICK if a.quick else MODEL
    settings = [(n, K, "on") for n in a.ranks for K in sorted(set(a.prefetch))] + [(n, 0, "off") for n in a.ranks]
    got = {s: [] for s in settings}
    for _ in range(a.repeats):
        for s in settings:
            got[s].append(run(model, *s, a))
    m = {s: pooled(rs) for s, rs in got.items()}
    cores = os.cpu_count() or 1
    print(f"ZeRO-3 gathers: {' '.join(model)}, float32; medians of {a.steps} timed step(s) x {a.repeats} run(s); "
          f"{cores} core(s)" + ("; more ranks than cores: the ranks take turns" if max(a.ranks) > cores else ""))
    head = (f"{'ranks':>5} {'prefetch':>8} {'reshard':>7} {'step ms':>8} {'vs K=0':>6} {'wait fwd ms':>11} "
            f"{'wait bwd ms':>11} {'gathered MiB':>12} {'formula':>8} {'ratio':>6} {'zero MiB/step':>13} "
            f"{'formula':>8} {'ratio':>6}")
    print(head + "\n" + "-" * len(head))
    exact = True
    for (n, K, reshard), r in m.items():
        base = m[(n, 0, "on")]["step"]
        exact &= r["exact"]
        print(f"{n:5d} {K:8d} {reshard:>7} {r['step'] * 1e3:8.1f} {base / r['step']:6.2f} {r['fwd'] * 1e3:11.1f} "
              f"{r['bwd'] * 1e3:11.1f} {r['peak'] / MiB:12.3f} {r['peak_formula'] / MiB:8.3f} "
              f"{r['peak'] / r['peak_formula']:6.3f} {r['sent'] / MiB:13.3f} {r['theory'] / MiB:8.3f} "
              f"{r['sent'] / r['theory']:6.3f}")
    if not exact:
        sys.exit("bench_zero: a run's bytes or gathered peak differ from the formula (ratio above)")


if __name__ == "__main__":
    main()
