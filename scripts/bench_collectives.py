"""minipar.comm against MPI's own collectives, in the same run: all_reduce, reduce_scatter,
all_gather for p = 2, 3, 4 and 4 KiB to 64 MiB of float32; all_to_all up to 16 MiB.

    python scripts/bench_collectives.py                 # the whole table (runs mpirun itself)
    python scripts/bench_collectives.py --procs 4 --max-size 4MiB
    mpirun -n 4 python scripts/bench_collectives.py     # only p = 4 (the world's size)
    python scripts/bench_collectives.py --crossover     # each algorithm alone: where does the
                                                        # ring overtake recursive doubling?
    python scripts/bench_collectives.py --ops all_to_all --procs 4     # one op, one p

Definitions (nccl-tests). S is the message size in bytes: x for all_reduce, reduce_scatter
and all_to_all, the gathered result for all_gather. t is the time per call: the median over
rounds of K back-to-back calls, on the slowest rank. algbw = S / t; busbw = algbw * 2(p-1)/p
for all_reduce and algbw * (p-1)/p for reduce_scatter, all_gather and all_to_all (the rate
each rank's link runs at, comparable across p). ratio = t(MPI) / t(minipar): above 1,
minipar is faster.

all_to_all (equal split, against MPI's Alltoall in its buffer form) gets a table of its own:
minipar's dispatcher (out=) and each of its algorithms alone, pairwise exchange and Bruck.

Both sides get preallocated output buffers (minipar's out=, MPI's recvbuf), as in nccl-tests;
the `new` column is minipar's default call, which returns a fresh array (for large sizes
that array's first touch, page faults included, is part of the time). Rounds alternate
between the variants so that a change in machine load hits all of them alike.

`floor`: the same exchange written straight on mpi4py, with nothing of minipar around it
(floor()); floor ratio = t(MPI) / t(floor). For reduce_scatter and all_gather at every size
(one round of direct exchange, minipar's algorithm there), for all_reduce up to 64 KiB (one
round; minipar's large all_reduce takes two). At 4 KiB a floor ratio below 0.67 means no
library written on mpi4py's non-blocking point-to-point can be within 1.5x of MPI here; at
1 MiB one below 1.0, that this algorithm on mpi4py cannot reach 1.0.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

FLOOR_MAX_BYTES = 64 << 10                      # the floor column of all_reduce (floor())
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
ALL_TO_ALL_MAX_BYTES = 16 << 20                 # all_to_all's default sizes stop here
OPS = ["all_reduce", "reduce_scatter", "all_gather", "all_to_all"]
BUS = {"all_reduce": lambda p: 2 * (p - 1) / p, "reduce_scatter": lambda p: (p - 1) / p,
       "all_gather": lambda p: (p - 1) / p, "all_to_all": lambda p: (p - 1) / p,
       "broadcast": lambda p: 1.0, "reduce": lambda p: 1.0}


def parse_size(text):
    units = {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "K": 1 << 10, "M": 1 << 20}
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit):
            return int(float(t[:-len(unit)]) * scale)
    return int(t)


def human(n):
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB" if n >= 1 << 10 else f"{n} B"


# ------------------------------------------------------------------------- one p (under MPI)

def timed(world, variants, budget, rounds):
    """{name: seconds per call}: median over rounds, max over ranks; rounds interleave."""
    from mpi4py import MPI
    for f in variants.values():                 # warm up (buffers, connections)
        f()
    world.Barrier()
    t0 = time.perf_counter()
    for f in variants.values():
        f()
    once = world.allreduce(time.perf_counter() - t0, op=MPI.MAX) / len(variants)
    calls = int(min(max(budget / max(once, 1e-7), 1), 1000))
    samples = {name: [] for name in variants}
    for _ in range(rounds):
        for name, f in variants.items():
            world.Barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            samples[name].append((time.perf_counter() - t0) / calls)
    return {name: world.allreduce(float(np.median(s)), op=MPI.MAX) for name, s in samples.items()}


def floor(world, op, x, mine, full, piece):
    """The least a collective written on mpi4py's non-blocking point-to-point must do: one
    round of direct exchange (each pair of ranks one message each way: for all_reduce the
    whole x, for reduce_scatter piece j to rank j, for all_gather the own piece), polled with
    Testall and sched_yield as minipar waits, then the reduction; no ledger, tags, timeouts
    or argument checks. What Python and mpi4py cost before any library code runs."""
    from mpi4py import MPI
    p, r = world.Get_size(), world.Get_rank()
    B, testall = MPI.BYTE, MPI.Request.Testall
    k = x.size // p
    got = np.empty((p, x.size if op == "all_reduce" else k), np.float32)

    def run():
        reqs = []
        for j in range(1, p):
            src, dst = (r - j) % p, (r + j) % p
            if op == "all_gather":
                reqs.append(world.Irecv([full[src * k:(src + 1) * k], B], src, 99))
                reqs.append(world.Isend([mine, B], dst, 99))
            else:
                reqs.append(world.Irecv([got[src], B], src, 99))
                reqs.append(world.Isend([x if op == "all_reduce" else x[dst * k:(dst + 1) * k], B], dst, 99))
        while not testall(reqs):
            os.sched_yield()
        if op == "all_gather":
            full[r * k:(r + 1) * k] = mine
            return
        out = full if op == "all_reduce" else piece
        acc = x if op == "all_reduce" else x[r * k:(r + 1) * k]
        for j in range(p):
            if j != r:
                np.add(acc, got[j], out=out)
                acc = out
    return run


def compare_all_to_all(world, g, size, budget, rounds):
    """all_to_all: the dispatcher (out= and new array), pairwise and Bruck alone, and MPI's
    Alltoall, on x of `size` bytes (p equal pieces)."""
    import minipar.comm as comm
    from minipar.comm.algorithms import alltoall
    p, r = g.size, g.rank
    n = size // 4 // p * p
    x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
    full, theirs = np.empty(n, np.float32), np.empty(n, np.float32)
    variants = {"minipar": lambda: comm.all_to_all(g, x, out=full),
                "new": lambda: comm.all_to_all(g, x),
                "pairwise": lambda: alltoall.pairwise(g, x, out=full),
                "bruck": lambda: alltoall.bruck(g, x, out=full),
                "mpi": lambda: world.Alltoall(x, theirs)}
    t = timed(world, variants, budget, rounds)
    variants["mpi"]()
    for name in ("new", "pairwise", "bruck"):       # a benchmark of wrong answers means nothing
        if not np.array_equal(variants[name](), theirs):
            raise SystemExit(f"rank {r}: minipar's all_to_all ({name}) of {n * 4} B differs "
                             f"from MPI's")
    return {"op": "all_to_all", "p": p, "bytes": n * 4,
            "algorithm": comm.all_to_all_algorithm(g, x), **t}


def compare(world, g, op, size, budget, rounds):
    """minipar (out= and new array) and MPI's built-in on one op and size."""
    import minipar.comm as comm
    if op == "all_to_all":
        return compare_all_to_all(world, g, size, budget, rounds)
    p, r = g.size, g.rank
    n = size // 4 // p * p                      # float32 elements, divisible by p
    x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
    full = np.empty(n, np.float32)
    piece = np.empty(n // p, np.float32)
    mine = x[:n // p].copy()
    if op == "all_reduce":
        variants = {"minipar": lambda: comm.all_reduce(g, x, out=full),
                    "new": lambda: comm.all_reduce(g, x),
                    "mpi": lambda: world.Allreduce(x, full)}
        algorithm = comm.all_reduce_algorithm(g, x).__name__.split(".")[-1]
    elif op == "reduce_scatter":
        variants = {"minipar": lambda: comm.reduce_scatter(g, x, out=piece),
                    "new": lambda: comm.reduce_scatter(g, x),
                    "mpi": lambda: world.Reduce_scatter_block(x, piece)}
        algorithm = comm.reduce_scatter_algorithm(g, x).__name__.split(".")[-1]
    else:
        variants = {"minipar": lambda: comm.all_gather(g, mine, out=full),
                    "new": lambda: comm.all_gather(g, mine),
                    "mpi": lambda: world.Allgather(mine, full)}
        algorithm = comm.all_gather_algorithm(g, mine, None).__name__.split(".")[-1]
        algorithm = "bruck" if algorithm == "doubling" else algorithm
    if size <= FLOOR_MAX_BYTES or op != "all_reduce":
        variants["floor"] = floor(world, op, x, mine, full, piece)
    t = timed(world, variants, budget, rounds)
    ours = variants["new"]()                    # a benchmark of wrong answers means nothing
    variants["mpi"]()
    theirs = piece if op == "reduce_scatter" else full
    if not np.allclose(ours, theirs, rtol=1e-5, atol=1e-4):
        raise SystemExit(f"rank {r}: minipar's {op} of {n * 4} B differs from MPI's")
    return {"op": op, "p": p, "bytes": n * 4, "algorithm": algorithm, **t}


def crossover(world, g, op, size, budget, rounds):
    """Each of minipar's algorithms for op alone (and MPI's), at one size."""
    import minipar.comm as comm
    from minipar.comm.algorithms import alltoall, direct, doubling, ring, tree
    p, r = g.size, g.rank
    n = size // 4 // p * p
    x = np.random.default_rng(r).standard_normal(n).astype(np.float32)
    full = np.empty(n, np.float32)
    piece = np.empty(n // p, np.float32)
    piece_all = np.empty(n, np.float32)             # MPI's Alltoall result
    mine = x[:n // p].copy()

    def forced(f, limit):                       # tree.py's crossovers moved to `limit`
        def run():
            saved = tree.BROADCAST_TREE_MAX_BYTES, tree.REDUCE_TREE_MAX_BYTES
            tree.BROADCAST_TREE_MAX_BYTES = tree.REDUCE_TREE_MAX_BYTES = limit
            try:
                f()
            finally:
                tree.BROADCAST_TREE_MAX_BYTES, tree.REDUCE_TREE_MAX_BYTES = saved
        return run

    def chain(f):                               # the pipelined chain at every size
        return forced(f, -1)

    def binomial(f):                            # the binomial tree at every size
        return forced(f, 1 << 62)

    variants = {
        "all_reduce": {"doubling": lambda: doubling.all_reduce(g, x, out=full),
                       "ring": lambda: ring.all_reduce(g, x, out=full),
                       "direct": lambda: direct.all_reduce(g, x, out=full),
                       "mpi": lambda: world.Allreduce(x, full)},
        "reduce_scatter": {"doubling": lambda: doubling.reduce_scatter(g, x, out=piece),
                           "ring": lambda: ring.reduce_scatter(g, x, out=piece),
                           "direct": lambda: direct.reduce_scatter(g, x, out=piece),
                           "mpi": lambda: world.Reduce_scatter_block(x, piece)},
        "all_gather": {"bruck": lambda: doubling.all_gather(g, mine, out=full),
                       "ring": lambda: ring.all_gather(g, mine, out=full),
                       "direct": lambda: direct.all_gather(g, mine, out=full),
                       "mpi": lambda: world.Allgather(mine, full)},
        "broadcast": {"binomial": binomial(lambda: comm.broadcast(g, x, 0)),
                      "chain": chain(lambda: comm.broadcast(g, x, 0)),
                      "mpi": lambda: world.Bcast(full, 0)},
        "reduce": {"binomial": binomial(lambda: comm.reduce(g, x, 0)),
                   "chain": chain(lambda: comm.reduce(g, x, 0)),
                   "mpi": lambda: world.Reduce(x, full, root=0)},
        "all_to_all": {"bruck": lambda: alltoall.bruck(g, x, out=full),
                       "pairwise": lambda: alltoall.pairwise(g, x, out=full),
                       "mpi": lambda: world.Alltoall(x, piece_all)},
    }[op]
    t = timed(world, variants, budget, rounds)
    return {"op": op, "p": p, "bytes": n * 4, **t}


def worker(args):
    from mpi4py import MPI
    import minipar.comm as comm
    try:
        from minipar.plan.peak import keep_freed_memory   # as minipar.train does; both sides gain
        keep_freed_memory()
    except ImportError:
        pass
    world = MPI.COMM_WORLD
    g = comm.Group(world)
    rows = []
    for op in args.ops:
        for size in sizes_for(args, op):
            run = crossover if args.crossover else compare
            rows.append(run(world, g, op, size, args.seconds, args.rounds))
            if g.rank == 0 and args.worker:
                print("ROW " + json.dumps(rows[-1]), flush=True)
    return rows if g.rank == 0 else None


def sizes_for(args, op):
    if args.sizes:
        sizes = args.sizes
    elif args.crossover:                         # where the small-message algorithm may win
        sizes = [1 << k for k in (range(16, 27) if op in ("broadcast", "reduce")
                                  else range(10, 22))]
    else:
        sizes = [s for s in SIZES if op != "all_to_all" or s <= ALL_TO_ALL_MAX_BYTES]
    return [s for s in sizes if args.min_size <= s <= args.max_size]


# ------------------------------------------------------------------------- the tables

def all_to_all_table(rows):
    head = ("| p | size | algorithm | minipar us | pairwise us | Bruck us | MPI us | ratio | "
            "minipar algbw GB/s | busbw GB/s | MPI busbw GB/s | new us |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        s, p = r["bytes"], r["p"]
        bus = BUS["all_to_all"](p)
        lines.append(
            f"| {p} | {human(s)} | {r['algorithm']} | {r['minipar'] * 1e6:.0f} | "
            f"{r['pairwise'] * 1e6:.0f} | {r['bruck'] * 1e6:.0f} | {r['mpi'] * 1e6:.0f} | "
            f"{r['mpi'] / r['minipar']:.2f} | {s / r['minipar'] / 1e9:.2f} | "
            f"{s / r['minipar'] * bus / 1e9:.2f} | {s / r['mpi'] * bus / 1e9:.2f} | "
            f"{r['new'] * 1e6:.0f} |")
    return "\n".join(lines)


def table(rows):
    if not rows:
        return ""
    if "minipar" in rows[0] and any(r["op"] == "all_to_all" for r in rows):
        others = [r for r in rows if r["op"] != "all_to_all"]
        mine = [r for r in rows if r["op"] == "all_to_all"]
        return "\n\n".join(t for t in (table(others), all_to_all_table(mine)) if t)
    if "minipar" in rows[0]:
        head = ("| p | op | size | algorithm | minipar us | MPI us | ratio | minipar algbw GB/s | "
                "busbw GB/s | MPI busbw GB/s | new us | floor us | floor ratio |")
        lines = [head, "|" + "---|" * (head.count("|") - 1)]
        for r in rows:
            s, p = r["bytes"], r["p"]
            bus = BUS[r["op"]](p)
            lines.append(
                f"| {p} | {r['op']} | {human(s)} | {r['algorithm']} | {r['minipar'] * 1e6:.0f} | "
                f"{r['mpi'] * 1e6:.0f} | {r['mpi'] / r['minipar']:.2f} | "
                f"{s / r['minipar'] / 1e9:.2f} | {s / r['minipar'] * bus / 1e9:.2f} | "
                f"{s / r['mpi'] * bus / 1e9:.2f} | {r['new'] * 1e6:.0f} | "
                + (f"{r['floor'] * 1e6:.1f} | {r['mpi'] / r['floor']:.2f} |" if "floor" in r else "| |"))
        return "\n".join(lines)
    out = []
    for op in dict.fromkeys(r["op"] for r in rows):     # one table per op, in order
        mine = [r for r in rows if r["op"] == op]
        names = [k for k in mine[0] if k not in ("op", "p", "bytes")]
        head = "| p | op | size | " + " | ".join(f"{n} us" for n in names) + " | fastest |"
        lines = [head, "|" + "---|" * (head.count("|") - 1)]
        for r in mine:
            ours = {n: r[n] for n in names if n != "mpi"}
            best = min(ours, key=ours.get)
            lines.append(f"| {r['p']} | {op} | {human(r['bytes'])} | "
                         + " | ".join(f"{r[n] * 1e6:.0f}" for n in names) + f" | {best} |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def busy_others(samples=10, interval=0.05):
    """Most processes seen runnable at once besides this one (/proc/loadavg), over 0.5 s."""
    most = 0
    for _ in range(samples):
        try:
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return 0
        most = max(most, running - 1)
        time.sleep(interval)
    return most


def wait_for_quiet(limit):
    """This machine may be shared: wait up to `limit` seconds for other work to stop."""
    deadline = time.monotonic() + limit
    while True:
        others = busy_others()
        if others == 0 or time.monotonic() > deadline:
            return others
        time.sleep(1.0)


def launch(args, argv):
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(mpirun):
        mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        sys.exit("mpirun not found: run under `mpirun -n P python scripts/bench_collectives.py`")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    rows = []
    start = time.monotonic()
    notes = []
    for p in args.procs:
        others = wait_for_quiet(args.wait_quiet)
        note = f"p = {p}: " + ("machine quiet at the start" if others == 0 else
                               f"{others} other processes running at the start: noisy")
        notes.append(note)
        print(f"# {note}; {mpirun} -n {p} ...", file=sys.stderr, flush=True)
        proc = subprocess.run([mpirun, "-n", str(p), sys.executable, os.path.abspath(__file__),
                               "--worker", *argv], env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            sys.exit(f"mpirun -n {p} failed (exit {proc.returncode})")
        rows += [json.loads(line[4:]) for line in proc.stdout.splitlines()
                 if line.startswith("ROW ")]
    return rows, time.monotonic() - start, notes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 3, 4],
                    help="group sizes to run (each under its own mpirun)")
    ap.add_argument("--ops", nargs="+", default=None, help=f"default: {' '.join(OPS)}")
    ap.add_argument("--sizes", type=parse_size, nargs="+", default=None,
                    help="message sizes, e.g. 4KiB 1MiB (default: 4 KiB to 64 MiB by 4x)")
    ap.add_argument("--min-size", type=parse_size, default=0)
    ap.add_argument("--max-size", type=parse_size, default=1 << 40)
    ap.add_argument("--rounds", type=int, default=7, help="rounds per variant (median)")
    ap.add_argument("--seconds", type=float, default=0.03,
                    help="target seconds for the K calls of one round")
    ap.add_argument("--crossover", action="store_true",
                    help="time each minipar algorithm alone (doubling/Bruck vs ring, "
                         "binomial vs chain) to place the crossovers")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per mpirun")
    ap.add_argument("--wait-quiet", type=float, default=60,
                    help="before each p, wait up to this many seconds for other processes "
                         "on the machine to stop (it is reported either way)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ops is None:
        args.ops = OPS + (["broadcast", "reduce"] if args.crossover else [])

    # Under mpirun already (or as the launcher's worker): measure this world's p.
    if args.worker or any(v in os.environ for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")):
        start = time.monotonic()
        rows = worker(args)
        if rows is not None and not args.worker:
            print(table(rows))
            print(f"\n# {len(rows)} rows in {time.monotonic() - start:.0f} s")
        return
    rows, seconds, notes = launch(args, [a for a in sys.argv[1:]
                                         if a != "--json" and a != args.json])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(table(rows))
    print(f"\n# {len(rows)} rows in {seconds:.0f} s on {os.cpu_count()} cores; "
          + "; ".join(notes))


if __name__ == "__main__":
    main()
