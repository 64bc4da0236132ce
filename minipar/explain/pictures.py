"""python -m minipar.explain WHAT: run one collective, layer or schedule on P ranks with the
trace on, and draw what the trace recorded, message by message (explain_draw.py draws).

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

What runs. The launcher starts `mpirun -n P python -m minipar.explain --worker WHAT` (under
a timeout, MINIPAR_EXPLAIN_TIMEOUT seconds, 120 by default). Each rank calls the algorithm
module itself, not the dispatcher of minipar.comm, so the algorithm drawn is the one named
whatever the size. The trace records with peek=True: each float64 message sent keeps its
first and last value (trace.py; Call.note in comm/calls.py). Rank 0 writes the trace,
DIR/explain-WHAT-pP.json, which the launcher reads back and draws.

ring-attention runs ring_attention.RingAttention on P ranks (zig-zag, RING_SHAPE) inside a
layer span "ring attention", so the trace tells its forward's messages from its backward's;
its inputs mark each token's position in its first key and last value element
(explain_read.ring_inputs), and rank 0 adds every rank's counted sub-blocks (BLOCKS) to the
trace's metadata, gathered outside the trace. Reading it takes ring_attention's formulas,
whose module imports minipar.comm (and so starts MPI): the launcher imports it only to draw,
after its mpirun has ended.

moe-dispatch runs moe.moe_mlp with E = 4 experts, top-2, on N = B T tokens per rank, the
experts placed over the P ranks by expert_parallel.ExpertPlacement (E/P each), with
--capacity-factor F (1.25 by default: a few assignments dropped; 0: no capacity, the
variable all-to-alls), forward and backward of a scalar loss inside a layer span "moe". It
is the trainer's layer, so its all-to-alls go through comm.all_to_all's dispatcher: the
pairwise exchange on 2 or 4 ranks (Bruck only from 7; the reader names any other). Its
inputs mark each token in the first and last element of its row (explain_read.moe_inputs);
rank 0 adds every rank's routing (moe.Router's choices, weights and kept flags) and the
bytes the layer counted (ExpertPlacement.theory_bytes) to the trace's metadata, gathered
outside the trace. The result is checked against the same layer with every expert on one
process.

How a trace becomes a drawing (decoding the values on the wire, matching and replaying
the messages): explain_read.py.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys

import numpy as np

from minipar.explain.read import (COLLECTIVES, ROOT, WHATS, ExplainError, UsageError, collective_picture,
                                  MOE_MARK, RING_MARK, inputs, mlp_picture, moe_inputs, moe_picture,
                                  moe_weights, piece_offsets, pipeline_picture, ring_inputs, ring_picture)

MAX_P = 16
MAX_BYTES = 1 << 20
ENCODING = "x_r[j] = (j+1)*M + 2**r, M = 2**p"
RING_ENCODING = f"k[0,0,i,0] = v[B-1,H-1,i,hs-1] = (i+1)/{RING_MARK} at global position i, else N(0,1) seed 0"
MLP_SHAPE = (2, 3, 4)           # megatron-mlp: B, T, C (the hidden width is 4C)
RING_SHAPE = (2, 2, 4, 2)       # ring-attention: B, H, hs, and c tokens per chunk (T = 2 C c)
RING_MAX_P = 8
MOE_SHAPE = (2, 3, 4)           # moe-dispatch: B, T, C on each rank (N = B T tokens)
MOE_EXPERTS, MOE_TOP_K, MOE_FACTOR = 4, 2, 1.25


# --- the workers (under mpirun) -------------------------------------------------------------------

def work(what: str, n: int, path: str, factor: float = MOE_FACTOR):
    """One rank's part: run WHAT with the trace on, write the trace (rank 0), check the result."""
    from mpi4py import MPI                                              # noqa: PLC0415
    from minipar import comm                                            # noqa: PLC0415
    from minipar.show import tracing                                  # noqa: PLC0415
    if what == "moe-dispatch":
        return work_moe(comm.Group(MPI.COMM_WORLD, axis="ep"), path, factor)
    if what == "megatron-mlp":
        return work_mlp(comm.Group(MPI.COMM_WORLD, axis="tp"), path)
    if what == "ring-attention":
        return work_ring(comm.Group(MPI.COMM_WORLD, axis="cp"), path)
    from minipar.comm.algorithms import doubling, ring, tree                       # noqa: PLC0415
    world = comm.Group(MPI.COMM_WORLD, axis="world")
    p, r = world.size, world.rank
    x = inputs(what, p, n, r)
    run = {"ring-all-reduce": ring.all_reduce, "reduce-scatter": ring.reduce_scatter,
           "all-gather": ring.all_gather, "recursive-doubling": doubling.all_reduce,
           "broadcast": lambda g, v: tree.broadcast(g, v, ROOT),
           "reduce": lambda g, v: tree.reduce(g, v, ROOT)}[what]
    tracing.start(world, f"rank {r}", peek=True)
    out = run(world, x)
    tracing.finish(world, path, {"what": what, "n": n, "root": ROOT, "encoding": ENCODING})
    # the result against NumPy on the gathered inputs (after finish: not in the trace)
    off = piece_offsets(n, p)
    sizes = [off[k + 1] - off[k] for k in range(p)] if what == "all-gather" else [n] * p
    table = comm.all_gather(world, x if x is not None else np.zeros(n), sizes=sizes)
    want = {"ring-all-reduce": lambda: table.reshape(p, n).sum(0),
            "recursive-doubling": lambda: table.reshape(p, n).sum(0),
            "reduce-scatter": lambda: table.reshape(p, n).sum(0)[off[r]:off[r + 1]],
            "all-gather": lambda: table,
            "broadcast": lambda: table.reshape(p, n)[ROOT],
            "reduce": lambda: table.reshape(p, n).sum(0) if r == ROOT else None}[what]()
    if (want is None) != (out is None) or (want is not None and not np.array_equal(out, want)):
        bad = "None" if out is None or want is None else \
            f"element {np.flatnonzero(out != want)[0]}: {out[out != want][0]!r} != {want[out != want][0]!r}"
        raise ExplainError(f"rank {r}: {what} differs from NumPy on the gathered inputs: {bad}")


def work_mlp(group, path: str):
    """f -> c_fc -> gelu -> c_proj -> g (+ bias) on this rank's shard, one layer span each,
    then the backward of a scalar loss; checked against the unsharded MLP."""
    from minipar.autograd import ops                                      # noqa: PLC0415
    from minipar import trace
    from minipar.show import tracing                                  # noqa: PLC0415
    from minipar.parallel.tensor import tensor_parallel as tp                  # noqa: PLC0415
    from minipar.autograd.tensor import Tensor                                   # noqa: PLC0415
    p, r = group.size, group.rank
    B, T, C = MLP_SHAPE
    rng = np.random.default_rng(0)                                      # the same on every rank
    x0, w_fc, b_fc = rng.standard_normal((B, T, C)), rng.standard_normal((C, 4 * C)), rng.standard_normal(4 * C)
    w_proj, b_proj, probe = rng.standard_normal((4 * C, C)), rng.standard_normal(C), rng.standard_normal((B, T, C))
    cols = slice(r * 4 * C // p, (r + 1) * 4 * C // p)                  # this rank's 4C/tp channels

    def mlp(x, wf, bf, wp, bp, group, shapes):
        layers = [("f", lambda h: tp.copy_to_tp(h, group) if group else h),   # Megatron's f
                  ("c_fc", lambda h: ops.linear(h, wf, bf)),                    # (B, T, 4C/tp)
                  ("gelu", ops.gelu),
                  ("c_proj", lambda h: ops.linear(h, wp)),                      # (B, T, C), partial sums
                  ("g", lambda h: tp.reduce_from_tp(h, group) if group else h),  # Megatron's g
                  ("bias", lambda h: h + bp),                                   # once, after the sum
                  ("loss", lambda h: ops.sum(ops.mul(h, Tensor(probe)))), ]
        h = x
        for name, fn in layers:
            with trace.layer(name):
                h = fn(h)
            shapes[name] = list(h.shape)
        return h

    params = [Tensor(a.copy(), requires_grad=True) for a in (x0, w_fc[:, cols], b_fc[cols], w_proj[cols, :], b_proj)]
    shapes = {}
    tracing.start(group, f"rank {r} dp0 tp{r} pp0", peek=True)
    loss = mlp(*params, group, shapes)
    loss.backward()
    tracing.finish(group, path, {"what": "megatron-mlp", "B": B, "T": T, "C": C, "shapes": shapes})
    ref = [Tensor(a.copy(), requires_grad=True) for a in (x0, w_fc, b_fc, w_proj, b_proj)]
    ref_loss = mlp(*ref, None, {})
    ref_loss.backward()
    want = [ref_loss.data, ref[0].grad, ref[1].grad[:, cols], ref[2].grad[cols], ref[3].grad[cols, :], ref[4].grad]
    have = [loss.data] + [q.grad for q in params]
    for name, got, w in zip(("loss", "dx", "dw_fc", "db_fc", "dw_proj", "db_proj"), have, want):
        if not np.allclose(got, w, rtol=1e-12, atol=1e-12):
            raise ExplainError(f"rank {r}: megatron-mlp {name} differs from the unsharded MLP's by "
                               f"{np.abs(got - w).max():.3g}")


def work_ring(group, path: str):
    """RingAttention forward and backward of a scalar loss on this rank's zig-zag tokens, one
    layer span; checked against the single-process attention (ops.CausalSelfAttentionReference)."""
    from minipar import comm, trace                                # noqa: PLC0415
    from minipar.show import tracing                                  # noqa: PLC0415
    from minipar.autograd import ops
    from minipar.parallel.context import ring_attention as ra                   # noqa: PLC0415
    from minipar.autograd.tensor import Tensor                                   # noqa: PLC0415
    C, r = group.size, group.rank
    B, H, hs, c = RING_SHAPE
    T, layout = 2 * C * c, "zigzag"
    q, k, v, probe = ring_inputs(B, H, T, hs)                           # (B, H, T, hs) each, on every rank
    mine = ra.positions(r, C, T, layout)
    local = [Tensor(a[..., mine, :].copy(), requires_grad=True) for a in (q, k, v)]
    ra.BLOCKS.update(forward=0, backward=0)
    tracing.start(group, f"rank {r} cp{r}", peek=True)
    with trace.layer("ring attention"):
        o = ra.ring_attention(*local, group, layout)
    loss = ops.sum(ops.mul(o, Tensor(probe[..., mine, :])))
    loss.backward()
    with comm.untracked():                                              # not part of the picture
        counted = comm.all_gather(group, np.array([ra.BLOCKS["forward"], ra.BLOCKS["backward"]], np.int64))
    tracing.finish(group, path, {"what": "ring-attention", "B": B, "H": H, "T": T, "hs": hs, "layout": layout,
                               "blocks": counted.reshape(C, 2).tolist(), "encoding": RING_ENCODING})
    # the single-process attention of the whole sequence, on packed qkv (B, T, 3 H hs)
    qkv = np.concatenate([a.transpose(0, 2, 1, 3).reshape(B, T, H * hs) for a in (q, k, v)], axis=-1)
    y, cache = ops.CausalSelfAttentionReference.forward(qkv, H)
    dy = probe.transpose(0, 2, 1, 3).reshape(B, T, H * hs)
    grads = np.split(ops.CausalSelfAttentionReference.backward(dy, cache), 3, axis=-1)
    heads = [a.reshape(B, T, H, hs).transpose(0, 2, 1, 3)[..., mine, :] for a in [y] + grads]
    for name, got, want in zip(("o", "dq", "dk", "dv"), [o.data] + [t.grad for t in local], heads):
        if not np.allclose(got, want, rtol=1e-12, atol=1e-12):
            raise ExplainError(f"rank {r}: ring attention's {name} differs from the single-process "
                               f"attention's by {np.abs(got - want).max():.3g}")


def work_moe(group, path: str, factor: float):
    """One MoE layer (moe.moe_mlp) with its experts over the P ranks (expert_parallel), forward and
    backward of a scalar loss on this rank's tokens, one layer span; checked against the layer with
    every expert on one process, run on every rank's tokens (expert gradients sum over all of them)."""
    from minipar import comm, trace                           # noqa: PLC0415
    from minipar.show import tracing                                  # noqa: PLC0415
    from minipar.model import moe
    from minipar.autograd import ops
    from minipar.parallel.expert import expert_parallel                        # noqa: PLC0415
    from minipar.autograd.tensor import Tensor                                   # noqa: PLC0415
    P, r = group.size, group.rank
    (B, T, C), E, K = MOE_SHAPE, MOE_EXPERTS, MOE_TOP_K
    weights, (xs, probes) = moe_weights(E, C), moe_inputs(P, B, T, C)
    placement = expert_parallel.ExpertPlacement(group, E)

    def layer(x, probe, place):
        """-> (y, dx, {name: gradient}, Decisions) of the layer on x (B, T, C)."""
        params = {n: Tensor(w.copy(), requires_grad=True) for n, w in weights.items()
                  if place is None or place.owns(n)}
        s = moe.MoESettings(E, K, factor, stats=[], placement=place)
        xt = Tensor(x.copy(), requires_grad=True)
        with trace.layer("moe"):
            y = moe.moe_mlp(params, 0, xt, s)
        ops.sum(ops.mul(y, Tensor(probe))).backward()
        return y.data, xt.grad, {n: p.grad for n, p in params.items()}, s.stats[0][1]

    tracing.start(group, f"rank {r} ep{r}", peek=True)
    y, dx, grads, decisions = layer(xs[r], probes[r], placement)
    with trace.paused():                                                # the combine weights, for the picture
        x2 = xs[r].reshape(B * T, C)
        w = moe.Router.apply(x2, weights["h.0.mlp.router.weight"], moe.MoESettings(E, K, factor),
                             moe.Decisions(), B * T).data
    with comm.untracked():                                              # not part of the picture
        mine = np.concatenate([decisions.choice.ravel(), w.ravel(), decisions.kept.ravel(),
                               [placement.theory_bytes]]).astype(np.float64)
        every = comm.all_gather(group, mine).reshape(P, -1)
    N = B * T
    routing = [{"choice": row[:N * K].astype(int).reshape(N, K).tolist(),
                "weights": row[N * K:2 * N * K].reshape(N, K).tolist(),
                "kept": row[2 * N * K:3 * N * K].astype(bool).reshape(N, K).tolist()} for row in every]
    tracing.finish(group, path, {"what": "moe-dispatch", "E": E, "K": K, "N": N, "C": C, "factor": factor,
                               "cap": moe.capacity(N, K, E, factor), "routing": routing,
                               "counted": [int(row[-1]) for row in every],
                               "encoding": f"x[i, 0] = x[i, C-1] = (i+1)/{MOE_MARK} for token i"})
    # the same layer on one process, every expert local, on every rank's tokens
    ref = [layer(xs[q], probes[q], None) for q in range(P)]
    want = {"y": ref[r][0], "dx": ref[r][1], "router": ref[r][2]["h.0.mlp.router.weight"]}
    want.update({n: sum(g[2][n] for g in ref) for n in grads if n != "h.0.mlp.router.weight"})
    have = {"y": y, "dx": dx, "router": grads["h.0.mlp.router.weight"], **grads}
    for name, v in want.items():
        if not np.allclose(have[name], v, rtol=1e-12, atol=1e-12):
            raise ExplainError(f"rank {r}: the MoE layer's {name} differs from the one-process layer's by "
                               f"{np.abs(have[name] - v).max():.3g}")


# --- 1F1B: the trainer's own trace ------------------------------------------------------------------

def pipeline_argv(p: int, path: str) -> list[str]:
    """A short 1F1B run: P stages of one layer of the default width, 2P micro-batches of one
    sequence, 2 steps. (Narrower layers are faster to run but their forwards and backwards
    are then too short beside the messages to show the schedule's shape.)"""
    m = 2 * p
    return ["--pp", str(p), "--schedule", "1f1b", "--micro-batches", str(m), "--batch-size", str(m),
            "--n-layer", str(p), "--steps", "2", "--sample", "0", "--trace", path]


# --- the command line ------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m minipar.explain", allow_abbrev=False,
                 description="Run a collective, Megatron's MLP, a 1F1B pipeline, ring attention or a MoE layer "
                             "on P ranks (mpirun) with the trace on, and draw each message it sent: in the terminal, "
                             "as DIR/explain-WHAT-pP.svg and, with resvg_py, .png.",
                 epilog=f"WHAT: {', '.join(WHATS)}")
    ap.add_argument("what", metavar="WHAT", help="what to run and draw (below)")
    ap.add_argument("--p", type=int, metavar="P",
                    help="ranks [4; 5 for recursive-doubling, to show its fix-up; 2 for megatron-mlp; "
                         f"ring-attention 2..{RING_MAX_P}; moe-dispatch 2 or 4]")
    ap.add_argument("--out", default=".", metavar="DIR", help="where the drawings and the trace go [.]")
    ap.add_argument("--bytes", type=int, metavar="N",
                    help="the collectives' message size, a multiple of 8 [64*P: 8 float64 per rank]")
    ap.add_argument("--capacity-factor", type=float, metavar="F",
                    help=f"moe-dispatch: each expert takes ceil(F N K / E) of a rank's N tokens' assignments; "
                         f"0: no capacity [{MOE_FACTOR:g}]")
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


def run(what: str, p: int, n: int, out: str, factor: float = MOE_FACTOR) -> list[str]:
    """Launch WHAT on P ranks, then draw its trace: print the text, write the files. -> problems."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"explain-{what}-p{p}.json")
    if what == "1f1b":
        mpirun(p, ["minipar.train", *pipeline_argv(p, path)])
    else:
        size = ["--bytes", str(8 * n)] if what in COLLECTIVES else []
        size += ["--capacity-factor", repr(factor)] if what == "moe-dispatch" else []
        mpirun(p, ["minipar.explain", "--worker", what, "--trace-file", path, *size])
    return draw(path, out)


def draw(path: str, out: str) -> list[str]:
    """Draw the trace at `path`: print it, write DIR/explain-WHAT-pP.svg (and .png). -> problems."""
    from minipar.explain import draw as explain_draw                         # noqa: PLC0415
    from minipar.show import traceview
    trace = traceview.load(path)
    meta = trace["otherData"]["minipar"]
    what = meta.get("what", "1f1b")
    p = meta["world"]
    if what == "1f1b":
        pic, problems = pipeline_picture(trace), []
        text, svg = explain_draw.pipeline_text(pic), explain_draw.pipeline_svg(pic)
    elif what == "ring-attention":
        pic = ring_picture(trace)
        problems, text, svg = pic.problems, explain_draw.ring_text(pic), explain_draw.ring_svg(pic)
    elif what == "moe-dispatch":
        pic = moe_picture(trace)
        problems, text, svg = pic.problems, explain_draw.moe_text(pic), explain_draw.moe_svg(pic)
    elif what == "megatron-mlp":
        pic = mlp_picture(trace)
        problems, text, svg = pic.problems, explain_draw.mlp_text(pic), explain_draw.mlp_svg(pic)
    else:
        pic = collective_picture(trace)
        problems, text, svg = pic.problems, explain_draw.grid_text(pic), explain_draw.grid_svg(pic)
    print(text)
    stem = os.path.join(out, f"explain-{what}-p{p}")
    with open(stem + ".svg", "w") as f:
        f.write(svg)
    png = explain_draw.write_png(svg, stem + ".png")
    print(f"\ntrace: {path}\nsvg:   {stem}.svg\npng:   {png or '(pip install resvg_py to get one)'}")
    return problems


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        size = launched_size()
        if size > 1 and not args.worker and args.p is None:
            args.p = size
        what, p, n = settle(args)
        factor = MOE_FACTOR if args.capacity_factor is None else args.capacity_factor
        if args.worker:
            work(what, n, args.trace_file, factor)
            return 0
        if size > 1:                            # already under mpirun: be the worker, rank 0 draws
            return in_place(what, p, n, size, args.out, factor)
        problems = run(what, p, n, args.out, factor)
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
        work(what, n, path, factor)
    if launched_rank() != 0:
        return 0
    problems = draw(path, out)
    for line in problems:
        print(f"minipar.explain: problem: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
