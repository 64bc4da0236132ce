"""Ring attention measured: the communication the overlap hides, and zig-zag's load balance
against the contiguous split (minipar/parallel/context/ring_attention.py, Liu et al. 2023,
arXiv:2310.01889).

    python scripts/bench_ring.py                   # cp = 2 and 4, about 3 minutes on 2 cores
    python scripts/bench_ring.py --cp 2 --T 1024 --repeats 3
    mpirun -n 4 python scripts/bench_ring.py       # only cp = 4 (the world's size)

For each cp (its own mpirun) and sequence length T: q, k, v (B, H, T/cp, hs) float32 at each
rank's positions, `ring_attention(q, k, v, group, layout, overlap)` forward, then backward
from a fixed upstream gradient, timed on every rank after a barrier. Three ways per layout:
    overlap      the K, V block travels while the rank computes with the one in hand
    no overlap   each step waits for the whole transfer, then computes (the baseline)
    no messages  every ring step hands the rank its own block back (the module's _ring_step
                 replaced for the run): the same sub-blocks, no message, no waiting on another
                 rank; its CPU time (time.process_time) is the rank's attention work alone,
                 which a rank sharing its core with another (cp > cores) does not inflate
1 warm-up round, then --repeats rounds, the ways alternated within each round so that the
machine's drift hits all alike; each figure the median over rounds, per rank.

Columns (per rank, in rank order, joined by /):
  wait fwd, wait bwd  comm.counts("ring"), reset before each call: seconds spent waiting
                      for ring messages. With no overlap the forward's is the whole transfer;
                      with overlap what the compute did not hide. It also holds the time a
                      rank waits for a slower rank to send (the imbalance), not only the wire.
                      The backward's messages never overlap (the module docstring says why).
  compute             total - wait fwd - wait bwd: the rank's attention time in the ring
  total               the call (forward + backward), slowest rank
  exposed             (wait fwd + wait bwd) / total, mean over ranks
  cpu alone           no messages: CPU seconds of the call; per block: / (2 x blocks), a
                      forward and a backward pass
Load balance: blocks = ring_attention.blocks(rank, C, T, layout), the c x c sub-blocks of
scores (c = T/2C) a rank computes per pass, fully masked ones skipped: 2C + 1 on every rank
under zig-zag, 4r + 3 on rank r contiguous; `BLOCKS ok` when the counter ring_attention.BLOCKS
equals it in both passes on every rank and call. max/min and max/mean across ranks of the
blocks (the theory), of the ring's compute and of the CPU time alone.
Bytes: what one rank sends per call by the ledger (reset before each call): the bytes under
axis "cp" (comm.traffic_by_axis()) and the messages (comm.traffic()["send"]), against
ring_attention.ring_traffic, the formula's one home.
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

B, H, HS = 1, 8, 64
WAYS = ("overlap", "no overlap", "no messages")
LAYOUTS = ("zigzag", "contiguous")                   # ring_attention.LAYOUTS (no MPI import here)


# ------------------------------------------------------------------------- one cp (under MPI)

class _Done:
    """A message that has already arrived: what a ring step's handles are with no messages."""

    def __init__(self, x):
        self.x = x

    def wait(self):
        return self.x

    def test(self):
        return True


@contextlib.contextmanager
def no_messages(ra):
    """Every ring step hands the rank its own block back. The sub-blocks computed depend on
    the positions, not on the values, so the work is the ring's, with nothing sent."""
    real = ra._ring_step
    ra._ring_step = lambda group, outgoing: (_Done(None), _Done(outgoing))
    try:
        yield
    finally:
        ra._ring_step = real


def one_call(world, g, ra, q, k, v, do, layout, way):
    """Forward and backward of one ring attention call -> what it took on this rank."""
    from minipar import comm
    from minipar.autograd.tensor import Tensor
    local = [Tensor(x, requires_grad=True) for x in (q, k, v)]
    comm.reset_counts("ring")
    ra.BLOCKS.update(forward=0, backward=0)
    comm.reset_traffic()
    world.Barrier()
    with no_messages(ra) if way == "no messages" else contextlib.nullcontext():
        t0, c0 = time.perf_counter(), time.process_time()
        out = ra.ring_attention(*local, g, layout, overlap=way != "no overlap")
        out.backward(do)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
    waited = {which: n.get("waited", 0.0) for which, n in comm.counts("ring").items()}
    return {"total": total, "cpu": cpu, "wait_f": waited.get("forward", 0.0), "wait_b": waited.get("backward", 0.0),
            "blocks": [ra.BLOCKS["forward"], ra.BLOCKS["backward"]],
            "bytes": comm.traffic_by_axis().get("cp", {}).get("bytes_sent", 0),
            "messages": comm.traffic().get("send", {}).get("calls", 0)}


def measure(world, g, T, repeats):
    """{"layout/way": this rank's medians and counts} for one sequence length."""
    import numpy as np
    from minipar.parallel.context import ring_attention as ra
    C, r = g.size, g.rank
    rng = np.random.default_rng(0)                  # the same sequence on every rank
    q, k, v, do = rng.standard_normal((4, B, H, T, HS)).astype(np.float32)
    runs = {f"{layout}/{way}": [] for layout in LAYOUTS for way in WAYS}
    for rnd in range(1 + repeats):
        for layout in LAYOUTS:
            mine = ra.positions(r, C, T, layout)
            qkv = [np.ascontiguousarray(x[..., mine, :]) for x in (q, k, v, do)]
            for way in WAYS:
                got = one_call(world, g, ra, *qkv, layout, way)
                if rnd:                             # round 0 is the warm-up
                    runs[f"{layout}/{way}"].append(got)
    n = B * H * (T // C) * HS                       # elements of this rank's q (of k, of v)
    messages, nbytes = ra.ring_traffic(n, C, 4)
    out = {}
    for key, calls in runs.items():
        layout, way = key.split("/")
        theory = ra.blocks(r, C, T, layout)
        row = {f: statistics.median(c[f] for c in calls) for f in ("total", "cpu", "wait_f", "wait_b")}
        row["blocks"] = theory
        row["blocks_ok"] = all(c["blocks"] == [theory, theory] for c in calls)
        row["bytes"] = sorted({c["bytes"] for c in calls})
        row["messages"] = sorted({c["messages"] for c in calls})
        row["formula"] = [0, 0] if way == "no messages" else [messages, nbytes]
        out[key] = row
    return out


def worker(args):
    """Every T for this world's cp; rank 0 gets [{"cp", "T", "ranks": [per-rank results]}]."""
    from mpi4py import MPI
    from minipar import comm
    from minipar.plan.peak import keep_freed_memory
    keep_freed_memory()                             # as minipar.train does
    world = MPI.COMM_WORLD
    g = comm.Group(world, axis="cp")
    results = []
    for T in args.T:
        if T % (2 * g.size):
            raise SystemExit(f"T = {T} does not split into 2 x cp = {2 * g.size} chunks")
        mine = measure(world, g, T, args.repeats)
        ranks = world.gather(mine, root=0)          # the harness's own gather, not the library's
        if g.rank == 0:
            results.append({"cp": g.size, "T": T, "ranks": ranks})
            if args.worker:
                print("RESULT " + json.dumps(results[-1]), flush=True)
    return results if g.rank == 0 else None


# ------------------------------------------------------------------------- the tables

def per_rank(values, scale=1e3, fmt="{:.0f}"):
    """Per-rank figures in rank order, joined by / (ms by default)."""
    return "/".join(fmt.format(x * scale) for x in values)


def spread(xs):
    """(max/min, max/mean) across ranks."""
    return max(xs) / min(xs), max(xs) / (sum(xs) / len(xs))


def ways(res, layout, way):
    """Every rank's figures for one layout and way, in rank order."""
    return [rk[f"{layout}/{way}"] for rk in res["ranks"]]


def compute_of(rows):
    """Each rank's attention time in the ring: the call minus its waits."""
    return [x["total"] - x["wait_f"] - x["wait_b"] for x in rows]


def table(results, head, row):
    """One header, then row(res) for each T, each giving a list of lines."""
    lines = [head, "-" * len(head)]
    for res in results:
        lines += row(res)
    return lines


def timing_rows(res):
    out = []
    for layout in LAYOUTS:
        for way in WAYS:
            rows = ways(res, layout, way)
            compute = compute_of(rows)
            exposed = statistics.mean((x["total"] - c) / x["total"] for x, c in zip(rows, compute))
            alone = per_rank(x["cpu"] for x in rows) if way == "no messages" else ""
            out.append(f"{res['T']:5d} {layout:10} {way:11} {max(x['total'] for x in rows) * 1e3:8.0f} "
                       f"{exposed:7.1%}  {per_rank(x['wait_f'] for x in rows):>19} "
                       f"{per_rank(x['wait_b'] for x in rows):>19} {per_rank(compute):>23} {alone:>19}")
    return out


TIMING = (f"{'T':>5} {'layout':10} {'ring':11} {'total ms':>8} {'exposed':>7}  {'wait fwd ms':>19} "
          f"{'wait bwd ms':>19} {'compute ms':>23} {'cpu alone ms':>19}")


def balance_rows(res):
    out = []
    for layout in LAYOUTS:
        blocks = [x["blocks"] for x in ways(res, layout, "overlap")]
        ok = all(x["blocks_ok"] for way in WAYS for x in ways(res, layout, way))
        cpu = [x["cpu"] for x in ways(res, layout, "no messages")]
        per_block = [c / (2 * b) for c, b in zip(cpu, blocks)]           # forward and backward
        cell = lambda xs: "{:5.2f} {:5.2f}".format(*spread(xs))         # noqa: E731
        out.append(f"{res['T']:5d} {layout:10} {'/'.join(map(str, blocks)):>12} {'yes' if ok else 'NO':>9}  "
                   f"{cell(blocks):>11}  {cell(compute_of(ways(res, layout, 'overlap'))):>11}  "
                   f"{cell(compute_of(ways(res, layout, 'no overlap'))):>11}  {cell(cpu):>11}  "
                   f"{per_rank(per_block, fmt='{:.1f}'):>19}")
    return out


BALANCE = (f"{'T':>5} {'layout':10} {'blocks/rank':>12} {'BLOCKS ok':>9}  {'blocks':>11}  {'overlap':>11}  "
           f"{'no overlap':>11}  {'cpu alone':>11}  {'cpu ms per block':>19}")


def bytes_rows(res):
    out = []
    for way in WAYS:
        rows = [x for layout in LAYOUTS for x in ways(res, layout, way)]
        seen = sorted({b for x in rows for b in x["bytes"]})         # one figure when all agree
        msgs = sorted({m for x in rows for m in x["messages"]})
        (fm, fb), = {tuple(x["formula"]) for x in rows}
        ratio = "-" if not fb else f"{seen[0] / fb:8.6f}" if len(seen) == 1 else "differ"
        out.append(f"{res['T']:5d} {way:11} {'/'.join(map(str, seen)):>13} {fb:13d} {ratio:>8} "
                   f"{'/'.join(map(str, msgs)):>8} {fm:7d}")
    return out


BYTES = (f"{'T':>5} {'ring':11} {'ledger bytes':>13} {'ring_traffic':>13} {'ratio':>8} {'messages':>8} "
         f"{'formula':>7}")


def header(cp, args, cores):
    over = (f"{cp} ranks on {cores} cores: oversubscribed, {cp / cores:g} ranks per core, so a rank's wall "
            f"times include waiting for a core and its waits include the other ranks' compute"
            if cp > cores else f"{cp} ranks on {cores} cores, one per core (shared with whatever else runs)")
    return [f"cp = {cp}: B {B}, H {H}, hs {HS}, float32, T {', '.join(map(str, args.T))}; "
            f"median of {args.repeats} rounds after 1 warm-up, the ways alternated; 1 BLAS thread per rank",
            over]


def report(results, args, cores):
    """The three parts of each cp's table, and the run's summary from the same figures."""
    out = []
    for cp in sorted({r["cp"] for r in results}):
        mine = [r for r in results if r["cp"] == cp]
        out += [""] + header(cp, args, cores)
        out += ["", f"cp = {cp} (a) time per call, per rank"] + table(mine, TIMING, timing_rows)
        out += ["", f"cp = {cp} (b) load balance, max/min and max/mean across ranks: of the blocks (the theory), "
                    "of the ring's compute, and of the cpu alone"] + table(mine, BALANCE, balance_rows)
        out += ["", f"cp = {cp} (c) bytes one rank sends per call: the ledger (axis cp) against the formula"]
        out += table(mine, BYTES, bytes_rows)
    return out + [""] + summary(results, cores)


def line_fit(xs, ys):
    """Least squares y = a + b x -> (a, b)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def summary(results, cores):
    """What the numbers show, at the largest T of each cp."""
    mean = lambda xs: sum(xs) / len(xs)                                          # noqa: E731
    lines = ["summary (the largest T of each cp):"]
    for cp in sorted({r["cp"] for r in results}):
        res = max((r for r in results if r["cp"] == cp), key=lambda r: r["T"])
        at = f"  cp {cp}, T {res['T']}"
        on, off = ways(res, "zigzag", "overlap"), ways(res, "zigzag", "no overlap")
        fwd = [mean([x["wait_f"] for x in rows]) for rows in (off, on)]
        bwd = [mean([x["wait_b"] for x in rows]) for rows in (off, on)]
        call = [max(x["total"] for x in rows) for rows in (off, on)]
        lines.append(f"{at}, zig-zag: forward wait (mean over ranks) {fwd[0] * 1e3:.1f} ms without overlap, "
                     f"{fwd[1] * 1e3:.1f} ms with it; backward wait {bwd[0] * 1e3:.1f} and {bwd[1] * 1e3:.1f} ms "
                     f"(never overlapped); the call {call[0] * 1e3:.0f} and {call[1] * 1e3:.0f} ms")
        for layout in LAYOUTS:
            blocks = [x["blocks"] for x in ways(res, layout, "overlap")]
            cpu = [x["cpu"] for x in ways(res, layout, "no messages")]
            per_block = [c / b for c, b in zip(cpu, blocks)]
            ring = ways(res, layout, "overlap")
            waits = [x["wait_f"] + x["wait_b"] for x in ring]
            lines.append(f"{at}, {layout}: max/min of the blocks {spread(blocks)[0]:.2f}, of the cpu alone "
                         f"{spread(cpu)[0]:.2f}, of the ring's compute {spread(compute_of(ring))[0]:.2f}; "
                         f"cpu per block within {spread(per_block)[0] - 1:.0%} across ranks; "
                         f"waits per rank {per_rank(waits)} ms")
        blocks = [x["blocks"] for x in ways(res, "contiguous", "overlap")]
        cpu = [x["cpu"] for x in ways(res, "contiguous", "no messages")]
        if cp > 2:                                                  # two points always fit a line
            a, b = line_fit(blocks, cpu)
            worst = max(abs(a + b * n - c) / c for n, c in zip(blocks, cpu))
            lines.append(f"{at}, contiguous: cpu alone = a + b x blocks with a = {a * 1e3:.1f} ms per call "
                         f"whatever the blocks, b = {b * 1e3:.1f} ms per block (forward and backward), every "
                         f"rank within {worst:.1%} of the line")
        slow = [max(x["total"] for x in ways(res, layout, "overlap")) for layout in LAYOUTS]
        lines.append(f"{at}: the call contiguous / zig-zag (overlap) {slow[1] / slow[0]:.2f}; the heaviest rank's "
                     f"blocks (4C - 1) / (2C + 1) = {max(blocks) / (2 * cp + 1):.2f}, what it would be with one "
                     f"core per rank" + (f" (here {cp} ranks share {cores} cores: a rank that waits gives its core "
                                         f"to the others, so the imbalance costs less)" if cp > cores else ""))
    every = [x for r in results for rk in r["ranks"] for x in rk.values()]
    ok = all(x["blocks_ok"] for x in every)
    exact = all(x["bytes"] == [x["formula"][1]] and x["messages"] == [x["formula"][0]] for x in every)
    lines.append(f"  BLOCKS = blocks() on every rank, call and pass: {'yes' if ok else 'NO'}; "
                 f"ledger bytes and messages = ring_traffic on every rank and call: {'yes' if exact else 'NO'}")
    return lines


# ------------------------------------------------------------------------- the launcher

def launch(args, argv):
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    results = []
    for cp in args.cp:
        cmd = [mpirun, "-n", str(cp), sys.executable, os.path.abspath(__file__), "--worker", *argv]
        print(f"# load average {os.getloadavg()[0]:.2f}; mpirun -n {cp} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=args.timeout)
        if proc.returncode:
            sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
            sys.exit(f"mpirun -n {cp} failed (exit {proc.returncode})")
        results += [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4], help="ring sizes, each its own mpirun [2 4]")
    ap.add_argument("--T", type=int, nargs="+", default=[1024, 2048], help="sequence lengths [1024 2048]")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds after 1 warm-up [5]")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per mpirun [900]")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if min(args.cp) < 2:
        ap.error(f"a ring needs cp >= 2, got {min(args.cp)}")
    for cp in args.cp:
        if any(T % (2 * cp) for T in args.T):
            ap.error(f"every T must split into 2 x cp = {2 * cp} chunks, got T {args.T}")
    cores = len(os.sched_getaffinity(0))
    under_mpi = any(v in os.environ for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))
    if args.worker or under_mpi:                    # measure this world's cp
        results = worker(args)
        if results is not None and not args.worker:
            print("\n".join(report(results, args, cores)))
        return
    start, load0 = time.monotonic(), os.getloadavg()
    results = launch(args, sys.argv[1:])
    load1 = os.getloadavg()


    def busy(load):
        return "  (above 2.5: the machine is shared, expect noisy times)" if load[0] > 2.5 else ""
    print(f"ring attention, cp {' and '.join(map(str, args.cp))}, on {cores} cores; load average (1, 5, 15 min) "
          f"at start {'/'.join(f'{x:.2f}' for x in load0)}{busy(load0)}")
    print("\n".join(report(results, args, cores)))
    print(f"load average at end {'/'.join(f'{x:.2f}' for x in load1)}{busy(load1)}; "
          f"{time.monotonic() - start:.0f} s in all")


if __name__ == "__main__":
    main()
