"""Communication across hosts, on the emulated cluster (scripts/cluster.py: 2 hosts x 2 ranks,
a rate-limited link per host), in one run:

    python scripts/bench_cluster.py                 # needs root and ip netns; 5 minutes here
    python scripts/bench_cluster.py --rate 1gbit --sizes 1 4 16 64 --steps 12

1. all-reduce of 1 to 64 MiB float32: the flat ring, flat direct exchange (what p = 4 runs on
   one host), the hierarchical all-reduce (minipar/comm/algorithms/hierarchical.py) and MPI's own
   Allreduce (allowed here, in a benchmark, as the thing to beat): the slowest rank's time,
   the bytes that crossed the link (the ledger's bytes_sent_inter, summed over ranks) beside
   the formula, and the link's floor (those bytes per direction / the rate).
2. a dp = 4 training step: bucketed (overlapped with backward) and naive (after it), each
   with and without the hierarchy (MINIPAR_HIERARCHICAL=0): step time and exposed
   communication (the log's medians, first step left out), bytes across hosts per step.
3. dp 2 x tp 2 with tp inside a host (-hosts h0:2,h1:2: ranks 0,1 on h0) and across hosts
   (round robin: ranks 0,2 on h0): the figure behind "keep tensor parallelism inside a node".
4. all-to-all of 4 KiB to 16 MiB: the flat pairwise exchange, the hierarchical all-to-all
   (minipar/comm/algorithms/hierarchical_alltoall.py) and MPI's own Alltoall: the slowest rank's time,
   bytes across hosts (all ranks) beside hierarchical_alltoall.bytes_sent, messages across.
   (--parts alltoall: this part alone, about a minute.)
5. ZeRO-3, flat and hybrid (--shard-group host), each plain and with ZeRO++ (int8 blocks of
   256: qwZ, qgZ, and hpZ where the shard group spans hosts): step time, ZeRO's bytes per
   step, and the bytes across hosts beside the trainer's formula (exit 1 unless equal).
   (--parts zero)
Beside each training row, the planner's prediction (python -m minipar.plan --ranks-per-host
--inter-node-gbps --intra-node-gbps) of the bytes across hosts and the link time.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
MODEL = ["--n-layer", "4", "--n-head", "4", "--n-embd", "128", "--block-size", "64", "--batch-size", "16"]
MiB = 1 << 20


# --- the worker: runs inside the cluster under mpiexec ---------------------------------------------

def worker(sizes, repeats, parts):
    import numpy as np
    from mpi4py import MPI

    from minipar import comm
    from minipar.comm.algorithms import direct, hierarchical, ring
    world = MPI.COMM_WORLD
    g = comm.Group(world, axis="world")
    if "alltoall" in parts:
        alltoall_worker(g, world, repeats)
    if "allreduce" not in parts:
        return
    algorithms = {"ring (flat)": ring.all_reduce, "direct (flat)": direct.all_reduce,
                  "hierarchical": hierarchical.all_reduce,
                  "MPI Allreduce": lambda g_, x: world.Allreduce(MPI.IN_PLACE, x)}
    for mib in sizes:
        x = np.ones(mib * MiB // 4, np.float32)
        for name, f in algorithms.items():
            f(g, x.copy())                                      # warm-up
            times = []
            comm.reset_traffic()
            for _ in range(repeats):
                y = x.copy()
                t0 = time.perf_counter()
                f(g, y)
                times.append(time.perf_counter() - t0)
            led = comm.traffic_by_axis().get("world", {})
            inter = led.get("bytes_sent_inter", 0) // repeats if name != "MPI Allreduce" else None
            mine = np.array([statistics.median(times), inter or 0], np.float64)
            everyone = np.empty((g.size, 2)) if g.rank == 0 else None
            world.Gather(mine, everyone, root=0)
            if g.rank == 0:
                print(json.dumps({"mib": mib, "algorithm": name, "seconds": float(everyone[:, 0].max()),
                                  "inter_bytes": None if inter is None else float(everyone[:, 1].sum()),
                                  "hosts": list(g.hosts), "nodes": list(g.nodes)}), flush=True)


A2A_KIB = [4, 64, 256, 1024, 16384]


def alltoall_worker(g, world, repeats):
    import numpy as np

    from minipar import comm
    from minipar.comm.algorithms import alltoall, hierarchical_alltoall
    algorithms = {"pairwise (flat)": alltoall.pairwise, "hierarchical": hierarchical_alltoall.all_to_all,
                  "MPI Alltoall": lambda g_, x: world.Alltoall(x, np.empty_like(x))}
    for kib in A2A_KIB:
        x = np.ones(kib * 1024 // 4, np.float32)
        for name, f in algorithms.items():
            f(g, x)                                             # warm-up
            comm.reset_traffic()
            times = []
            for _ in range(repeats * 3):
                world.Barrier()
                t0 = time.perf_counter()
                f(g, x)
                times.append(time.perf_counter() - t0)
            led = comm.traffic_by_axis().get("world", {})
            mine = np.array([statistics.median(times), led.get("bytes_sent_inter", 0) / (repeats * 3)])
            everyone = np.empty((g.size, 2)) if g.rank == 0 else None
            world.Gather(mine, everyone, root=0)
            if g.rank == 0:
                theory = sum(hierarchical_alltoall.bytes_sent(g.nodes, r, x.nbytes // g.size)[1]
                             for r in range(g.size))
                msgs = (sum(hierarchical_alltoall.messages(g.nodes, r)[1] for r in range(g.size))
                        if name == "hierarchical" else sum(n != g.nodes[r] for r in range(g.size) for n in g.nodes))
                print(json.dumps({"part": "alltoall", "kib": kib, "algorithm": name,
                                  "seconds": float(everyone[:, 0].max()),
                                  "inter_bytes": None if name.startswith("MPI") else float(everyone[:, 1].sum()),
                                  "formula": theory, "messages": msgs}), flush=True)


def print_alltoall(rows):
    print("\n4. all-to-all of float32: the slowest rank's median time; bytes that "
          "crossed hosts (all ranks) and hierarchical_alltoall.bytes_sent's; messages across hosts "
          "(all ranks; MPI's: as the flat exchange's)")
    print(f"{'KiB':>6} {'algorithm':16} {'time ms':>9} {'across KiB':>11} {'formula':>9} {'messages':>9} "
          f"{'vs flat':>8}")
    flat = {r["kib"]: r["seconds"] for r in rows if r["algorithm"] == "pairwise (flat)"}
    for r in rows:
        across = "-" if r["inter_bytes"] is None else f"{r['inter_bytes'] / 1024:.1f}"
        print(f"{r['kib']:>6} {r['algorithm']:16} {r['seconds'] * 1e3:9.3f} {across:>11} "
              f"{r['formula'] / 1024:9.1f} {r['messages']:>9} {r['seconds'] / flat[r['kib']]:8.2f}")


# --- the parent: builds the cluster, runs, prints ---------------------------------------------------

def theory_inter(algorithm, n, N=2, k=2):
    """Bytes crossing hosts per all-reduce of n bytes, summed over ranks (hosts hold
    consecutive ranks): hierarchical 2(N-1)/N n/k per rank; the flat ring 2(p-1)/p n from each
    of the N boundary ranks; direct exchange (p-1)/p n... from each rank, the share of its
    peers on other hosts: 2 n (p - k)/p per rank."""
    p = N * k
    return {"ring (flat)": N * 2 * (p - 1) / p * n, "direct (flat)": p * 2 * n * (p - k) / p,
            "hierarchical": p * 2 * (N - 1) / N * n / k}.get(algorithm)


def train(c, flags, env=None, hosts=None):
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        p = c.mpirun(4, ["python", "-m", "minipar.train", *MODEL, *flags, "--sample", "0", "--log", log],
                     env=env, hosts=hosts, timeout=900)
        if p.returncode != 0:
            sys.exit(f"training failed ({flags}):\n{p.stderr[-3000:]}")
        *rows, summary = [json.loads(line) for line in open(log)]
        rows = rows[1:]
    return {"step_s": statistics.median(r["step_time"] for r in rows), "zero": summary.get("zero"),
            "exposed_s": statistics.median(r["exposed_comm_s"] for r in rows),
            "inter": statistics.median(sum(r["inter_host_bytes_by_axis"].values()) for r in rows),
            "by_axis": rows[-1]["inter_host_bytes_by_axis"]}


def planned(flags, ranks_per_host, gbps):
    """The planner's across-host bytes and link time per step (None if it cannot say)."""
    cmd = [sys.executable, "-m", "minipar.plan", *MODEL, *flags, "--ranks-per-host", str(ranks_per_host),
           "--inter-node-gbps", str(gbps), "--intra-node-gbps", "100", "--json"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        return None
    return json.loads(p.stdout).get("hosts")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64], metavar="MiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--parts", nargs="+", choices=["allreduce", "train", "alltoall", "zero"],
                    default=["allreduce", "train", "alltoall", "zero"], help="which parts to run (default: all)")
    ap.add_argument("--hosts", type=int, default=2, help="hosts of the cluster (--parts alltoall)")
    ap.add_argument("--ranks-per-host", type=int, default=2, help="ranks on each host (--parts alltoall)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a.sizes, a.repeats, a.parts)
    import cluster
    why = cluster.unavailable()
    if why:
        sys.exit(f"bench_cluster: {why}")
    gbps = cluster.rate_bytes_per_s(a.rate) * 8 / 1e9
    if (a.hosts, a.ranks_per_host) != (2, 2) and a.parts != ["alltoall"]:
        sys.exit("bench_cluster: --hosts and --ranks-per-host are for --parts alltoall alone "
                 "(parts 1-3 are written for 2 hosts x 2 ranks)")
    n = a.hosts * a.ranks_per_host
    with cluster.Cluster(hosts=a.hosts, ranks_per_host=a.ranks_per_host, rate=a.rate) as c:
        print(f"cluster: {a.hosts} hosts x {a.ranks_per_host} ranks, each host's link {a.rate} "
              f"({gbps * 125:.0f} MB/s) each way")
        p = c.mpirun(n, ["python", os.path.abspath(__file__), "--worker", "--sizes", *map(str, a.sizes),
                         "--repeats", str(a.repeats), "--parts", *a.parts], timeout=1800)
        if p.returncode != 0:
            sys.exit(f"worker failed:\n{p.stderr[-3000:]}")
        rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
        if "alltoall" in a.parts:
            print_alltoall([r for r in rows if r.get("part") == "alltoall"])
        rows = [r for r in rows if r.get("part") != "alltoall"]
        if "allreduce" in a.parts:
            print_allreduce(rows, gbps)
        if "train" in a.parts:
            train_parts(c, a, gbps)
        if "zero" in a.parts:
            zero_part(c, a)


def print_allreduce(rows, gbps):
    print("\n1. all-reduce of float32, 4 ranks on 2 hosts: the slowest rank's median time; bytes that "
          "crossed hosts (all ranks) and the formula; link floor = those bytes / 2 directions / rate")
    print(f"{'MiB':>4} {'algorithm':15} {'time ms':>9} {'across MiB':>11} {'formula':>9} {'floor ms':>9}")
    for r in rows:
        n = r["mib"] * MiB
        t = theory_inter(r["algorithm"], n)
        floor = (r["inter_bytes"] / 2 / (gbps * 125e6) * 1e3) if r["inter_bytes"] else float("nan")
        print(f"{r['mib']:>4} {r['algorithm']:15} {r['seconds'] * 1e3:9.1f} "
              + (f"{r['inter_bytes'] / MiB:11.2f} {t / MiB:9.2f} {floor:9.1f}" if r["inter_bytes"] is not None
                 else f"{'-':>11} {'-':>9} {'-':>9}"))


def train_parts(c, a, gbps):
    """Parts 2 and 3: the training runs, alternated --repeats times so that the machine's drift
    hits all alike."""
    runs = {}
    for mode in ("bucketed", "naive"):
        for hier in ("on", "off"):
            runs[(mode, hier)] = (["--dp", "4", "--dp-mode", mode, "--steps", str(a.steps)],
                                  {"MINIPAR_HIERARCHICAL": "1" if hier == "on" else "0"}, None)
    for name, hosts in (("inside", [("h0", 2), ("h1", 2)]), ("across", [("h0", 1), ("h1", 1)])):
        runs[("tp", name)] = (["--dp", "2", "--tp", "2", "--steps", str(a.steps)], None, hosts)
    got = {key: [] for key in runs}
    for _ in range(a.repeats):
        for key, (flags, env, hosts) in runs.items():
            got[key].append(train(c, flags, env=env, hosts=hosts))
    m = {key: {f: statistics.median(r[f] for r in rs) for f in ("step_s", "exposed_s", "inter")}
         | {"by_axis": rs[-1]["by_axis"]} for key, rs in got.items()}
    print(f"\n2. a dp=4 training step (default model, float32): step and exposed communication, "
          f"the median over {a.repeats} alternated runs of each run's median; bytes across hosts "
          f"per step (rank 0); the planner's, and its link time for them (one rank's bytes at the "
          f"link's rate; a host's 2 ranks share the link)")
    print(f"{'dp mode':10} {'hierarchy':10} {'step ms':>8} {'exposed ms':>11} {'across KiB':>11} "
          f"{'planned KiB':>12} {'planned link ms':>16}")
    for mode in ("bucketed", "naive"):
        for hier in ("on", "off"):
            r = m[(mode, hier)]
            plan = planned(["--dp", "4", "--dp-mode", mode], 2, gbps) if hier == "on" else None
            print(f"{mode:10} {hier:10} {r['step_s'] * 1e3:8.1f} {r['exposed_s'] * 1e3:11.1f} "
                  f"{r['inter'] / 1024:11.1f} "
                  + (f"{plan['inter_bytes_total'] / 1024:12.1f} {plan['link_seconds'] * 1e3:16.1f}"
                     if plan else f"{'-':>12} {'-':>16}"))
    print("\n3. dp 2 x tp 2: tp inside a host, or across hosts (medians as above)")
    print(f"{'tp':8} {'placement':22} {'step ms':>8} {'across KiB (tp)':>16} {'across KiB (dp)':>16}")
    for name in ("inside", "across"):
        r = m[("tp", name)]
        where = "h0: 0,1  h1: 2,3" if name == "inside" else "h0: 0,2  h1: 1,3"
        print(f"{name:8} {where:22} {r['step_s'] * 1e3:8.1f} {r['by_axis'].get('tp', 0) / 1024:16.1f} "
              f"{r['by_axis'].get('dp', 0) / 1024:16.1f}")


ZERO = {"flat ZeRO-3": [], "hybrid (--shard-group host)": ["--shard-group", "host"],
        "flat + ZeRO++ (qwZ hpZ qgZ)": ["--qwz", "256", "--hpz", "--qgz", "256"],
        "hybrid + ZeRO++ (qwZ qgZ)": ["--shard-group", "host", "--qwz", "256", "--qgz", "256"]}


def zero_part(c, a):
    """Part 5: ZeRO-3 on the two hosts, flat (its collectives hierarchical across the link)
    and hybrid (shard groups of a host: only the replicas' all-reduce crosses), each plain and
    with ZeRO++'s int8 messages, alternated
    --repeats times; bytes across per step against the trainer's formula (comm.sent)."""
    got = {name: [] for name in ZERO}
    for _ in range(a.repeats):
        for name, flags in ZERO.items():
            got[name].append(train(c, ["--dp", "4", "--zero", "3", "--steps", str(a.steps), *flags]))
    print(f"\n5. ZeRO-3 on 2 hosts x 2 ranks (default model, float32): step (median over {a.repeats} alternated "
          f"runs), ZeRO's bytes per step and rank: in all, and across hosts (rank 0) beside the formula")
    print(f"{'sharding':30} {'step ms':>8} {'zero MiB':>9} {'across MiB':>11} {'formula':>9} {'ratio':>6} "
          f"{'vs flat':>8}")
    flat = None
    exact = True
    for name, runs in got.items():
        z = runs[-1]["zero"]
        across, formula = z["inter_host_bytes_per_step"], z["theory_inter_host_bytes_per_step"]
        exact &= all(r["zero"]["inter_host_bytes_per_step"] == formula for r in runs)
        flat = flat or across
        print(f"{name:30} {statistics.median(r['step_s'] for r in runs) * 1e3:8.1f} "
              f"{z['bytes_per_step'] / MiB:9.2f} {across / MiB:11.3f} {formula / MiB:9.3f} "
              f"{across / formula:6.3f} {across / flat:8.3f}")
    if not exact:
        sys.exit("bench_cluster: ZeRO's bytes across hosts differ from the formula (ratio above)")


if __name__ == "__main__":
    main()
