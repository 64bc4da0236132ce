"""python -m minipar.explain WHAT: run one collective, layer or schedule on P ranks with the
trace on, and draw what the trace recorded, message by message (each picture's own file reads
its trace and draws it).

    WHAT                 runs                                   ranks
    ring-all-reduce      ring.all_reduce                        --p, default 4
    reduce-scatter       ring.reduce_scatter                    4
    all-gather           ring.all_gather                        4
    recursive-doubling   doubling.all_reduce                    5 (the fix-up of the extra rank)
    broadcast            tree.broadcast, root 0                 4
    reduce               tree.reduce, root 0                    4
    megatron-mlp         f -> c_fc -> gelu -> c_proj -> g, and its backward      tp 2
    1f1b                 python -m minipar.train --pp P, its measured timeline   4 stages
    ring-attention       RingAttention forward and backward (context parallelism)  cp 4 (2..8)
    moe-dispatch         one MoE layer, its experts over the ranks (expert parallelism)  ep 4 (2 or 4)
    gqa-tp               a Llama block's query and key/value heads over tp ranks   tp 4 (2, 4 or 8)
    ulysses              UlyssesAttention forward and backward: its four all-to-alls   cp 4 (2 or 4)
    fsdp                 python -m minipar.train --zero 3, prefetch 0, K and K without resharding:
                         its measured all-gathers and reduce-scatters   4 ranks (2 or 4)
    hsdp                 python -m minipar.train --zero 3 --shard-group 2: the shard and replica
                         groups, each rank's bytes in each             4 ranks

What runs. The launcher starts `mpirun -n P python -m minipar.explain --worker WHAT` (under
a timeout, MINIPAR_EXPLAIN_TIMEOUT seconds, 120 by default). The trace records with
peek=True: each float64 message sent keeps its first and last value (trace.py; Call.note in
comm/group.py). Rank 0 writes the trace, DIR/explain-WHAT-pP.json, which the launcher reads
back and draws; the PNG beside the SVG is resvg_py's, when it is installed (write_png).

How a trace becomes a drawing (decoding the values on the wire, matching and replaying
the messages): collectives.py; the other pictures read theirs in megatron.py, pipeline.py,
ring_attention.py, moe.py, gqa_tp.py, ulysses.py, fsdp.py (three runs, three traces:
DIR/explain-fsdp-pP-TAG.json, with the runs' logs beside them) and hsdp.py.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys

from minipar.explain.common import COLLECTIVES, WHATS, ExplainError, UsageError
from minipar.explain.collectives import collective_picture, grid_svg, grid_text, work
from minipar.explain.fsdp import FSDP_LAYERS, FSDP_RANKS, fsdp_argv, fsdp_files, fsdp_settings
from minipar.explain.gqa_tp import gqa_picture, gqa_ranks_ok, gqa_svg, gqa_text
from minipar.explain.hsdp import HSDP_RANKS, hsdp_argv
from minipar.explain.megatron import MLP_SHAPE, mlp_picture, mlp_svg, mlp_text
from minipar.explain.moe import MOE_EXPERTS, MOE_FACTOR, moe_picture, moe_svg, moe_text
from minipar.explain.pipeline import pipeline_argv, pipeline_picture, pipeline_svg, pipeline_text
from minipar.explain.ring_attention import RING_MAX_P, ring_picture, ring_svg, ring_text
from minipar.explain.ulysses import ULY_RANKS, uly_picture, uly_ranks_ok, uly_svg, uly_text, work_ulysses


MAX_P = 16
MAX_BYTES = 1 << 20


# --- the command line -----------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m minipar.explain", allow_abbrev=False,
                 description="Run a collective, Megatron's MLP, a 1F1B pipeline, ZeRO-3's gathers, ring attention, "
                             "Ulysses attention, a MoE layer or grouped-query attention under tensor parallelism "
                             "on P ranks (mpirun) with the trace on, and draw each message it sent: in the terminal, "
                             "as DIR/explain-WHAT-pP.svg and, with resvg_py, .png.",
                 epilog=f"WHAT: {', '.join(WHATS)}")
    ap.add_argument("what", metavar="WHAT", help="what to run and draw (below)")
    ap.add_argument("--p", type=int, metavar="P",
                    help="ranks [4; 5 for recursive-doubling, to show its fix-up; 2 for megatron-mlp; "
                         f"ring-attention 2..{RING_MAX_P}; moe-dispatch 2 or 4; ulysses "
                         f"{' or '.join(map(str, ULY_RANKS))}]")
    ap.add_argument("--out", default=".", metavar="DIR", help="where the drawings and the trace go [.]")
    ap.add_argument("--bytes", type=int, metavar="N",
                    help="the collectives' message size, a multiple of 8 [64*P: 8 float64 per rank]")
    ap.add_argument("--capacity-factor", type=float, metavar="F",
                    help=f"moe-dispatch: each expert takes ceil(F N K / E) of a rank's N tokens' assignments; "
                         f"0: no capacity [{MOE_FACTOR:g}]")
    ap.add_argument("--prefetch", type=int, metavar="K",
                    help="fsdp: the blocks ZeRO-3 gathers ahead in the second and third runs [1]")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trace-file", help=argparse.SUPPRESS)
    return ap


def settle(args) -> tuple[str, int, int]:
    """-> (WHAT, P, elements), or UsageError naming the bad value."""
    what = args.what
    if what not in WHATS:
        raise UsageError(f"unknown WHAT {what!r}; choose one of {', '.join(WHATS)}")
    p = WHATS[what].default_p if args.p is None else args.p
    if not 2 <= p <= MAX_P:
        raise UsageError(f"--p {p}: need 2 <= P <= {MAX_P}")
    if what == "ring-attention" and p > RING_MAX_P:
        raise UsageError(f"--p {p}: ring-attention draws 2 <= P <= {RING_MAX_P} ranks")
    hidden = 4 * MLP_SHAPE[2]
    if what == "megatron-mlp" and hidden % p:
        raise UsageError(f"--p {p}: megatron-mlp splits the hidden width 4C = {hidden}; P must divide it")
    if what == "gqa-tp" and not gqa_ranks_ok(p):
        raise UsageError(f"--p {p}: gqa-tp splits 8 query heads and 2 key/value heads; P must be 2, 4 or 8")
    if what == "ulysses" and not uly_ranks_ok(p):
        raise UsageError(f"--p {p}: ulysses splits 8 query heads and 2 key/value heads with the pairwise "
                         f"all-to-all; P must be {' or '.join(map(str, ULY_RANKS))}")
    if what == "fsdp" and p not in FSDP_RANKS:
        raise UsageError(f"--p {p}: fsdp runs the trainer on {' or '.join(map(str, FSDP_RANKS))} ranks")
    if what == "hsdp" and p not in HSDP_RANKS:
        raise UsageError(f"--p {p}: hsdp runs the trainer on {' or '.join(map(str, HSDP_RANKS))} ranks")
    if args.prefetch is not None and what != "fsdp":
        raise UsageError(f"--prefetch {args.prefetch} is for fsdp")
    if args.prefetch is not None and not 1 <= args.prefetch < FSDP_LAYERS:
        raise UsageError(f"--prefetch {args.prefetch}: need 1 <= K <= {FSDP_LAYERS - 1} (the model has {FSDP_LAYERS} "
                         f"blocks; prefetch 0 is always the first run)")
    if what == "moe-dispatch" and MOE_EXPERTS % p:
        raise UsageError(f"--p {p}: moe-dispatch splits E = {MOE_EXPERTS} experts over the ranks; P must divide it")
    if args.capacity_factor is not None and what != "moe-dispatch":
        raise UsageError(f"--capacity-factor {args.capacity_factor:g} is for moe-dispatch")
    if args.capacity_factor is not None and not 0 <= args.capacity_factor <= 100:
        raise UsageError(f"--capacity-factor {args.capacity_factor:g}: need 0 <= F <= 100 (0: no capacity)")
    if args.bytes is not None and what not in COLLECTIVES:
        raise UsageError(f"--bytes {args.bytes}: {what} sets its own sizes (--bytes is for {', '.join(COLLECTIVES)})")
    nbytes = 64 * p if args.bytes is None else args.bytes
    if nbytes % 8 or not 8 * p <= nbytes <= MAX_BYTES:
        raise UsageError(f"--bytes {nbytes}: need a multiple of 8 (float64) from 8*P = {8 * p} to {MAX_BYTES}")
    return what, p, nbytes // 8


def launched_rank() -> int:
    """This process's world rank under mpirun (0 when not under it), from the environment."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def launched_size() -> int:
    """The world size when this process runs under mpirun (MPICH's or Open MPI's), else 1;
    read from the environment, so the launcher never starts MPI itself."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 1


def find_mpirun() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    found = here if os.access(here, os.X_OK) else shutil.which("mpirun")
    if not found:
        raise ExplainError(f"no mpirun next to {sys.executable} nor on PATH (pip install mpich, or make install)")
    return found


def mpirun(p: int, argv: list[str]) -> None:
    """mpirun -n P python -m ARGV, in a session of its own, killed whole after the timeout."""
    timeout = float(os.environ.get("MINIPAR_EXPLAIN_TIMEOUT", "120"))
    cmd = [find_mpirun(), "-n", str(p), sys.executable, "-m", *argv]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.setdefault("MINIPAR_COMM_TIMEOUT", str(max(5, int(timeout / 2))))   # a stuck rank gives up first
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    shown = f"mpirun -n {p} python -m {' '.join(argv[:3])} ..."
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise ExplainError(f"`{shown}` did not finish within {timeout:g} s (MINIPAR_EXPLAIN_TIMEOUT); "
                           f"killed it and its ranks") from None
    if proc.returncode:
        sys.stderr.write(err[-4000:])
        raise ExplainError(f"`{shown}` exited {proc.returncode} (its stderr is above)")


def run(what: str, p: int, n: int, out: str, factor: float = MOE_FACTOR, prefetch: int = 1) -> list[str]:
    """Launch WHAT on P ranks, then draw its trace: print the text, write the files. -> problems."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"explain-{what}-p{p}.json")
    if what == "fsdp":
        return run_fsdp(p, out, prefetch)
    if what == "hsdp":
        from minipar.explain.hsdp import hsdp_picture, hsdp_svg, hsdp_text                  # noqa: PLC0415
        log = os.path.join(out, f"explain-{what}-p{p}.jsonl")
        mpirun(p, ["minipar.train", *hsdp_argv(path, log)])
        pic = hsdp_picture(path, log)
        return show(hsdp_text(pic), hsdp_svg(pic), os.path.join(out, f"explain-{what}-p{p}"), [path], pic.problems)
    if what == "1f1b":
        mpirun(p, ["minipar.train", *pipeline_argv(p, path)])
    else:
        size = ["--bytes", str(8 * n)] if what in COLLECTIVES else []
        size += ["--capacity-factor", repr(factor)] if what == "moe-dispatch" else []
        mpirun(p, ["minipar.explain", "--worker", what, "--trace-file", path, *size])
    return draw(path, out)


def draw(path: str, out: str) -> list[str]:
    """Draw the trace at `path`: print it, write DIR/explain-WHAT-pP.svg (and .png). -> problems."""
    from minipar.show import traceview
    trace = traceview.load(path)
    meta = trace["otherData"]["minipar"]
    what = meta.get("what", "1f1b")
    p = meta["world"]
    if what == "1f1b":
        pic, problems = pipeline_picture(trace), []
        text, svg = pipeline_text(pic), pipeline_svg(pic)
    elif what == "ring-attention":
        pic = ring_picture(trace)
        problems, text, svg = pic.problems, ring_text(pic), ring_svg(pic)
    elif what == "moe-dispatch":
        pic = moe_picture(trace)
        problems, text, svg = pic.problems, moe_text(pic), moe_svg(pic)
    elif what == "megatron-mlp":
        pic = mlp_picture(trace)
        problems, text, svg = pic.problems, mlp_text(pic), mlp_svg(pic)
    elif what == "gqa-tp":
        pic = gqa_picture(trace)
        problems, text, svg = pic.problems, gqa_text(pic), gqa_svg(pic)
    elif what == "ulysses":
        pic = uly_picture(trace)
        problems, text, svg = pic.problems, uly_text(pic), uly_svg(pic)
    else:
        pic = collective_picture(trace)
        problems, text, svg = pic.problems, grid_text(pic), grid_svg(pic)
    return show(text, svg, os.path.join(out, f"explain-{what}-p{p}"), [path], problems)


def run_fsdp(p: int, out: str, prefetch: int) -> list[str]:
    """fsdp: the trainer three times (fsdp.fsdp_settings), then the three runs drawn together."""
    from minipar.explain.fsdp import fsdp_picture, fsdp_svg, fsdp_text, load_run      # noqa: PLC0415
    runs = []
    for s in fsdp_settings(prefetch):
        trace, log = fsdp_files(out, p, s)
        mpirun(p, ["minipar.train", *fsdp_argv(s, trace, log)])
        runs.append((s, trace, log))
    pic = fsdp_picture([load_run(*r) for r in runs])
    return show(fsdp_text(pic), fsdp_svg(pic), os.path.join(out, f"explain-fsdp-p{p}"),
                [t for _, t, _ in runs], pic.problems)


def show(text: str, svg: str, stem: str, traces: list, problems: list) -> list[str]:
    """Print the text, write STEM.svg (and .png), say where the files are. -> problems."""
    print(text)
    with open(stem + ".svg", "w") as f:
        f.write(svg)
    png = write_png(svg, stem + ".png")
    print(f"\ntrace: {', '.join(traces)}\nsvg:   {stem}.svg\npng:   {png or '(pip install resvg_py to get one)'}")
    return problems


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        size = launched_size()
        if size > 1 and not args.worker and args.p is None:
            args.p = size
        what, p, n = settle(args)
        factor = MOE_FACTOR if args.capacity_factor is None else args.capacity_factor
        if what in ("fsdp", "hsdp") and (args.worker or size > 1):
            raise UsageError(f"{what} launches the trainer itself: run it without mpirun")
        if args.worker:
            worker(what, n, args.trace_file, factor)
            return 0
        if size > 1:                            # already under mpirun: be the worker, rank 0 draws
            return in_place(what, p, n, size, args.out, factor)
        problems = run(what, p, n, args.out, factor, 1 if args.prefetch is None else args.prefetch)
    except UsageError as e:
        if launched_rank() == 0:                # under mpirun: said once
            print(f"minipar.explain: error: {e}", file=sys.stderr)
        return 2
    except ExplainError as e:
        print(f"minipar.explain: error: {e}", file=sys.stderr)
        return 1
    for line in problems:
        print(f"minipar.explain: problem: {line}", file=sys.stderr)
    return 1 if problems else 0


def worker(what: str, n: int, path: str, factor: float = MOE_FACTOR):
    """One rank's part under mpirun: ulysses' worker here, every other WHAT's in collectives.work."""
    if what != "ulysses":
        return work(what, n, path, factor)
    from mpi4py import MPI                                              # noqa: PLC0415
    from minipar import comm                                            # noqa: PLC0415
    return work_ulysses(comm.Group(MPI.COMM_WORLD, axis="cp"), path)


def in_place(what: str, p: int, n: int, size: int, out: str, factor: float = MOE_FACTOR) -> int:
    """Under `mpirun -n P python -m minipar.explain WHAT`: every rank works, rank 0 draws."""
    if p != size:
        raise UsageError(f"--p {p}: running under mpirun with {size} ranks")
    path = os.path.join(out, f"explain-{what}-p{p}.json")
    if launched_rank() == 0:
        os.makedirs(out, exist_ok=True)
    if what == "1f1b":
        from minipar.train import trainer as train                                       # noqa: PLC0415
        train.main(pipeline_argv(p, path))
    else:
        worker(what, n, path, factor)
    if launched_rank() != 0:
        return 0
    problems = draw(path, out)
    for line in problems:
        print(f"minipar.explain: problem: {line}", file=sys.stderr)
    return 1 if problems else 0


# --- PNG ------------------------------------------------------------------------------------------
def write_png(svg: str, path: str) -> str | None:
    """The SVG rendered to `path` by resvg_py; None (nothing written) when it is not installed."""
    try:
        import resvg_py                                                 # noqa: PLC0415
    except ImportError:
        return None
    data = resvg_py.svg_to_bytes(svg_string=svg)
    with open(path, "wb") as f:
        f.write(bytes(data))
    return os.path.abspath(path)


if __name__ == "__main__":
    sys.exit(main())
