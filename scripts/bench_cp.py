"""Context parallelism's four implementations in the trainer, side by side, against one process:

    python scripts/bench_cp.py                  # about 2 minutes on 2 cores, the cluster rows included
    python scripts/bench_cp.py --quick          # a smaller model, 1 run of 2 timed steps: the smoke test
    python scripts/bench_cp.py --impls ring ulysses --steps 8 --no-cluster

Each run is `mpirun -n C python -m minipar.train --cp C --cp-impl IMPL` on one model (GPT-2,
L 2, H 4, C 128, T 1024, B 4, float32; --quick: C 64, T 256, B 2), one BLAS thread per rank,
1 warm-up step then --steps timed ones, read from the trainer's --log (its rows, and the
summary's context_parallel object); --repeats runs of each setting, one setting after another
in rounds so that the machine's drift hits all alike. cp 1 (one process, no --cp) is the thing
to beat.
    ring, ulysses, allgather   at cp 2 and cp 4
    hybrid                     cp 4: --cp-ulysses 2, Ulysses inside pairs of consecutive
                               ranks, the ring across the 2 pairs; cp 2: --cp-ulysses 2, the
                               trainer's default on one host, which is Ulysses alone
cp 4 on a 2-core machine is 4 ranks on 2 cores: oversubscribed, the output says so.

Columns:
  step ms        the median of step_time over the timed steps of its runs (rank 0's log)
  speed-up       cp 1's step ms / this row's: above 1, faster than one process
  cp wait ms     the median of cp_wait_s, the same way (rank 0's): what the rank waited
                 for its attention's messages (ring steps, all-to-alls, all-gather), not hidden
  cp bytes/step  what a rank sent over its cp group per step (the summary's bytes_per_step:
                 the ledger, axis cp), beside the trainer's formula (theory_bytes_per_step,
                 context_parallel.step_traffic) and their ratio; the bytes do not depend on
                 the timing, so any ratio but 1 makes the script exit 1
  act MiB        the saved activations of one step (Tensor.saved_bytes of the loss's graph
                 before the first backward, the pipeline's measure of its peak; the trainer
                 reports it only with --pp, so the script counts it in each rank: the
                 largest), beside the planner's (minipar.plan: memory_per_stage[0]
                 ["activations"], the trainer's --dry-run figure) where it plans this
                 --cp-impl, and their ratio

Where network namespaces can be made (root; scripts/cluster.py), cp 4 runs again on the
emulated cluster, 2 hosts x 2 ranks, each host's link --rate each way: ranks 0, 1 on h0 and
2, 3 on h1 (hybrid's Ulysses pairs inside a host, its ring across), and hybrid once more
round robin (ranks 0, 2 on h0: the pairs across, the ring inside). Its columns: step ms,
the one-host cp 4 row's step ms / this one, the cp wait, the bytes ratio, and the cp bytes
that crossed hosts per step (the ledger's inter-host bytes, axis cp: every rank's summed,
and rank 0's beside the planner's for rank 0, --ranks-per-host 2, where it plans this
--cp-impl). The cluster is removed at the end, on failure too; elsewhere one line says
the cluster rows are skipped. The runs go one after another; each prints a line on stderr.
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

IMPLS = ("ring", "ulysses", "allgather", "hybrid")
MODEL = ["--n-layer", "2", "--n-head", "4", "--n-embd", "128", "--block-size", "1024", "--batch-size", "4"]
QUICK = ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--block-size", "256", "--batch-size", "2"]
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PREFIX = f"mpc-b{os.getpid()}-"             # this run's cluster: apart from `cluster.py up`'s and the tests'
MiB = 1 << 20


# --- inside each rank: the trainer, with the two figures it does not report here -----------------

def probe(out: str, argv: list[str]):
    """python -m minipar.train argv, counting on this rank what the trainer reports only with
    --pp (the saved activations of a step) or only on rank 0 (a step's inter-host cp bytes);
    written to out.<rank>.json."""
    from minipar.autograd.tensor import Tensor
    from minipar.train import trainer
    from mpi4py import MPI
    peak, across = [], []
    backward, step_row = Tensor.backward, trainer.step_row

    def counted_backward(self, *a, **k):
        if not peak:                                    # step 0, the warm-up: not timed
            peak.append(self.saved_bytes())
        return backward(self, *a, **k)

    def counted_row(*a, **k):
        row = step_row(*a, **k)
        across.append(row["inter_host_bytes_by_axis"].get("cp", 0))
        return row

    Tensor.backward, trainer.step_row = counted_backward, counted_row
    trainer.main(argv)
    with open(f"{out}.{MPI.COMM_WORLD.rank}.json", "w") as f:
        json.dump({"peak": peak[0], "across": across}, f)


# --- the parent: runs, reads, prints ----------------------------------------------------------------

def layout(impl: str, cp: int) -> list[str]:
    if cp == 1:
        return []
    return ["--cp", str(cp), "--cp-impl", impl] + (["--cp-ulysses", "2"] if impl == "hybrid" else [])


def train(launch, model, impl, cp, args, where="", **placement) -> dict:
    """One trainer run (launch(n, argv, **placement) -> CompletedProcess) -> its figures."""
    label = "one process (cp 1)" if cp == 1 else f"{impl} cp {cp}{where}"
    print(f"# {label}, load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        log, out = os.path.join(tmp, "log.jsonl"), os.path.join(tmp, "probe")
        argv = [sys.executable, os.path.abspath(__file__), "--probe", out, *model, *layout(impl, cp),
                "--steps", str(args.steps + 1), "--sample", "0", "--log", log, "--log-every", str(args.steps + 1)]
        try:
            p = launch(cp, argv, **placement)
        except subprocess.TimeoutExpired:
            sys.exit(f"bench_cp: {label} ran past --timeout {args.timeout:g} s")
        if p.returncode:
            last = (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or ["no output"])[-1]
            sys.exit(f"bench_cp: {label} failed (exit {p.returncode}): {last}")
        with open(log) as f:
            *rows, summary = [json.loads(line) for line in f]
        ranks = []
        for r in range(cp):
            with open(f"{out}.{r}.json") as f:
                ranks.append(json.load(f))
    ctx = summary.get("context_parallel") or {"bytes_per_step": 0, "theory_bytes_per_step": 0}
    return {"label": label, "steps": [r["step_time"] for r in rows[1:]], "waits": [r["cp_wait_s"] for r in rows[1:]],
            "sent": ctx["bytes_per_step"], "theory": ctx["theory_bytes_per_step"],
            "peak": max(rk["peak"] for rk in ranks), "across": [rk["across"][1:] for rk in ranks]}


def pooled(runs: list[dict]) -> dict:
    """A setting's runs (one per round) -> the medians over all their timed steps; the bytes
    and the peak, which do not depend on the timing, from every run: exact only if every
    run's bytes equal the formula."""
    def median(field):
        return statistics.median(x for run in runs for x in run[field])
    return {"label": runs[0]["label"], "step_s": median("steps"), "wait_s": median("waits"),
            "sent": max(run["sent"] for run in runs), "theory": runs[0]["theory"],
            "exact": all(run["sent"] == run["theory"] for run in runs),
            "peak": max(run["peak"] for run in runs),
            "across": [statistics.median(x for run in runs for x in run["across"][r])
                       for r in range(len(runs[0]["across"]))]}


def planned(model, impl, cp, hosts=()):
    """The planner's plan for these trainer flags (minipar.plan, in this process), or None when
    it does not take this --cp-impl (it then plans the ring whatever the flag)."""
    from minipar.plan import hosts as plan_hosts, table
    args, unknown = table.build_parser().parse_known_args([*model, *layout(impl, cp), *hosts])
    if unknown:                                         # no --cp-impl: it plans the ring
        if impl != "ring":
            return None
        args = table.build_parser().parse_args([*model, "--cp", str(cp), *hosts])
    cfg, lay, _ = table.resolve(args)
    return table.plan(cfg, lay, hosts=plan_hosts.Hosts.from_args(args))


def local(n, argv, timeout):
    """mpirun -n n argv on this machine."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "mpirun"), "-n", str(n), *argv]
    return subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **ENV), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def ratio(a, b, fmt="{:.6f}"):
    return fmt.format(a / b) if b else "-"


def framed(head: str, rows: list[str]) -> list[str]:
    return [head, "-" * len(head), *rows]


def one_host(runs, model) -> list[str]:
    base = runs[("-", 1)]["step_s"]
    out = []
    for (impl, cp), m in runs.items():
        plan = planned(model, impl, cp)
        formula = plan["memory_per_stage"][0]["activations"] if plan else None
        out.append(f"{impl:9} {cp:2d} {m['step_s'] * 1e3:8.1f} {base / m['step_s']:8.2f} {m['wait_s'] * 1e3:10.1f} "
                   f"{m['sent']:14,.0f} {m['theory']:14,d} {ratio(m['sent'], m['theory']):>8} "
                   f"{m['peak'] / MiB:9.2f} {'-' if formula is None else f'{formula / MiB:.2f}':>9} "
                   f"{ratio(m['peak'], formula or 0, '{:.4f}'):>6}")
    return framed(f"{'impl':9} {'cp':>2} {'step ms':>8} {'speed-up':>8} {'cp wait ms':>10} {'cp bytes/step':>14} "
                 f"{'formula':>14} {'ratio':>8} {'act MiB':>9} {'formula':>9} {'ratio':>6}", out)


CLUSTER = {"2x2": [("h0", 2), ("h1", 2)], "round robin": [("h0", 1), ("h1", 1)]}


def cluster_part(args, model, runs) -> tuple[list[str], list[dict]]:
    """cp 4 on 2 hosts x 2 ranks: (the lines to print, the figures), or one line if it cannot run."""
    import cluster
    why = cluster.unavailable()
    if why:
        return [f"cluster rows skipped: {why}"], []
    for ns in cluster.namespaces():                     # what a killed run of this script left
        m = re.match(r"mpc-b(\d+)-", ns)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            cluster.down(m.group(0))
    gbps = cluster.rate_bytes_per_s(args.rate) * 8 / 1e9
    todo = [(impl, "2x2") for impl in args.impls] + ([("hybrid", "round robin")] if "hybrid" in args.impls else [])
    rounds = {key: [] for key in todo}
    with cluster.Cluster(hosts=2, ranks_per_host=2, rate=args.rate, prefix=PREFIX) as c:
        def launch(n, argv, hosts):
            return c.mpirun(n, argv, hosts=hosts, env=ENV, timeout=args.timeout)
        for _ in range(args.repeats):
            for impl, placement in todo:
                rounds[(impl, placement)].append(train(launch, model, impl, 4, args, f" {placement} on the cluster",
                                                       hosts=CLUSTER[placement]))
    got = {key: pooled(done) for key, done in rounds.items()}
    out = []
    for (impl, placement), m in got.items():
        plan = planned(model, impl, 4, ["--ranks-per-host", "2", "--inter-node-gbps", f"{gbps:g}"]) \
            if placement == "2x2" else None
        want = plan["comm_per_stage"][0]["inter_host"].get("cp", 0) if plan else None
        alone = runs.get((impl, 4))
        out.append(f"{impl:9} {placement:11} {m['step_s'] * 1e3:8.1f} "
                   f"{ratio(alone['step_s'], m['step_s'], '{:.2f}') if alone else '-':>9} "
                   f"{m['wait_s'] * 1e3:10.1f} {ratio(m['sent'], m['theory']):>8} {sum(m['across']) / 1024:16.1f} "
                   f"{m['across'][0] / 1024:10.1f} {'-' if want is None else f'{want / 1024:.1f}':>10}")
    head = (f"{'impl':9} {'placement':11} {'step ms':>8} {'vs 1 host':>9} {'cp wait ms':>10} {'ratio':>8} "
            f"{'across KiB (all)':>16} {'rank 0 KiB':>10} {'planned r0':>10}")
    lines = [f"cp 4 on the emulated cluster: 2 hosts, each link {args.rate} each way; 2x2: ranks 0,1 on h0 and "
             f"2,3 on h1; round robin: 0,2 on h0 and 1,3 on h1 (hybrid's Ulysses pairs across)"]
    notes = ["vs 1 host = the one-host cp 4 step / this step; ratio: cp bytes/step / the trainer's formula; across: "
             "cp bytes that left the host per step (ledger), all ranks summed and rank 0's; planned r0: the "
             "planner's for rank 0 (--ranks-per-host 2), '-' where it does not plan this --cp-impl or placement"]
    return lines + framed(head, out) + notes, list(got.values())


def parse_args(argv):
    class Parser(argparse.ArgumentParser):
        def error(self, message):                       # one line, exit 2
            self.exit(2, f"bench_cp.py: error: {message}\n")

    ap = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per run after 1 warm-up [5; --quick 2]")
    ap.add_argument("--repeats", type=int, default=None, help="runs of each setting, alternated [2; --quick 1]")
    ap.add_argument("--quick", action="store_true", help="a smaller model (C 64, T 256, B 2): the smoke test")
    ap.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS), help="which --cp-impl [all four]")
    ap.add_argument("--no-cluster", action="store_true", help="leave out the emulated cluster's rows")
    ap.add_argument("--rate", default="1gbit", help="the cluster's links, each way (a tc rate) [1gbit]")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per trainer run [600]")
    args = ap.parse_args(argv)
    args.steps = args.steps if args.steps is not None else 2 if args.quick else 5
    args.repeats = args.repeats if args.repeats is not None else 1 if args.quick else 2
    if not 1 <= args.steps <= 1000:
        ap.error(f"--steps must be 1..1000, got {args.steps}")
    if not 1 <= args.repeats <= 100:
        ap.error(f"--repeats must be 1..100, got {args.repeats}")
    if not 0 < args.timeout < float("inf"):
        ap.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    import cluster
    try:
        cluster.rate_bytes_per_s(args.rate)
    except ValueError as e:
        ap.error(f"--rate: {e}")
    args.impls = [i for i in IMPLS if i in args.impls]
    return args


def stop(signum, frame):
    sys.exit(f"bench_cp: stopped by signal {signum}")   # SystemExit: the cluster's `with` removes it


def main():
    if sys.argv[1:2] == ["--probe"]:
        return probe(sys.argv[2], sys.argv[3:])
    args = parse_args(sys.argv[1:])
    signal.signal(signal.SIGTERM, stop)

    def launch(n, argv):
        return local(n, argv, args.timeout)
    model = QUICK if args.quick else MODEL
    cores = len(os.sched_getaffinity(0))
    start, load0 = time.monotonic(), os.getloadavg()
    rounds = {key: [] for key in [("-", 1)] + [(impl, cp) for cp in (2, 4) for impl in args.impls]}
    for _ in range(args.repeats):                       # alternated: the machine's drift hits all alike
        for (impl, cp), done in rounds.items():
            done.append(train(launch, model, impl, cp, args))
    runs = {key: pooled(done) for key, done in rounds.items()}
    lines, more = ([], []) if args.no_cluster else cluster_part(args, model, runs)
    load1 = os.getloadavg()

    def load(x):
        return "/".join(f"{v:.2f}" for v in x) + ("  (above 2.5: shared, expect noisy times)" if x[0] > 2.5 else "")
    shape = ", ".join(f"{k} {v}" for k, v in zip("LHCTB", model[1::2]))
    print(f"context parallelism, GPT-2 {shape}, float32, 1 BLAS thread per rank; {args.repeats} run(s) of each "
          f"setting, alternated, each 1 warm-up step and {args.steps} timed: the median over the timed steps; "
          f"{cores} cores, load average (1, 5, 15 min) at start {load(load0)}")
    print(f"cp 2: 2 ranks on {cores} cores; cp 4: 4 ranks on {cores} cores"
          + (f", oversubscribed ({4 / cores:g} ranks per core: a rank's step includes waiting for a core, and "
             f"its cp waits the other ranks' compute)" if 4 > cores else ""))
    if "hybrid" in args.impls:
        print("hybrid: --cp-ulysses 2 (cp 2: Ulysses alone; cp 4: Ulysses inside rank pairs, the ring across them)")
    print()
    print("\n".join(one_host(runs, model)))
    print("speed-up = cp 1's step / this step; ratio: cp bytes/step / the trainer's formula; act MiB: the saved "
          "activations of a step, the largest rank; formula: the planner's, '-' where it does not plan this --cp-impl")
    if lines:
        print()
        print("\n".join(lines))
    print(f"\nload average at end {'/'.join(f'{v:.2f}' for v in load1)} (with this script's own ranks); "
          f"{time.monotonic() - start:.0f} s in all")
    wrong = [m["label"] for m in [*runs.values(), *more] if not m["exact"]]
    if wrong:
        sys.exit(f"bench_cp: cp bytes per step differ from the trainer's formula (ratio not 1) for {', '.join(wrong)}")


if __name__ == "__main__":
    main()
