"""python -m minipar.plot: every figure is written, has its size in pixels, is not blank and
names what it shows (axis titles, legend labels, the bubble); the numbers behind the figures
are the log's; bad input and a missing matplotlib end in one line and exit 2.

Two real logs are made once for the module: the tiny model on one process, and on 4 ranks
(dp 2 x pp 2, with a trace); the other cases are those logs edited.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minipar.plot import curves as plot, timeline as plot_timeline

pytest.importorskip("matplotlib", reason="minipar.plot draws with matplotlib: pip install -e '.[plot]'")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIPAR_COMM_TIMEOUT="60")
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
        "--steps", "4", "--sample", "0"]
FIGURES = ("loss", "throughput", "comm", "memory")


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """{"single": log, "dp2pp2": log, "trace": its trace}: both runs started together."""
    d = tmp_path_factory.mktemp("runs")
    out = {"single": str(d / "single.jsonl"), "dp2pp2": str(d / "dp2pp2.jsonl"), "trace": str(d / "trace.json")}
    train = [sys.executable, "-m", "minipar.train", *TINY]
    procs = [subprocess.Popen(train + ["--log", out["single"]], cwd=REPO, env=ENV, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE),
             subprocess.Popen([MPIRUN, "-n", "4"] + train + ["--dp", "2", "--pp", "2", "--micro-batches", "2",
                                                           "--log", out["dp2pp2"], "--trace", out["trace"]],
                              cwd=REPO, env=ENV, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)]
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, f"{p.args}:\n{stdout[-1500:]}\n{stderr[-1500:]}"
    return out


def run_plot(*args):
    return subprocess.run([sys.executable, "-m", "minipar.plot", *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=120)


def png_size(path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk (bytes 16..24)."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def check_png(path, inches):
    from matplotlib.image import imread
    assert os.path.getsize(path) > 0, f"{path} is empty"
    want = (round(inches[0] * plot.DPI), round(inches[1] * plot.DPI))
    assert png_size(path) == want, f"{path}: {png_size(path)} pixels, expected {want}"
    pixels = imread(path)[..., :3]
    assert pixels.var() > 1e-3, f"{path} is blank (pixel variance {pixels.var():.2e})"


def check_svg(path, labels):
    with open(path, encoding="utf-8") as f:
        svg = f.read()
    missing = [s for s in labels if s not in svg]
    assert not missing, f"{path} lacks {missing}"


def read(path):
    with open(path) as f:
        objs = [json.loads(line) for line in f if line.strip()]
    return objs[:-1], objs[-1]


def write(path, rows, summary):
    with open(path, "w") as f:
        f.writelines(json.dumps(o) + "\n" for o in rows + ([summary] if summary else []))
    return str(path)


# --- the figures --------------------------------------------------------------------------------

def test_every_figure_from_two_logs_and_a_trace(logs, tmp_path):
    p = run_plot(logs["single"], logs["dp2pp2"], "--trace", logs["trace"], "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    names = FIGURES + ("timeline",)
    assert p.stdout.split() == [str(tmp_path / f"{n}.{e}") for n in names for e in ("png", "svg")], p.stdout
    for name in FIGURES:
        check_png(tmp_path / f"{name}.png", plot.figure_size(name, 2))
    assert plot.figure_size("loss", 1) == plot.figure_size("comm", 2) == (12.0, 4.5)    # 1200 x 450 pixels
    tl = plot_timeline.load_timeline(logs["trace"], note=print)
    check_png(tmp_path / "timeline.png", plot_timeline.figure_size(tl["n_stages"]))
    both = ["1 process", "dp2 pp2"]                     # the labels built from the layouts
    check_svg(tmp_path / "loss.svg", ["loss vs step", "loss vs tokens", "tokens trained on", "loss (nats)",
                                      "1 process train", "dp2 pp2 train", "dp2 pp2 val (end)"])
    check_svg(tmp_path / "throughput.svg", ["tokens / s", "MFU", "step"] + both)
    check_svg(tmp_path / "comm.svg", ["bytes sent (KiB)", "comm_bytes (all axes)", "dp", "pp",
                                      "nothing sent: one process"] + both)
    check_svg(tmp_path / "memory.svg", ["world rank", "params", "grads", "optimizer", "formula: 4P + 4P + 8P"]
              + both)
    check_svg(tmp_path / "timeline.svg", [f"bubble {tl['bubble']:.3f} measured", f"step {tl['step']}",
                                          "stage 0", "stage 1", "F forward", "B backward", "F0", "B1"])


def test_a_hand_made_timeline(tmp_path):
    """traceview.pipeline_timeline's dict drawn: GPipe on 2 stages, 2 micro-batches."""
    import matplotlib
    tl = {"timeline": [(0, "F", 0, 0.000, 0.010), (0, "F", 1, 0.010, 0.020), (1, "F", 0, 0.010, 0.020),
                       (1, "F", 1, 0.020, 0.030), (1, "B", 1, 0.030, 0.050), (1, "B", 0, 0.050, 0.070),
                       (0, "B", 1, 0.050, 0.070), (0, "B", 0, 0.070, 0.090)],
          "n_stages": 2, "step": 7, "bubble": 0.3333, "bubble_per_stage": [0.3333, 0.3333], "schedule": "gpipe"}
    with matplotlib.rc_context({"svg.fonttype": "none"}):
        plot.save(plot_timeline.draw_timeline(tl, plot.DPI), str(tmp_path), "timeline", ["png", "svg"])
    check_png(tmp_path / "timeline.png", plot_timeline.figure_size(2))
    check_svg(tmp_path / "timeline.svg", ["gpipe, 2 stages, step 7: bubble 0.333 measured", "idle 0.33",
                                          "time since the step's schedule started (ms)", "F1", "B0"])


# --- the numbers behind them --------------------------------------------------------------------

def test_bytes_by_axis_are_the_logs(logs):
    run = plot.read_log(logs["dp2pp2"])
    rows, _ = read(logs["dp2pp2"])
    by_axis = plot.bytes_by_axis(run)
    assert list(by_axis)[:len(plot.AXES)] == list(plot.AXES), list(by_axis)
    for a, v in by_axis.items():
        np.testing.assert_array_equal(v, [r["bytes_by_axis"].get(a, 0) for r in rows], err_msg=f"axis {a}")
    assert by_axis["pp"].min() > 0 and by_axis["dp"].min() > 0, by_axis
    np.testing.assert_array_equal(plot.tokens(run), [r["tokens"] for r in rows])
    single = plot.bytes_by_axis(plot.read_log(logs["single"]))
    assert all((v == 0).all() for v in single.values()), single


def test_memory_bars_are_the_summarys(logs):
    for key in ("single", "dp2pp2"):
        _, summary = read(logs[key])
        table = plot.memory_table(summary)
        want = summary.get("memory_per_rank") or [summary["memory"]]
        assert len(table) == len(want), (key, table)
        m, f = summary["memory"], summary["memory"]["formula"]
        assert {k: table[0][k] for k in ("params", "grads", "optimizer")} == \
               {k: m[k] for k in ("params", "grads", "optimizer")}, (key, table[0], m)
        assert table[0]["formula_total"] == f.get("total", f["params"] + f["grads"] + f["optimizer"]), key
        for row, e in zip(table, summary.get("memory_per_rank") or []):
            f = e.get("formula", {})
            want = {"rank": e["rank"], "params": e["params"], "grads": e["grads"], "optimizer": e["optimizer"],
                    "formula_total": e.get("formula_total", f.get("params", 0) + f.get("grads", 0)
                                           + f.get("optimizer", 0))}
            assert {k: row[k] for k in want} == want, (key, row, e)
    if "memory_per_rank" in summary:                     # the 4-rank run: one row per rank
        assert [e["rank"] for e in table] == [0, 1, 2, 3], table


def test_memory_table_takes_either_shape_of_memory_per_rank(logs):
    """Each rank's "formula" terms (summed to the total), or a ready "formula_total" and
    "formula_text"; the rows come back in rank order with the values given."""
    _, summary = read(logs["dp2pp2"])
    per_rank = [{"rank": r, "params": 1000 * (r + 1), "grads": 1000 * (r + 1), "optimizer": 2000 * (r + 1),
                 "formula_total": 4000 * (r + 1), "formula_text": "4P + 4P + 8P"} for r in range(4)]
    assert plot.memory_table({**summary, "memory_per_rank": per_rank}) == per_rank
    terms = [{"rank": r, "params": 1, "grads": 2, "optimizer": 3, "formula": {"params": 4, "grads": 5, "optimizer": 6}}
             for r in range(2)]
    table = plot.memory_table({**summary, "memory_per_rank": terms})
    assert [(e["rank"], e["formula_total"], e["formula_text"]) for e in table] == \
           [(0, 15, "4P + 4P + 8P"), (1, 15, "4P + 4P + 8P")], table


def test_labels_from_layouts_and_precision():
    def run(path, summary):
        return plot.Run(path, [{"step": 0, "loss": 1.0}], summary)
    runs = [run("a/fp32.jsonl", {"layout": {"dp": 1, "tp": 1, "pp": 1, "zero": 0}}),
            run("b/fp16.jsonl", {"layout": {"dp": 1, "tp": 1, "pp": 1, "zero": 0}, "precision": {"mode": "fp16"}}),
            run("c/big.jsonl", {"layout": {"dp": 2, "tp": 2, "pp": 2, "zero": 1}}),
            run("d/crashed.jsonl", None)]
    plot.set_labels(runs, None)
    assert [r.label for r in runs] == ["1 process", "1 process fp16", "dp2 tp2 pp2 zero1", "crashed"]
    twins = [run("x/lr1.jsonl", runs[0].summary), run("y/lr2.jsonl", runs[0].summary)]
    plot.set_labels(twins, None)
    assert [r.label for r in twins] == ["1 process (lr1)", "1 process (lr2)"]


def test_per_step_val_loss_and_older_logs(logs, tmp_path, capsys):
    """A log with val_loss on some rows draws them as a line; one written before "tokens",
    "bytes_by_axis" and "memory_per_rank" still draws every figure, with a note for each gap.
    Also: one log, --label, --format, and the figures go beside the log without --out."""
    rows, summary = read(logs["single"])
    rows = [dict(r, val_loss=5.0 - r["step"]) if r["step"] % 2 else r for r in rows]
    steps, toks, vals, per_step = plot.val_points(plot.Run("v", rows, summary))
    assert per_step and steps.tolist() == [1, 3] and vals.tolist() == [4.0, 2.0], (steps, vals)
    assert toks.tolist() == [r["tokens"] for r in rows if r["step"] % 2]
    early = [dict(r, val_loss=4.0) if r["step"] == 1 else r for r in read(logs["single"])[0]]
    steps, _, vals, _ = plot.val_points(plot.Run("v", early, summary))      # + the summary's, at the end
    assert steps.tolist() == [1, 3] and vals.tolist() == [4.0, summary["val_loss"]], (steps, vals)
    old_rows = [{k: v for k, v in r.items() if k not in ("tokens", "bytes_by_axis")} for r in rows]
    old = write(tmp_path / "old.jsonl", old_rows, {k: v for k, v in summary.items() if k != "memory_per_rank"})
    np.testing.assert_array_equal(plot.tokens(plot.read_log(old)), [r["tokens"] for r in rows])
    assert plot.main([old, "--label", "baseline", "--format", "svg"]) == 0     # in process: matplotlib is loaded
    out, err = capsys.readouterr()
    assert 'no "bytes_by_axis"' in err and 'no "memory_per_rank"' in err, err
    assert out.split() == [str(tmp_path / f"{n}.svg") for n in FIGURES], out
    check_svg(tmp_path / "loss.svg", ["baseline train", "baseline val"])
    check_svg(tmp_path / "comm.svg", ["no bytes_by_axis in this log"])
    check_svg(tmp_path / "memory.svg", ["baseline: model states per rank", "formula: 4P + 4P + 8P"])


# --- failing cleanly ----------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["missing", "not a log", "no step rows", "format", "labels", "trace"])
def test_bad_input_is_one_line_and_exit_2(case, logs, tmp_path, capsys):
    junk = tmp_path / "notes.txt"
    junk.write_text("hello\n")
    empty = write(tmp_path / "empty.jsonl", [], {"summary": True})
    argv, needle = {
        "missing": ([str(tmp_path / "nope.jsonl")], "nope.jsonl: no such file"),
        "not a log": ([str(junk)], "notes.txt: line 1 is not a JSON object"),
        "no step rows": ([empty], "empty.jsonl: no step rows"),
        "format": ([logs["single"], "--format", "png,gif"], "unknown format gif"),
        "labels": ([logs["single"], logs["dp2pp2"], "--label", "only-one"], "1 --label value(s) for 2 log(s)"),
        "trace": ([logs["single"], "--trace", logs["single"]], "not a minipar trace"),
    }[case]
    assert plot.main(argv + ["--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("minipar.plot: error: "), (case, out, err)
    assert needle in err, (case, err)


def test_without_matplotlib(logs, tmp_path):
    fake = tmp_path / "no_mpl" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib hidden by the test')\n")
    env = dict(ENV, PYTHONPATH=os.pathsep.join([str(fake.parent), REPO]))
    p = subprocess.run([sys.executable, "-m", "minipar.plot", logs["single"], "--out", str(tmp_path)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    assert p.stderr == plot.NO_MATPLOTLIB + "\n", p.stderr
    assert not list(tmp_path.glob("*.png"))


def test_help_names_every_option():
    p = run_plot("--help")
    assert p.returncode == 0
    for flag in ("--label", "--trace", "--out", "--format", "LOG.jsonl"):
        assert flag in p.stdout, (flag, p.stdout)


def test_formats():
    assert plot.parse_formats("png") == ["png"]
    assert plot.parse_formats("SVG, png,svg") == ["svg", "png"]
