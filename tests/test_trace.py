"""--trace: the file is a valid Trace Event Format trace, its spans nest, its forwards and
backwards follow the schedule, its comm events add up to the ledger byte for byte, and a
3D job has one process row per rank. traceview.problems() is shown to catch planted faults.
"""
import copy
import itertools
import json

import pytest

from minipar import comm, trace
from minipar.show import traceview
from minipar.parallel.pipeline import schedules
from trainer_runs import mpirun, run_tiny


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    d = tmp_path_factory.mktemp("trace1")
    path = str(d / "t.json")
    run_tiny("--n-layer", "2", "--steps", "2", "--micro-batches", "2", "--trace", path,
             "--verify", "--save", str(d / "ckpt"))
    return traceview.load(path)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """dp 2 x pp 2, ZeRO-1, 1F1B over 4 micro-batches."""
    path = str(tmp_path_factory.mktemp("trace4") / "t.json")
    p = mpirun(4, "--n-layer", "2", "--dp", "2", "--pp", "2", "--zero", "1", "--micro-batches", "4",
               "--steps", "2", "--trace", path)
    assert p.returncode == 0, p.stderr[-3000:]
    return traceview.load(path)


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory):
    """3D: dp 2 x tp 2 x pp 2, GPipe over 2 micro-batches."""
    path = str(tmp_path_factory.mktemp("trace8") / "t.json")
    p = mpirun(8, "--n-layer", "2", "--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2",
               "--schedule", "gpipe", "--steps", "1", "--trace", path, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    return traceview.load(path)


def schedule_order(name, stage, p, m):
    """The test's own reading of the schedule (traceview.scheduled is what audit uses)."""
    return [(type(i).__name__[0], i.mb) for i in schedules.schedule(name, stage, p, m)
            if isinstance(i, (schedules.Forward, schedules.Backward))]


# --- the format -----------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["one_process", "four_ranks", "eight_ranks"])
def test_valid_trace_events_that_nest(which, request):
    t = request.getfixturevalue(which)
    json.dumps(t)                                              # plain JSON all the way down
    assert traceview.problems(t) == []
    assert traceview.audit(t) == []
    assert t["displayTimeUnit"] == "ms"
    threads = {(e["pid"], e["args"]["name"]) for e in t["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    n = t["otherData"]["minipar"]["world"]
    assert threads == {(pid, name) for pid in range(n) for name in ("compute", "communication")}


def test_problems_catches_planted_faults(four_ranks):
    """Each planted fault gives a problem line (the checker can fail)."""
    events = four_ranks["traceEvents"]
    i_x = next(i for i, e in enumerate(events) if e["ph"] == "X" and e["cat"] == "layer")
    i_b = next(i for i, e in enumerate(events) if e["ph"] == "b")
    i_e = next(i for i, e in enumerate(events) if e["ph"] == "e" and e["id"] == events[i_b]["id"]
               and e["pid"] == events[i_b]["pid"])
    step = next(e for e in events if e["ph"] == "X" and e["cat"] == "step")

    def planted(change):
        t = copy.deepcopy(four_ranks)
        change(t["traceEvents"])
        return traceview.problems(t)

    assert any("no dur" in p for p in planted(lambda ev: ev[i_x].pop("dur")))
    assert any("without a begin" in p or "never ends" in p for p in planted(lambda ev: ev.pop(i_b)))
    assert any("never ends" in p for p in planted(lambda ev: ev.pop(i_e)))
    # a span that starts inside a step and outlives it
    overlap = dict(step, name="planted", ts=step["ts"] + step["dur"] / 2, dur=step["dur"])
    assert any("overlaps" in p for p in planted(lambda ev: ev.append(overlap)))
    assert any("unexpected phase" in p for p in planted(lambda ev: ev.append({"ph": "Z"})))


def test_audit_catches_planted_breaches(four_ranks):
    """A lost comm event, a byte miscounted, two micro-batches swapped, a missing process row:
    each is one audit line (audit can fail)."""
    def planted(change):
        t = copy.deepcopy(four_ranks)
        change(t["traceEvents"])
        return traceview.audit(t)

    def first(ev, test):
        return next(i for i, e in enumerate(ev) if test(e))

    def drop_call(ev):
        ev.pop(first(ev, lambda e: e["ph"] == "X" and e["cat"] == "comm" and e["pid"] == 2))

    def miscount(ev):
        ev[first(ev, lambda e: e["ph"] == "X" and e["cat"] == "comm")]["args"]["bytes_sent"] += 1

    def swap(ev):
        mbs = [e for e in ev if e["ph"] == "X" and e["cat"] == "microbatch" and e["pid"] == 1]
        mbs[0]["args"], mbs[1]["args"] = mbs[1]["args"], mbs[0]["args"]

    def unname(ev):
        ev.pop(first(ev, lambda e: e["ph"] == "M" and e["name"] == "process_name" and e["pid"] == 3))

    assert any(line.startswith("rank 2: comm events") for line in planted(drop_call))
    assert any("comm events" in line for line in planted(miscount))
    assert any(line.startswith("rank 1 step 0: forwards/backwards") for line in planted(swap))
    assert any(line.startswith("process rows") for line in planted(unname))


def test_process_row_per_rank_named_by_grid_coordinates(eight_ranks):
    procs = traceview.processes(eight_ranks)
    assert sorted(procs) == list(range(8))
    assert all(p["name"] == f"rank {pid} dp{p['dp']} tp{p['tp']} pp{p['pp']}" for pid, p in procs.items())
    assert {(p["dp"], p["tp"], p["pp"]) for p in procs.values()} == set(itertools.product((0, 1), repeat=3))
    # tp is the fastest-varying axis (docs/design.md §6): ranks 0 and 1 are one tp group
    assert (procs[0]["tp"], procs[1]["tp"]) == (0, 1) and procs[0]["dp"] == procs[1]["dp"]


# --- what it holds ----------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["four_ranks", "eight_ranks"])
def test_comm_events_add_up_to_the_ledger(which, request):
    t = request.getfixturevalue(which)
    ledgers = t["otherData"]["minipar"]["ledger_by_axis"]
    got = traceview.comm_bytes(t)
    for pid, ledger in enumerate(ledgers):
        assert got[pid] == ledger, f"rank {pid}: events {got[pid]} != ledger {ledger}"
    axes = set().union(*(set(led) for led in ledgers))
    assert {"pp", "dp"} <= axes and ({"zero"} if which == "four_ranks" else {"tp"}) <= axes


def test_comm_events_name_op_algorithm_peers_bytes_axis(four_ranks):
    calls = traceview.spans(four_ranks, "comm")
    for e in calls:
        a = e["args"]
        assert a["op"] == e["name"] and a["algorithm"] and a["axis"] in ("dp", "pp", "zero", "world")
        sent = sum(m[3] for m in a["messages"] if m[1] == "send")
        assert sent == a["bytes_sent"] and sum(m[3] for m in a["messages"] if m[1] == "recv") == a["bytes_recv"]
        assert set(a["peers"]) == {m[2] for m in a["messages"]}
    kinds = {(e["name"], e["args"]["algorithm"]) for e in calls}
    assert ("send", "point-to-point") in kinds and any(op == "reduce_scatter" for op, _ in kinds)
    # the pipeline's sends and dp's buckets run in the background: async events
    assert any(e["ph"] == "b" and e["name"] == "send" for e in calls)


@pytest.mark.parametrize("which,schedule,p,m", [("four_ranks", "1f1b", 2, 4),
                                                ("eight_ranks", "gpipe", 2, 2)])
def test_forwards_and_backwards_follow_the_schedule(which, schedule, p, m, request):
    t = request.getfixturevalue(which)
    procs = traceview.processes(t)
    for step in traceview.steps(t):
        for pid, coords in procs.items():
            assert traceview.order(t, pid, step) == schedule_order(schedule, coords["pp"], p, m), \
                f"rank {pid} step {step}"


def test_one_process_spans(one_process):
    t = one_process
    assert traceview.order(t, 0, 0) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    names = [e["name"] for e in traceview.spans(t, "layer", 0)]
    forward = ["embed forward", "h.0 forward", "h.1 forward", "head forward"]
    backward = ["head backward", "h.1 backward", "h.0 backward", "embed backward"]
    assert names[:8] == forward + backward, names[:8]
    cats = {e["cat"] for e in traceview.spans(t)}
    assert {"step", "microbatch", "layer", "wait", "optimizer", "checkpoint", "eval", "verify"} <= cats
    # the twin is one span: nothing recorded inside it
    twin = traceview.spans(t, "verify")[0]
    assert not [e for e in traceview.spans(t) if twin["ts"] < e["ts"] < twin["end"]]


def test_layer_spans_nest_in_their_microbatch(four_ranks):
    t = four_ranks
    for pid in range(4):
        mbs = traceview.spans(t, "microbatch", pid)
        for e in traceview.spans(t, "layer", pid):
            if any(v["cat"] == "eval" and v["ts"] <= e["ts"] <= v["end"] for v in traceview.spans(t, "eval", pid)):
                continue
            home = [m for m in mbs if m["ts"] <= e["ts"] + 0.01 and e["end"] <= m["end"] + 0.01]
            assert len(home) == 1 and home[0]["args"]["kind"] == e["args"]["pass"][0].upper(), e


def test_messages_arrive_after_they_are_sent_on_the_aligned_clock(four_ranks):
    """Clocks aligned to rank 0: each pipeline payload's receive completes after its send began
    (to within the measured ping-pong round trip)."""
    t = four_ranks
    rtt = max(t["otherData"]["minipar"]["clock_round_trip_us"])
    sends = [e for e in traceview.spans(t, "comm") if e["name"] == "send" and e["args"]["axis"] == "pp"]
    recvs = [e for e in traceview.spans(t, "comm") if e["name"] == "recv" and e["args"]["axis"] == "pp"]
    assert sends and len(sends) == len(recvs)
    by_pair = {}
    for e in sends:
        by_pair.setdefault((e["pid"], e["args"]["peers"][0]), []).append(e)
    for e in sorted(recvs, key=lambda e: e["ts"]):
        s = by_pair[(e["args"]["peers"][0], e["pid"])].pop(0)
        assert e["end"] >= s["ts"] - rtt, (s, e)


def test_off_means_nothing_recorded():
    assert trace.RECORDER is None
    assert trace.span("x", "y") is trace.NOTHING and trace.layer("h.0") is trace.NOTHING
    g = comm.Group.__new__(comm.Group)      # Call keeps no recorder when tracing is off
    g.axis, g.comm, g.trace, g.remote = None, None, False, (False,)
    assert comm.calls.Call(g, "all_reduce", 1, 0).rec is None


def test_an_unwritable_trace_path_is_a_config_error(capsys, tmp_path):
    """Checked on rank 0 before the ranks agree, like --log: exit 2, one line naming it."""
    from trainer_runs import TINY, assert_main_exits_2
    missing = str(tmp_path / "no-such-dir" / "t.json")
    assert_main_exits_2(TINY + ["--trace", missing], ["--trace", missing, "does not exist"], capsys,
                        "missing directory")
    assert_main_exits_2(TINY + ["--trace", str(tmp_path)], ["--trace", "is a folder"], capsys,
                        "a directory")
