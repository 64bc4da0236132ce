"""The 1F1B pipeline in python -m minipar.explain (1f1b, 4 stages): a short run of
python -m minipar.train --pp P with its trace on, the trainer's own; what it shows: the last
step's measured timeline and its bubble beside the theory's, the same schedule simulated
(schedules.check), and each stage's instructions by phase (warm-up, steady, cool-down); and
the drawing, as Gantt charts.
"""
from __future__ import annotations

from minipar.show.draw import ascii_gantt, timeline_svg


# --- 1F1B: the trainer's own trace ------------------------------------------------------------------

def pipeline_argv(p: int, path: str) -> list[str]:
    """A short 1F1B run: P stages of one layer of the default width, 2P micro-batches of one
    sequence, 2 steps. (Narrower layers are faster to run but their forwards and backwards
    are then too short beside the messages to show the schedule's shape.)"""
    m = 2 * p
    return ["--pp", str(p), "--schedule", "1f1b", "--micro-batches", str(m), "--batch-size", str(m),
            "--n-layer", str(p), "--steps", "2", "--sample", "0", "--trace", path]


# --- 1F1B: what the trainer's trace shows --------------------------------------------------

def schedule_phases(instructions: list) -> list[tuple[str, list]]:
    """A 1F1B stage's instructions as [("warm-up", [...]), ("steady", [...]), ("cool-down", [...])]:
    each Recv goes with the Forward/Backward after it, each Send with the one before; warm-up
    ends at the forward paired with the first backward, cool-down starts after the backward
    paired with the last forward."""
    from minipar.parallel.pipeline.schedules import Backward, Forward, SENDS     # noqa: PLC0415
    ops, waiting = [], []
    for ins in instructions:
        if isinstance(ins, (Forward, Backward)):
            ops.append([ins] if not waiting else waiting + [ins])
            waiting = []
        elif isinstance(ins, SENDS):
            ops[-1].append(ins)
        else:
            waiting.append(ins)
    kinds = ["B" if any(isinstance(i, Backward) for i in op) else "F" for op in ops]
    first_b = kinds.index("B") if "B" in kinds else len(ops)
    steady = first_b - 1 if first_b > 0 and kinds[first_b - 1] == "F" else first_b
    last_f = len(kinds) - 1 - kinds[::-1].index("F") if "F" in kinds else -1
    cool = last_f + 2 if last_f + 1 < len(kinds) and kinds[last_f + 1] == "B" else last_f + 1
    cuts = [("warm-up", ops[:steady]), ("steady", ops[steady:cool]), ("cool-down", ops[cool:])]
    return [(name, [i for op in part for i in op]) for name, part in cuts]


def pipeline_picture(trace: dict) -> dict:
    """traceview.pipeline_timeline of the last step, with the theory and each stage's schedule."""
    from minipar.show import traceview                                       # noqa: PLC0415
    from minipar.parallel.pipeline import schedules                              # noqa: PLC0415
    meta = trace["otherData"]["minipar"]
    tl = traceview.pipeline_timeline(trace)
    p, m, name = tl["n_stages"], meta["micro_batches"], tl["schedule"] or meta["schedule"]
    tl["micro_batches"] = m
    tl["theory"] = schedules.bubble_theory(name, p, m)
    tl["stages"] = [schedule_phases(schedules.schedule(name, s, p, m)) for s in range(p)]
    tl["simulated"] = schedules.check(p, m, name).timeline             # F = 1, B = 2 time units
    tl["title"] = (f"{name} pipeline, p={p} stages, m={m} micro-batches, step {tl['step']} as measured: "
                   f"bubble {tl['bubble']:.3f} (theory (p-1)/(m+p-1) = {tl['theory']:.3f})")
    return tl


# --- the drawing ----------------------------------------------------------------------------------
def pipeline_text(tl) -> str:
    out = [tl["title"], "", ascii_gantt(tl["timeline"], tl["n_stages"], width=100),
           "idle per stage: " + ", ".join(f"{b:.3f}" for b in tl["bubble_per_stage"]), "",
           "the same schedule simulated (schedules.check: F 1 unit, B 2, messages free):",
           ascii_gantt(tl["simulated"], tl["n_stages"], width=100), "",
           f"each stage's instructions (schedules.schedule('{tl['schedule'] or '1f1b'}', stage, "
           f"{tl['n_stages']}, {tl['micro_batches']})):"]
    for s, phases in enumerate(tl["stages"]):
        for name, ins in phases:
            words = [str(i) for i in ins] or ["(none)"]
            line = f"  stage {s} {name + ':':<10}"
            for w in words:
                if len(line) + len(w) > 110:
                    out.append(line)
                    line = " " * 20
                line += " " + w
            out.append(line)
    out.append("F forward, B backward, digits the micro-batch, '.' idle: the bubble")
    return "\n".join(out)


def pipeline_svg(tl) -> str:
    return timeline_svg(tl["timeline"], tl["n_stages"], title=tl["title"])
