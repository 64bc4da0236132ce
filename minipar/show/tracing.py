"""--trace FILE.json, started and finished: each rank's clock measured against rank 0's,
every rank's events gathered to rank 0 and written as one file (minipar/trace/__init__.py
says what is recorded and how; docs/pictures.md how to read it).
"""
from __future__ import annotations

import json
import time

import numpy as np

from minipar import comm, trace
from minipar.config import outputs


def process_name(grid) -> str:
    """The process row's name: "rank 5 dp1 tp0 pp1"."""
    if grid is None:
        return "rank 0"
    cp = f" cp{grid.cp_rank}" if grid.cp_size > 1 else ""
    return f"rank {grid.rank} dp{grid.dp_rank}{cp} tp{grid.tp_rank} pp{grid.pp_rank}"


def start(world, name: str, peek: bool = False):
    """Begin recording on every rank of `world` (a comm.Group over all ranks; collective),
    after measuring each rank's clock offset to rank 0. Returns the Recorder."""
    rec = trace.Recorder(name, peek)
    rec.clock = _clock_offsets(world)               # rank 0: [(offset_s, rtt_s)] per rank
    rec.ledger0 = comm.traffic_by_axis()            # what was sent before recording began
    rec.t0 = time.perf_counter()
    trace.install(rec)
    return rec


def _clock_offsets(world):
    """Rank 0: [(offset, round trip)] per rank, offset = rank 0's clock - that rank's."""
    if world is None or world.size == 1:
        return [(0.0, 0.0)]
    out = [(0.0, 0.0)]
    with comm.untracked():
        for r in range(1, world.size):
            if world.rank == 0:
                best = None
                for _ in range(trace.PING_ROUNDS):
                    t_a = time.perf_counter()
                    comm.send(world, np.array([t_a]), r)
                    t_r = float(comm.recv(world, r)[0])
                    t_b = time.perf_counter()
                    if best is None or t_b - t_a < best[1]:
                        best = ((t_a + t_b) / 2 - t_r, t_b - t_a)
                out.append(best)
            elif world.rank == r:
                for _ in range(trace.PING_ROUNDS):
                    comm.recv(world, 0)
                    comm.send(world, np.array([time.perf_counter()]), 0)
    return out


def _events_json(rec, pid, offset, origin):
    """This rank's events in the file's form: microseconds on rank 0's clock since its start."""
    def us(t):
        return round((t + offset - origin) * 1e6, 3)
    out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": rec.name}},
           {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
           {"ph": "M", "name": "thread_name", "pid": pid, "tid": trace.COMPUTE, "args": {"name": "compute"}},
           {"ph": "M", "name": "thread_name", "pid": pid, "tid": trace.COMM, "args": {"name": "communication"}}]
    for ph, name, cat, tid, start, end, args, eid in rec.events:
        if ph == "X":
            e = {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": us(start),
                 "dur": round((end - start) * 1e6, 3)}
            if args:
                e["args"] = args
            out.append(e)
        else:                                       # an async call: its begin and its end
            out.append({"ph": "b", "name": name, "cat": cat, "pid": pid, "tid": tid, "id": eid,
                        "ts": us(start), "args": args})
            out.append({"ph": "e", "name": name, "cat": cat, "pid": pid, "tid": tid, "id": eid,
                        "ts": us(end)})
    return out


def finish(world, path: str | None, meta: dict | None = None):
    """Stop recording; every rank sends its events and ledger to rank 0, which writes `path`
    (atomically: a temporary file, then rename). Collective over `world`. -> the path on
    rank 0, else None."""
    rec = trace.install(None)
    ledger = {}                                     # sent and received while recording
    for axis, now in comm.traffic_by_axis().items():
        before = rec.ledger0.get(axis, {})
        delta = {k: now[k] - before.get(k, 0) for k in ("calls", "bytes_sent", "bytes_recv")}
        if delta["calls"]:
            ledger[str(axis)] = delta
    mine = {"name": rec.name, "ledger": ledger, "origin": rec.t0}
    size = 1 if world is None else world.size
    rank = 0 if world is None else world.rank
    if rank != 0:
        with comm.untracked():
            comm.send(world, np.frombuffer(json.dumps(mine).encode(), np.uint8), 0)
            comm.send(world, np.frombuffer(json.dumps(rec.events).encode(), np.uint8), 0)
        return None
    origin = rec.t0
    ledgers, names = [], []
    with outputs.replaced_atomically(path) as f:
        f.write('{"traceEvents": [\n')
        first = True
        for r in range(size):
            if r == 0:
                info, events = mine, rec.events
            else:
                with comm.untracked():
                    info = json.loads(comm.recv(world, r).tobytes())
                    events = json.loads(comm.recv(world, r).tobytes())
            ledgers.append(info["ledger"])
            names.append(info["name"])
            other = trace.Recorder(info["name"])
            other.events = events
            for e in _events_json(other, r, rec.clock[r][0], origin):
                f.write(("" if first else ",\n") + json.dumps(e))
                first = False
        about = {"world": size, "process_names": names, "ledger_by_axis": ledgers,
                 "clock_offsets_us": [round(o * 1e6, 3) for o, _ in rec.clock],
                 "clock_round_trip_us": [round(t * 1e6, 3) for _, t in rec.clock],
                 "clock": "each rank's perf_counter shifted by its offset to rank 0's "
                          "(ping-pong, the round with the smallest round trip)",
                 **(meta or {})}
        f.write('\n], "displayTimeUnit": "ms", "otherData": {"minipar": '
                + json.dumps(about) + "}}\n")
    return path
