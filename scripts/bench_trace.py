"""What --trace costs: off (every traced place is one test of trace.RECORDER) and on.

    python scripts/bench_trace.py              # about a minute on 2 cores
    python scripts/bench_trace.py --ranks 4 --steps 30

1. Off. The cost of one `with trace.span(...)` and one `with trace.layer(...)` while
   tracing is off (timeit, an empty body subtracted), times how many of them a step passes
   (counted in a traced run: its compute spans per step and rank), beside the step time.
2. On. The same training run with and without --trace, alternated (ABAB...) so that the
   machine's drift hits both; the median step time of each (the log's step_time, first step
   left out) and the ratio; and the trace's size per rank and step.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import timeit

from minipar import trace
from minipar.show import traceview

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")


def off_cost_ns() -> tuple[float, float]:
    """ns per `with trace.span` and per `with trace.layer` with tracing off."""
    assert trace.RECORDER is None

    def empty():
        pass

    def span():
        with trace.span("optimizer step", "optimizer"):
            pass

    def layer(i=3):
        with trace.layer(f"h.{i}"):
            pass
    n = 200_000
    base = min(timeit.repeat(empty, number=n, repeat=5)) / n
    return tuple((min(timeit.repeat(f, number=n, repeat=5)) / n - base) * 1e9 for f in (span, layer))


def train(ranks, flags, log, trace_file=None):
    cmd = ([MPIRUN, "-n", str(ranks)] if ranks > 1 else []) + [sys.executable, "-m", "minipar.train", *flags,
                                                               "--log", log, "--sample", "0"]
    cmd += ["--trace", trace_file] if trace_file else []
    subprocess.run(cmd, cwd=REPO, env=ENV, check=True, capture_output=True, timeout=600)
    with open(log) as f:
        rows = [json.loads(line) for line in f][:-1]
    return [r["step_time"] for r in rows[1:]]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    layout = ["--dp", "2", "--pp", "2", "--zero", "1", "--micro-batches", "4"] if a.ranks == 4 else []
    flags = layout + ["--steps", str(a.steps)]
    tmp = tempfile.mkdtemp()
    log, tr = os.path.join(tmp, "log.jsonl"), os.path.join(tmp, "trace.json")
    off, on = [], []
    for _ in range(a.repeats):
        off += train(a.ranks, flags, log)
        on += train(a.ranks, flags, log, tr)
    t = traceview.load(tr)
    n_steps = len(traceview.steps(t))
    compute = [e for e in traceview.spans(t) if e["tid"] == trace.COMPUTE and e["cat"] != "eval"]
    sites = len(compute) / n_steps / a.ranks
    span_ns, layer_ns = off_cost_ns()
    t_off, t_on = statistics.median(off), statistics.median(on)
    size = os.path.getsize(tr)
    print(f"run: {a.ranks} rank(s) {' '.join(layout) or '(one process)'}, {a.steps} steps, x{a.repeats} each way")
    print(f"{'':34s}{'figure':>14s}")
    print(f"{'span, tracing off':34s}{span_ns:11.0f} ns")
    print(f"{'layer, tracing off':34s}{layer_ns:11.0f} ns")
    print(f"{'traced places per step and rank':34s}{sites:14.0f}")
    off_step = sites * max(span_ns, layer_ns) * 1e-9
    print(f"{'off: their cost per step':34s}{off_step * 1e6:11.1f} us  = {off_step / t_off:.4%} of the step")
    print(f"{'step time, no --trace (median)':34s}{t_off * 1e3:11.1f} ms")
    print(f"{'step time, --trace (median)':34s}{t_on * 1e3:11.1f} ms  ratio {t_on / t_off:.3f}")
    print(f"{'trace size per rank and step':34s}{size / n_steps / a.ranks / 1024:11.1f} KiB"
          f"  ({size / 2**20:.1f} MiB for {n_steps} steps)")


if __name__ == "__main__":
    main()
