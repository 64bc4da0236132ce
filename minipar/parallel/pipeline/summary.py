"""The summary's pipeline figures (docs/design.md §8's `pipeline`) from every stage's stats,
gathered on pp rank 0 (PipelineEngine.gather_stats), and its lines.
"""
from __future__ import annotations

import numpy as np

from minipar.comm.ledger import human_bytes
from minipar.parallel.pipeline import schedules, zero_bubble


def simulated_bubble(schedule: str, p: int, m: int, V: int, stages) -> float:
    """The schedule run by schedules.check with each stage's own measured F, B and W of a
    micro-batch (a chunk's: 1/V of them): the theory for this pipeline as it is, unequal
    stages included, with messages free."""
    ops = [st["op_seconds"] for st in stages]
    split = schedule.startswith("zb")
    return schedules.check(p, m, schedule, virtual=V, forward_time=[f / V for f, _, _ in ops],
                           backward_time=[(b + w) / V for _, b, w in ops],
                           weight_time=[w / V for _, _, w in ops] if split else None).bubble


def figures(schedule: str, p: int, m: int, V: int, bubble_theory: float, stages, rows_log) -> dict:
    """docs/design.md §8's `pipeline` figures from every stage's stats.
    bubble_measured: 1 - sum of busy time / (p * makespan), the mean over stages of each
    stage's idle fraction of the step's longest stage span, averaged over the steps after
    the first (the first pays for warming caches); stage.py's docstring."""
    f, b, w = np.mean([st["op_seconds"] for st in stages], axis=0)
    return {"schedule": schedule, "stages": p, "virtual_stages": V,
            "micro_batches": m,
            "bubble_measured": float(np.mean([st["bubble_mean"] for st in stages])),
            "bubble_per_stage": [st["bubble_mean"] for st in stages],
            "bubble_theory": bubble_theory,
            "op_seconds_per_stage": [st["op_seconds"] for st in stages],
            "bubble_theory_from_times": zero_bubble.bubble_from_times(schedule, p, m, f, b, w, V),
            "bubble_simulated": simulated_bubble(schedule, p, m, V, stages),
            "peak_activation_bytes": [st["peak_activation_bytes"] for st in stages],
            "microbatch_activation_bytes": [st["microbatch_activation_bytes"] for st in stages],
            "step_time_s": [st["step_time"] for st in stages],
            "bytes_sent_per_step": float(np.mean([r["pp_bytes"] for r in rows_log])),
            "last_step_timeline": [list(r) for st in stages for r in st["timeline"]]}


def summary(schedule: str, p: int, m: int, V: int, bubble_theory: float, stages, rows_log,
            gantt) -> tuple[dict, list[str]]:
    """The pipeline's figures and lines: the bubble measured, in theory and simulated, the
    op times, the saved activations and the last step's timeline, drawn by
    gantt(timeline, p, width) (show.draw.ascii_gantt: parallel/ does not import show/).
    p stages, m micro-batches, V virtual stages; bubble_theory: PipelineEngine's."""
    pl = figures(schedule, p, m, V, bubble_theory, stages, rows_log)
    lines = [f"  pipeline: {schedule}, p={p}, m={m}" + (f", V={V}" if V > 1 else "")
             + f": bubble measured {pl['bubble_measured']:.3f} (mean "
             f"over stages; per stage "
             + " ".join(f"{b:.3f}" for b in pl["bubble_per_stage"])
             + f"), theory {pl['bubble_theory']:.3f} with equal op times, "
               f"{pl['bubble_theory_from_times']:.3f} with the measured ones, "
               f"{pl['bubble_simulated']:.3f} simulated with each stage's own; "
               f"sent {human_bytes(pl['bytes_sent_per_step'])}/step "
               f"by stage 0"]
    lines.append("  one micro-batch's F / B / W per stage (ms): " + "; ".join(
        "/".join(f"{t * 1e3:.2f}" for t in ops) for ops in pl["op_seconds_per_stage"])
        + (" (B is the whole backward: no W)" if not schedule.startswith("zb") else ""))
    unit = "micro-batches" if V == 1 else "chunk graphs of the largest"   # interleaved: a chunk's graph
    lines.append("  saved activations at peak per stage: " + ", ".join(
        f"{human_bytes(b)} ({b / max(u, 1):.1f} {unit})" for b, u in
        zip(pl["peak_activation_bytes"], pl["microbatch_activation_bytes"])))
    timeline = [r for st in stages for r in st["timeline"]]
    lines.append(f"  last step's timeline ({pl['step_time_s'][0] * 1e3:.1f} ms on stage 0; "
                 f"F forward, B backward" + (", W weight gradients" if schedule.startswith("zb") else "")
                 + (", lower case chunk 1" if V > 1 else "") + ", digits the micro-batch, '.' idle):")
    lines += ["    " + line for line in gantt(timeline, p, width=100).splitlines()]
    return pl, lines
