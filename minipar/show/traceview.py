"""Reading a --trace file back (minipar/trace/__init__.py writes it): its process rows, spans and
messages, the pipeline timeline of one step, and the checks that make it a valid trace.
minipar.plot and minipar.explain draw from these; the tests check with them.

    t = load("trace.json")
    processes(t)            {pid: {"name", "rank", "dp", "cp", "tp", "pp"}}
    spans(t, cat="comm")    the "X" events (and async "b" begins, with "end"/"dur" filled in)
    problems(t)             [] for a valid trace, else one line per problem
    comm_bytes(t)           {pid: {axis: {"calls", "bytes_sent", "bytes_recv"}}} from the events
    order(t, pid, step)     [("F", 0), ("B", 0), ...]: a rank's micro-batch spans in one step
    audit(t)                problems(t), and the trainer's promises: a row per rank, comm
                            events equal to the ledger, forwards and backwards as scheduled
    pipeline_timeline(t)    one step's forwards and backwards per stage, and its bubble
"""
from __future__ import annotations

import json
import re
from collections import defaultdict

_NAME = re.compile(r"rank (\d+) dp(\d+)(?: cp(\d+))? tp(\d+) pp(\d+)")      # cp only with --cp


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def processes(trace: dict) -> dict:
    """{pid: {"name", "rank", "dp", "cp", "tp", "pp"}} from the process_name metadata events."""
    out = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            name = e["args"]["name"]
            m = _NAME.fullmatch(name)
            coords = dict(zip(("rank", "dp", "cp", "tp", "pp"), (int(g or 0) for g in m.groups()))) if m else \
                {"rank": e["pid"], "dp": 0, "cp": 0, "tp": 0, "pp": 0}
            out[e["pid"]] = {"name": name, **coords}
    return out


def spans(trace: dict, cat: str | None = None, pid: int | None = None) -> list:
    """The complete spans ("X"), and each async call's begin ("b") with its "dur" from its
    end ("e"), in file order; each gets "end" = ts + dur."""
    ends = {(e["pid"], e["id"]): e["ts"] for e in trace["traceEvents"] if e.get("ph") == "e"}
    out = []
    for e in trace["traceEvents"]:
        ph = e.get("ph")
        if ph not in ("X", "b") or (cat is not None and e.get("cat") != cat) or \
                (pid is not None and e["pid"] != pid):
            continue
        e = dict(e)
        if ph == "b":
            e["dur"] = ends.get((e["pid"], e["id"]), e["ts"]) - e["ts"]
        e["end"] = e["ts"] + e["dur"]
        out.append(e)
    return out


def problems(trace: dict, slack_us: float = 0.01) -> list[str]:
    """What makes `trace` not a valid minipar trace, one line each ([] if none):
    every "X" event has numeric ts, dur >= 0, pid and tid; every async "b" has exactly one
    "e" with the same pid, cat, name and id, not before it; the spans of one thread nest
    and never partly overlap (slack_us: rounding to the microsecond's thousandth)."""
    out = []
    events = trace.get("traceEvents")
    if not isinstance(events, list):
        return ["no traceEvents list"]
    opened = {}
    by_thread = defaultdict(list)
    for i, e in enumerate(events):
        ph = e.get("ph")
        if ph == "X":
            missing = [k for k in ("ts", "dur", "pid", "tid") if not isinstance(e.get(k), (int, float))]
            if missing:
                out.append(f"event {i} ({e.get('name')!r}): no {', '.join(missing)}")
                continue
            if e["dur"] < 0:
                out.append(f"event {i} ({e.get('name')!r}): negative dur {e['dur']}")
            by_thread[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], i, e.get("name")))
        elif ph in ("b", "e"):
            key = (e.get("pid"), e.get("cat"), e.get("name"), e.get("id"))
            if ph == "b":
                if key in opened:
                    out.append(f"event {i}: async {key} begun twice")
                opened[key] = e.get("ts")
            elif key not in opened:
                out.append(f"event {i}: async end {key} without a begin")
            else:
                if e.get("ts", 0) < opened.pop(key):
                    out.append(f"event {i}: async {key} ends before it begins")
        elif ph != "M":
            out.append(f"event {i}: unexpected phase {ph!r}")
    out += [f"async {key} never ends" for key in opened]
    for (pid, tid), rows in by_thread.items():
        rows.sort(key=lambda r: (r[0], -r[1]))
        stack = []                                  # ends of the spans enclosing this one
        for start, end, i, name in rows:
            while stack and stack[-1][0] <= start + slack_us:
                stack.pop()
            if stack and end > stack[-1][0] + slack_us:
                out.append(f"pid {pid} tid {tid}: {name!r} (event {i}) overlaps "
                           f"{stack[-1][1]!r} without nesting in it")
            stack.append((end, name))
    return out


def comm_bytes(trace: dict) -> dict:
    """{pid: {axis: {"calls", "bytes_sent", "bytes_recv"}}} summed over the comm events:
    what trace metadata's ledger_by_axis must equal."""
    out = defaultdict(lambda: defaultdict(lambda: {"calls": 0, "bytes_sent": 0, "bytes_recv": 0}))
    for e in spans(trace, cat="comm"):
        a = e["args"]
        entry = out[e["pid"]][str(a["axis"])]
        entry["calls"] += 1
        entry["bytes_sent"] += a["bytes_sent"]
        entry["bytes_recv"] += a["bytes_recv"]
    return {pid: dict(axes) for pid, axes in out.items()}


def orders(trace: dict) -> dict:
    """{pid: {step: [(kind, mb)]}}: each rank's micro-batch spans inside each training step,
    in the order they started (one pass over the trace)."""
    by_pid = defaultdict(lambda: ([], []))
    for e in spans(trace):
        if e["cat"] in ("step", "microbatch"):
            by_pid[e["pid"]][e["cat"] == "microbatch"].append(e)
    out = {}
    for pid, (windows, mbs) in by_pid.items():
        windows.sort(key=lambda e: e["ts"])
        mbs.sort(key=lambda e: e["ts"])
        mine = out[pid] = {w["args"]["step"]: [] for w in windows}
        k = 0
        for e in mbs:                           # windows and spans both in time order
            while k < len(windows) and windows[k]["end"] + 0.01 < e["end"]:
                k += 1
            if k < len(windows) and windows[k]["ts"] <= e["ts"]:
                chunk = e["args"].get("chunk", 0)               # interleaved: F1 is chunk 1's forward
                mine[windows[k]["args"]["step"]].append((e["args"]["kind"] + (str(chunk) if chunk else ""),
                                                         e["args"]["mb"]))
    return out


def order(trace: dict, pid: int, step: int) -> list[tuple[str, int]]:
    """[(kind, mb)] of the micro-batch spans of rank `pid` inside training step `step`, in
    the order they started."""
    return orders(trace).get(pid, {}).get(step, [])


def scheduled(schedule: str | None, stage: int, n_stages: int, n_micro: int,
              virtual: int = 1) -> list[tuple[str, int]]:
    """[(kind, mb)] that a stage must run: its schedule's Forward, Backward and WeightGrad
    instructions (parallel/schedules.py; kind F, B or W, with the chunk after it when not 0),
    or, without a pipeline, each micro-batch's forward then backward."""
    from minipar.parallel.pipeline import schedules         # noqa: PLC0415
    if n_stages == 1:
        return [(kind, mb) for mb in range(n_micro) for kind in "FB"]
    return [(i.short + (str(i.chunk) if i.chunk else ""), i.mb)
            for i in schedules.schedule(schedule, stage, n_stages, n_micro, virtual)
            if isinstance(i, schedules.COMPUTE)]


def audit(trace: dict) -> list[str]:
    """problems(trace), and what minipar.train --trace promises, one line per breach:
    one process row per rank; each rank's comm events equal, per axis, the calls and bytes its
    ledger counted while recording (otherData.minipar.ledger_by_axis); in every step, each
    rank's forwards and backwards in its schedule's order."""
    out = problems(trace)
    meta = trace.get("otherData", {}).get("minipar", {})
    procs = processes(trace)
    if sorted(procs) != list(range(meta.get("world", 0))):
        out.append(f"process rows {sorted(procs)} != ranks 0..{meta.get('world', 0) - 1}")
    got = comm_bytes(trace)
    for pid, ledger in enumerate(meta.get("ledger_by_axis", [])):
        if got.get(pid, {}) != ledger:
            out.append(f"rank {pid}: comm events {got.get(pid, {})} != ledger {ledger}")
    layout = meta.get("layout", {})
    seen_all, all_steps = orders(trace), steps(trace)
    for pid, where in sorted(procs.items()):
        want = scheduled(meta.get("schedule"), where["pp"], layout.get("pp", 1), meta.get("micro_batches", 1),
                         meta.get("virtual_stages", 1))
        for step in all_steps:
            seen = seen_all.get(pid, {}).get(step, [])
            if seen != want:
                out.append(f"rank {pid} step {step}: forwards/backwards {seen} != scheduled {want}")
    return out


def steps(trace: dict) -> list[int]:
    """The training steps the trace holds (from the "step" spans)."""
    return sorted({e["args"]["step"] for e in spans(trace, cat="step")})


def pipeline_timeline(trace: dict, step: int | None = None) -> dict:
    """One training step's forwards and backwards on each pipeline stage (the ranks at dp 0,
    tp 0), as measured: {"timeline": [(stage, kind, mb, start_s, end_s)] (kind F, B or W, and
    the chunk after it when not 0), "n_stages",
    "step", "bubble", "bubble_per_stage", "schedule", "span_per_stage"}. Times are seconds
    from the step's earliest schedule start. The bubble is the summary's definition
    (docs/pipeline.md): each stage's idle fraction of the longest stage's schedule span (from
    its first instruction to its last send done), then the mean over stages. A run without
    --pp is one stage whose span runs from its first forward to its last backward."""
    procs = processes(trace)
    stage_pid = {p["pp"]: pid for pid, p in procs.items() if p["dp"] == p["cp"] == p["tp"] == 0}
    all_steps = steps(trace)
    if not all_steps:
        raise ValueError("the trace has no training steps (was it written by minipar.train --trace?)")
    step = all_steps[-1] if step is None else step
    if step not in all_steps:
        raise ValueError(f"step {step} is not in the trace (it has steps {all_steps[0]}..{all_steps[-1]})")
    rows, span, schedule = [], {}, None
    for stage, pid in sorted(stage_pid.items()):
        window = [e for e in spans(trace, "step", pid) if e["args"]["step"] == step][0]

        def inside(e):
            return window["ts"] <= e["ts"] and e["end"] <= window["end"] + 0.01
        mbs = [e for e in spans(trace, "microbatch", pid) if inside(e)]
        sched = [e for e in spans(trace, "pipeline", pid) if e["name"] == "schedule" and inside(e)]
        if sched:
            span[stage] = (sched[0]["ts"], sched[0]["end"])
            schedule = sched[0]["args"].get("schedule")
        elif mbs:
            span[stage] = (min(e["ts"] for e in mbs), max(e["end"] for e in mbs))
        rows += [(stage, e["args"]["kind"] + (str(e["args"].get("chunk", 0)) if e["args"].get("chunk") else ""),
                  e["args"]["mb"], e["ts"], e["end"]) for e in mbs]
    t0 = min(a for a, _ in span.values())
    longest = max(b - a for a, b in span.values())
    bubbles = []
    for stage in sorted(span):
        busy = sum(end - start for s, _, _, start, end in rows if s == stage)
        bubbles.append(1.0 - busy / longest if longest > 0 else 0.0)
    return {"timeline": [(s, k, mb, (a - t0) / 1e6, (b - t0) / 1e6) for s, k, mb, a, b in rows],
            "n_stages": len(span), "step": step, "schedule": schedule,
            "bubble": sum(bubbles) / len(bubbles), "bubble_per_stage": bubbles,
            "span_per_stage": [(span[s][1] - span[s][0]) / 1e6 for s in sorted(span)]}
