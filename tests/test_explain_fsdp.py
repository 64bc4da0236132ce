"""python -m minipar.explain fsdp: ZeRO-3's all-gathers and reduce-scatters, read back from three
real trainer runs (prefetch 0, prefetch 1, prefetch 1 with reshard after forward off) and checked
against ZeRO's formulas; then planted mistakes, in a trace or in a formula, each of which the
reader must name, in red in the drawing, with exit status 1.

One real command per session (three mpiruns of the trainer on 4 ranks, about 20 s on 2 cores);
the planted mistakes are edits of its traces and logs, drawn without MPI.
"""
import copy
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from minipar.explain import cli as explain, fsdp
from minipar.parallel.zero import formulas
from minipar.plan import comm_bytes
from minipar.show import traceview

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIPAR_EXPLAIN_TIMEOUT="150")
K0, K1, KEEP = fsdp.fsdp_settings(1)
UNIT = {"wte": 65536, "h": 199936, "wpe": 8704}      # padded bytes: 16384, 49984 and 2176 float32 (N = 4)
ALL, OUTER = UNIT["wte"] + 4 * UNIT["h"] + UNIT["wpe"], UNIT["wte"] + UNIT["wpe"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """`python -m minipar.explain fsdp --out DIR` -> (process, {setting: Run}, DIR)."""
    out = str(tmp_path_factory.mktemp("explain-fsdp"))
    proc = subprocess.run([sys.executable, "-m", "minipar.explain", "fsdp", "--out", out], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, {s: fsdp.load_run(s, *fsdp.fsdp_files(out, 4, s)) for s in (K0, K1, KEEP)}, out


def in_step(trace, rank, cat, step=1):
    """A rank's events of category `cat` inside training step `step`, in time order, straight from the trace."""
    window = next(e for e in traceview.spans(trace, "step", rank) if e["args"]["step"] == step)
    return sorted((e for e in traceview.spans(trace, cat, rank) if window["ts"] <= e["ts"] <= window["end"]),
                  key=lambda e: e["ts"])


def zero_calls(trace, rank, op):
    """A rank's ZeRO all_gather or reduce_scatter slices in step 1."""
    return [e for e in in_step(trace, rank, "comm") if e["args"]["axis"] == "zero" and e["args"]["op"] == op]


def layer(trace, rank, name):
    return next(e for e in in_step(trace, rank, "layer") if e["name"] == name)


# --- the clean runs ---------------------------------------------------------------------------------

def test_the_traces_hold_the_formulas_calls_and_bytes(clean):
    """Read without the picture's reader: per rank and step, 6 units (wte, h.0-h.3, wpe + ln_f), each
    all-gathered twice (once with reshard off) and reduce-scattered once, (N-1)/N of its bytes a call."""
    _, runs, _ = clean
    for s, run in runs.items():
        rs, ag = formulas.collectives_per_step(3, 1, s.reshard)
        for r in range(4):
            gathers, scatters = zero_calls(run.trace, r, "all_gather"), zero_calls(run.trace, r, "reduce_scatter")
            assert (len(gathers), len(scatters)) == (6 * ag, 6 * rs), (s, r)
            units = [UNIT["wte"], UNIT["wpe"]] + 4 * [UNIT["h"]]
            assert sorted(e["args"]["bytes_sent"] for e in scatters) == sorted(3 * n // 4 for n in units)
            assert sorted(e["args"]["bytes_sent"] for e in gathers) == sorted(3 * n // 4 for n in units * ag)
            sent = sum(e["args"]["bytes_sent"] for e in gathers + scatters)
            assert sent == formulas.traffic_theory(3, ALL // 4, 4, 4, 1, 1, s.reshard) == (ag + rs) * 3 * ALL / 4
            assert len(in_step(run.trace, r, "zero")) == 6 * (2 if s.reshard else 1)      # a wait per all-gather
        blocks = {K0: 1, K1: 2, KEEP: 4}[s]                     # held at the peak: a block, 2 with prefetch, all
        assert run.rows[1]["zero_bytes"] == sent and run.rows[1]["zero_gathered_peak"] == \
            run.summary["zero"]["gathered_peak_formula"] == OUTER + blocks * UNIT["h"]


def test_the_picture_of_the_clean_runs(clean):
    """No problem; the gathered peak replayed from the trace is the formula's; with prefetch 1 block
    j+1's forward all-gather starts inside block j's forward span, with prefetch 0 after it ends."""
    proc, runs, _ = clean
    pic = fsdp.fsdp_picture(list(runs.values()))
    assert pic.problems == [] and "PROBLEM" not in proc.stdout, pic.problems
    assert proc.stdout.splitlines()[0] == pic.title
    for pan in pic.panels:
        f = pan.figures
        assert f["peak"] == f["formula"] == f["log_peak"] and f["sent"] == f["theory"] == f["log_sent"]
    for s in (K0, K1):
        trace = runs[s].trace
        for j in range(3):
            start = zero_calls(trace, 0, "all_gather")[3 + j]["ts"]            # after wte's, wpe's and h.0's
            fwd = layer(trace, 0, f"h.{j} forward")
            assert (start < fwd["end"]) == (s is K1), (s, j, start, fwd)
    assert not any(o.phase == "backward" and o.kind == "all-gather" for o in pic.panels[2].ops)
    assert "(b) prefetch 1: step 1 of rank 0, " in proc.stdout and "    all-gather     |" in proc.stdout


def test_the_svg_draws_every_collective_and_wait(clean):
    proc, runs, out = clean
    root = ET.parse(os.path.join(out, "explain-fsdp-p4.svg")).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    fills = [r.get("fill") for r in root.iter(f"{ns}rect")]
    waits = sum(len(in_step(run.trace, 0, "zero")) for run in runs.values())
    assert fills.count(fsdp.COLOURS["all-gather"]) == 12 + 12 + 6 + 1 and waits == 12 + 12 + 6
    assert fills.count(fsdp.COLOURS["reduce-scatter"]) == 3 * 6 + 1
    assert fills.count(fsdp.COLOURS["wait"]) == waits + 1                   # and the legend's
    texts = ["".join(t.itertext()) for t in root.iter(f"{ns}text")]
    assert texts[0] == proc.stdout.splitlines()[0] and not any(t.startswith("PROBLEM") for t in texts)
    assert [t for t in texts if t.startswith("(")][:3] == [line for line in proc.stdout.splitlines()
                                                          if line.startswith(("(a)", "(b)", "(c)"))]


# --- the planted mistakes ---------------------------------------------------------------------------

def _raw(trace, e):
    """The trace's own events (begin and end) of traceview's copy e."""
    return [x for x in trace["traceEvents"] if x.get("pid") == e["pid"] and x.get("ts") in (e["ts"], e["end"])
            and x.get("name") == e["name"] and x.get("id", None) == e.get("id", None)]


def drop_backward_gather(runs):
    t = runs[K1].trace                                          # rank 0's second gather of h.2: backward's
    g = zero_calls(t, 0, "all_gather")[6 + 3]                   # 6 forward, then wte, wpe, h.3, h.2
    for x in _raw(t, g):
        t["traceEvents"].remove(x)


def skip_prefetch(runs):
    t = runs[K1].trace                                          # each block gathered in its own forward, backward
    ag = zero_calls(t, 0, "all_gather")                         # wte wpe h.0-h.3, wte wpe h.3-h.0
    waits = {(e["args"]["unit"][:3], e["args"]["phase"]): e for e in in_step(t, 0, "zero")}
    moves = [(ag[2 + j], j, "forward") for j in range(4)] + [(ag[11 - j], j, "backward") for j in range(4)]
    for g, j, phase in moves:                                   # between the block's span start and its wait
        _raw(t, g)[0]["ts"] = (layer(t, 0, f"h.{j} {phase}")["ts"] + waits[f"h.{j}", phase]["ts"]) / 2


def short_gather(runs):
    g = _raw(runs[K0].trace, zero_calls(runs[K0].trace, 2, "all_gather")[3])[0]     # rank 2's h.1, forward
    g["args"]["bytes_sent"] -= 4


def reordered_blocks(runs):
    t = runs[KEEP].trace                                        # rank 1 ran h.2's forward before h.1's
    a, b = (next(x for x in _raw(t, layer(t, 1, f"h.{i} forward")) if x["ph"] == "X") for i in (1, 2))
    a["name"], b["name"], a["args"], b["args"] = b["name"], a["name"], b["args"], a["args"]


def log_peak_off(runs):
    runs[KEEP].rows[1]["zero_gathered_peak"] -= UNIT["h"]


PLANTED = [
    (drop_backward_gather, "prefetch 1, rank 0: the backward wait for all-gather h.2 at "),
    (drop_backward_gather, "prefetch 1, rank 0: h.2 is all-gathered 1 time(s) in forward and 0 in backward, "
                           "reduce-scattered 1 time(s); formulas.collectives_per_step: 2 all-gather(s), 1 of them "
                           "in forward, and 1 reduce-scatter(s)"),
    (skip_prefetch, "prefetch 1, rank 0: block 1's forward all-gather starts at "),
    (skip_prefetch, "prefetch 1, rank 0: block 2's backward all-gather starts at "),
    (skip_prefetch, "prefetch 1, rank 0: gathered at the peak 274176 B (the trace replayed), formulas.gathered_peak "
                    "474112 B"),
    (short_gather, "prefetch 0, rank 2: the forward all-gather of h.1 at "),
    (short_gather, "prefetch 0, rank 2: ZeRO sent 1966460 B in step 1; formulas.traffic_theory 1966464 B"),
    (reordered_blocks, "prefetch 1, reshard after forward off, rank 1: layer spans in the order embed forward, "
                       "h.0 forward, h.2 forward, h.1 forward, h.3 forward"),
    (log_peak_off, "prefetch 1, reshard after forward off: the log's gathered peak (zero_gathered_peak) of step 1 "
                   "is 674048; the formula's 873984"),
]


def drawn(runs, tmp_path, monkeypatch, capsys):
    """`python -m minipar.explain fsdp` with its runs' traces and logs replaced by `runs` (no mpirun,
    no PNG) -> (exit status, stdout, stderr, the SVG)."""
    by_tag = {s.tag: run for s, run in runs.items()}

    def launch(p, argv):
        trace, log = argv[argv.index("--trace") + 1], argv[argv.index("--log") + 1]
        run = by_tag[os.path.basename(trace)[len("explain-fsdp-p4-"):-len(".json")]]
        with open(trace, "w") as f:
            json.dump(run.trace, f)
        with open(log, "w") as f:
            f.writelines(json.dumps(x) + "\n" for x in run.rows + [run.summary])
    monkeypatch.setattr(explain, "mpirun", launch)
    monkeypatch.setattr(explain, "write_png", lambda svg, path: None)
    status = explain.main(["fsdp", "--out", str(tmp_path)])
    out, err = capsys.readouterr()
    return status, out, err, (tmp_path / "explain-fsdp-p4.svg").read_text()


def test_the_clean_runs_drawn_by_the_command_exit_0(clean, tmp_path, monkeypatch, capsys):
    status, out, err, svg = drawn(clean[1], tmp_path, monkeypatch, capsys)
    assert status == 0 and err == "" and "PROBLEM" not in out + svg, err


@pytest.mark.parametrize("plant,line", PLANTED, ids=[f"{p.__name__}-{i}" for i, (p, _) in enumerate(PLANTED)])
def test_a_planted_mistake_is_a_problem_in_red_and_exit_1(plant, line, clean, tmp_path, monkeypatch, capsys):
    """Each plant edits the clean runs' trace or log; the command, given them in place of its runs',
    prints the PROBLEM line, draws it in red and exits 1."""
    runs = copy.deepcopy(clean[1])
    plant(runs)
    status, out, err, svg = drawn(runs, tmp_path, monkeypatch, capsys)
    hits = [x[len("PROBLEM: "):] for x in out.splitlines() if x.startswith("PROBLEM: " + line)]
    assert status == 1 and hits, f"{line!r} not among:\n{out[-3000:]}"
    assert f"minipar.explain: problem: {hits[0]}\n" in err
    assert 'fill="#c00000">PROBLEM: ' + hits[0].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") in svg


WRONG_FORMULAS = [
    ("all_gather_sent", comm_bytes, lambda n_each, itemsize, p: p * n_each * itemsize,
     "prefetch 0, rank 0: the forward all-gather of wte at "),
    ("gathered_peak", formulas, lambda outer, blocks, K, reshard: outer + max(blocks),
     "prefetch 1, rank 0: gathered at the peak 474112 B (the trace replayed), formulas.gathered_peak 274176 B"),
    ("collectives_per_step", formulas, lambda stage, M, reshard=True: (M, M),
     "prefetch 0, rank 0: wte is all-gathered 1 time(s) in forward and 1 in backward"),
]


@pytest.mark.parametrize("name,module,wrong,line", WRONG_FORMULAS, ids=[w[0] for w in WRONG_FORMULAS])
def test_the_reader_checks_against_the_libraries_own_formulas(name, module, wrong, line, clean, monkeypatch):
    """The clean runs against a formula made wrong: the reader takes each from the library (the
    planner's bytes per call, ZeRO's gathered peak and calls per step), so the trace disagrees."""
    monkeypatch.setattr(module, name, wrong)
    problems = fsdp.fsdp_picture(list(clean[1].values())).problems
    assert any(p.startswith(line) for p in problems), "\n".join(problems)


# --- the command line -------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,message", [
    (["fsdp", "--p", "3"], "--p 3: fsdp runs the trainer on 2 or 4 ranks"),
    (["fsdp", "--prefetch", "0"], "--prefetch 0: need 1 <= K <= 3 (the model has 4 blocks; prefetch 0 is always "
                                  "the first run)"),
    (["ulysses", "--prefetch", "1"], "--prefetch 1 is for fsdp"),
])
def test_what_fsdp_cannot_draw_is_one_line_and_exit_2(argv, message, capsys):
    assert explain.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"minipar.explain: error: {message}\n", err
