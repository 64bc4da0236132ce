"""python -m minipar.explain hsdp: hybrid sharding (--zero 3 --shard-group 2 on 4 ranks) read back
from a real trainer run: which ranks each collective ran on, and each rank's bytes inside its
shard group and across its replicas, checked against the formulas; then planted mistakes in the
trace and in a formula, each named in red, with exit status 1.

One real command per session (one mpirun of the trainer, about 8 s on 2 cores); the plants are
edits of its trace, drawn without MPI.
"""
import copy
import os
import shutil
import subprocess
import sys

import pytest

from minipar.explain import cli as explain, hsdp
from minipar.parallel.zero import formulas
from minipar.show import traceview

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIPAR_EXPLAIN_TIMEOUT="120")
SHARD = (65536 + 4 * 199936 + 8704) // 2        # a rank's shard of every unit, bytes: each rank's all-reduces


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """`python -m minipar.explain hsdp --out DIR` -> (process, DIR)."""
    out = str(tmp_path_factory.mktemp("explain-hsdp"))
    proc = subprocess.run([sys.executable, "-m", "minipar.explain", "hsdp", "--out", out], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, out


def files(out):
    return os.path.join(out, "explain-hsdp-p4.json"), os.path.join(out, "explain-hsdp-p4.jsonl")


def test_shard_and_replica_groups_and_their_bytes(clean):
    proc, out = clean
    trace = traceview.load(files(out)[0])
    for r in range(4):                                  # the trace itself: groups by op
        groups = {(e["args"]["op"], tuple(e["args"]["group"])) for e in traceview.spans(trace, "comm", r)
                  if e["args"]["axis"] == "zero"}
        assert groups == {("all_gather", (r & 2, r | 1)), ("reduce_scatter", (r & 2, r | 1)),
                          ("all_reduce", (r % 2, r % 2 + 2))}, (r, groups)
    pic = hsdp.hsdp_picture(*files(out))
    assert pic.problems == [] and "PROBLEM" not in proc.stdout, pic.problems
    assert (pic.S, pic.R) == (2, 2) and pic.groups[1] == {"shard": [0, 1], "replica": [1, 3]}
    for r in range(4):      # inside: 3 calls of half of every unit; across: the shard, once
        assert pic.sent[r] == {"shard": 3 * SHARD, "replica": SHARD}
    assert sum(pic.sent[0].values()) == formulas.traffic_theory(3, 2 * SHARD // 4, 2, 4, 1, 2) == pic.log_bytes
    assert pic.formula["flat"] == formulas.traffic_theory(3, 2 * SHARD // 4, 4, 4, 1) > sum(pic.sent[0].values())
    assert "shard group 0   [rank 0]------[rank 1]" in proc.stdout
    svg = open(os.path.join(out, "explain-hsdp-p4.svg")).read()
    assert svg.count('stroke-dasharray="8 5"') == 2 and "replica group [1, 3]" in svg and "PROBLEM" not in svg


def _zero(trace, rank, op):
    """The trace's own begin events of a rank's zero-axis calls `op` in step 1 (not the final validation's)."""
    w = next(e for e in traceview.spans(trace, "step", rank) if e["args"]["step"] == 1)
    return [e for e in trace["traceEvents"] if e.get("pid") == rank and e.get("ph") in ("b", "X")
            and e.get("cat") == "comm" and e["args"]["axis"] == "zero" and e["args"]["op"] == op
            and w["ts"] <= e["ts"] <= w["end"]]


def reduced_inside(t):
    _zero(t, 0, "all_reduce")[-1]["args"]["group"] = [0, 1]


def gathered_flat(t):
    _zero(t, 1, "all_gather")[-1]["args"]["group"] = [0, 1, 2, 3]


def all_reduce_dropped(t):
    e = _zero(t, 3, "all_reduce")[-1]
    t["traceEvents"] = [x for x in t["traceEvents"] if not (x.get("pid") == 3 and x.get("id") == e["id"]
                                                            and x.get("cat") == "comm")]


PLANTED = [
    (reduced_inside, "rank 0: all_reduce on ranks [0, 1], not on its replica group [0, 2]"),
    (gathered_flat, "rank 1: all_gather on ranks [0, 1, 2, 3], not on its shard group [0, 1]"),
    (all_reduce_dropped, "rank 3: its all_reduces send "),
    (all_reduce_dropped, "rank 3: ZeRO sent "),
]


@pytest.mark.parametrize("plant,line", PLANTED, ids=[f"{p.__name__}-{i}" for i, (p, _) in enumerate(PLANTED)])
def test_a_planted_mistake_is_a_problem_in_red_and_exit_1(plant, line, clean, tmp_path, monkeypatch, capsys):
    _, out = clean
    trace = copy.deepcopy(traceview.load(files(out)[0]))
    plant(trace)

    def launch(p, argv):                                # the planted trace in place of the run's
        import json                                                                 # noqa: PLC0415
        with open(argv[argv.index("--trace") + 1], "w") as f:
            json.dump(trace, f)
        shutil.copy(files(out)[1], argv[argv.index("--log") + 1])
    monkeypatch.setattr(explain, "mpirun", launch)
    monkeypatch.setattr(explain, "write_png", lambda svg, path: None)
    assert explain.main(["hsdp", "--out", str(tmp_path)]) == 1
    stdout, err = capsys.readouterr()
    hits = [x[len("PROBLEM: "):] for x in stdout.splitlines() if x.startswith("PROBLEM: " + line)]
    assert hits, f"{line!r} not among:\n{stdout[-3000:]}"
    assert f"minipar.explain: problem: {hits[0]}\n" in err
    assert 'fill="#c00000">PROBLEM: ' + hits[0] in (tmp_path / "explain-hsdp-p4.svg").read_text()


def test_a_formula_without_the_replicas_all_reduce_disagrees(clean, monkeypatch):
    """formulas.traffic_theory made to forget the all-reduce across replicas (R = 1): named."""
    _, out = clean
    flat = formulas.traffic_theory
    monkeypatch.setattr(formulas, "traffic_theory", lambda stage, P, N, s, M, R=1, reshard=True:
                        flat(stage, P, N, s, M))
    problems = hsdp.hsdp_picture(*files(out)).problems
    assert f"rank 0: ZeRO sent {4 * SHARD} B in step 1; formulas.traffic_theory with R = 2: {3 * SHARD} B" in problems


def test_hsdp_draws_4_ranks_only(capsys):
    assert explain.main(["hsdp", "--p", "2"]) == 2
    assert capsys.readouterr().err == "minipar.explain: error: --p 2: hsdp runs the trainer on 4 ranks\n"
