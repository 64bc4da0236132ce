"""A trainer criterion's verdict, reached in the grader's process.

The child ran `python -m minipar.train FLAGS` with the student's code at the seam and left its
log (log.jsonl) and its final checkpoint (checkpoint/model.npz) in the results folder. The
grader reads both as hostile files (labs/results.py's limits), computes the single-process
twin of the same flags itself (minipar.train.verify.run_twin: minipar's own code, in this process,
with nothing of the student's loaded), and compares them as --verify would (verify.compare,
judged at verify.VERIFY_RTOL): the loss and the gradient norm of every step, and every
parameter at the end. The --verify verdict the child may print is never read.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from labs.results import MAX_FILE_BYTES, Results, Unreadable, load_arrays, read_capped

MAX_LOG_BYTES = 4 << 20
_twins: dict = {}


@dataclass
class TrainerRun:
    """What a trainer criterion's judge sees: the child's records, the run's log rows and
    summary, its final parameters, and the twin's losses, norms and parameters."""
    results: Results
    flags: list
    rows: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    state: dict = field(default_factory=dict)
    twin_losses: list = field(default_factory=list)
    twin_norms: list = field(default_factory=list)
    twin_state: dict = field(default_factory=dict)
    figures: dict = field(default_factory=dict)           # verify.compare's, with "tolerance" and "ok"


def twin(flags: list, ranks: int):
    """(losses, gradient norms, final canonical state) of the flags' run on one process,
    computed here once per set of flags."""
    k = (tuple(flags), ranks)
    if k not in _twins:
        from minipar.train import trainer as train, verify       # noqa: PLC0415
        from minipar.train.setup import prepare      # noqa: PLC0415
        args = train.build_parser().parse_args(list(flags))
        spec = prepare(args, ranks)
        _twins[k] = (args, *verify.run_twin(spec, args, spec.start, args.steps))
    return _twins[k]


def read_log(folder: str) -> tuple[list, dict]:
    """The step rows and the summary of the child's --log."""
    data = read_capped(os.path.join(folder, "log.jsonl"), MAX_LOG_BYTES)
    if data is None:
        raise AssertionError("the run wrote no log (it ended before its first step)")
    rows, summary = [], {}
    for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            raise Unreadable(f"log.jsonl line {n} is not JSON") from None
        if not isinstance(row, dict):
            raise Unreadable(f"log.jsonl line {n} is not an object")
        if row.get("summary") is True:
            summary = row
        else:
            rows.append(row)
    return rows, summary


def read_state(folder: str) -> dict:
    """The final parameters of the child's --save checkpoint (model.npz, allow_pickle=False)."""
    path = os.path.join(folder, "checkpoint", "model.npz")
    data = read_capped(path, MAX_FILE_BYTES)
    if data is None:
        raise AssertionError("the run wrote no final checkpoint")
    return load_arrays(data)


def numbers(rows: list, key: str) -> np.ndarray:
    out = []
    for row in rows:
        try:
            out.append(float(row.get(key)))
        except (TypeError, ValueError):
            out.append(np.nan)
    return np.array(out, dtype=np.float64)


def judge(results: Results, flags: list, ranks: int) -> TrainerRun:
    """Every rank ran the student's code and finished; the log and checkpoint agree with the
    twin at --verify's tolerance. AssertionError with the figures otherwise; the returned
    TrainerRun's figures say how close it came."""
    from minipar.train import verify                   # noqa: PLC0415
    run = TrainerRun(results, list(flags))
    missing = [r for r in range(ranks) if r not in results.values or r in results.damaged]
    errors = [(r, results.error(r)) for r in range(ranks) if results.error(r)]
    if errors or missing:
        raise AssertionError(results.why_missing(missing[0] if missing else errors[0][0], "record"))
    calls = [results.meta[r].get("calls") for r in range(ranks)]
    idle = [r for r, n in enumerate(calls) if not (isinstance(n, int) and n > 0)]
    if idle:
        raise AssertionError(f"the student's code never ran on rank(s) {idle} (calls per rank {calls}): "
                             f"the run would judge minipar's own code")
    codes = [results.meta[r].get("exit") for r in range(ranks)]
    if any(c != 0 for c in codes):
        raise AssertionError(f"the trainer exited with code {next(c for c in codes if c != 0)!r} "
                             f"(exit codes per rank {codes})")
    folder = results.folder
    run.rows, run.summary = read_log(folder)
    run.state = read_state(folder)
    args, run.twin_losses, run.twin_norms, run.twin_state = twin(flags, ranks)
    steps = args.steps
    if len(run.rows) != steps:
        raise AssertionError(f"the log holds {len(run.rows)} step rows, the run had {steps} steps")
    missing = sorted(set(run.twin_state) - set(run.state))
    if missing:
        raise AssertionError(f"the final checkpoint lacks {missing[:3]}")
    for name, ref in run.twin_state.items():
        got = run.state[name]
        if got.shape != ref.shape or got.dtype.kind != "f":
            raise AssertionError(f"the final checkpoint's {name} is {got.dtype} {got.shape}, want {ref.shape}")
    d = verify.compare(numbers(run.rows, "loss"), run.twin_losses, run.state, run.twin_state,
                       numbers(run.rows, "grad_norm"), run.twin_norms)
    mixed = args.precision != "fp32"
    tol = verify.VERIFY_RTOL[args.precision if mixed else args.dtype]
    ok = d["loss_rel"] <= tol and (mixed or (d["norm_rel"] <= tol and d["param_rel"] <= tol))
    run.figures = {**d, "tolerance": tol, "ok": ok}
    line = (f"against the grader's single-process twin over {steps} steps: loss rel {d['loss_rel']:.2e}"
            + ("" if mixed else f", grad norm rel {d['norm_rel']:.2e}, parameters rel {d['param_rel']:.2e} "
                                f"({d['worst_param']})")
            + f"; tolerance {tol:g}" + (" on losses" if mixed else ""))
    if not ok:
        raise AssertionError(line + " -> FAILED")
    run.figures["line"] = line + " -> OK"
    return run
