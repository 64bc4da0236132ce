"""The trainer with --pp under mpirun, as a user runs it: --verify for each schedule and
with dp and tp, the pipeline summary and timeline, checkpoints, and layout errors."""
import json

import numpy as np
import pytest

from minipar.train import checkpoint
from minipar.model.gpt import GPTConfig, param_specs
from minipar.parallel.pipeline import schedules

from trainer_runs import assert_exit_2_one_line, mpirun


def verify_line(p, layout):
    lines = [line for line in p.stdout.splitlines() if line.startswith(f"verify: {layout} vs 1 process")]
    assert len(lines) == 1 and lines[0].endswith("-> OK"), p.stdout + p.stderr


@pytest.mark.parametrize("n,flags,layout", [
    (4, ["--pp", "4", "--n-layer", "4", "--micro-batches", "4"], "dp=1 tp=1 pp=4"),            # 1f1b
    (4, ["--pp", "2", "--dp", "2", "--n-layer", "3", "--schedule", "gpipe", "--micro-batches", "2"],
     "dp=2 tp=1 pp=2"),
    (4, ["--pp", "2", "--tp", "2", "--n-layer", "2", "--schedule", "naive", "--untied",
         "--micro-batches", "2"], "dp=1 tp=2 pp=2"),
])
def test_verify_pipeline_float64_passes(n, flags, layout, tmp_path):
    log, svg = str(tmp_path / "log.jsonl"), str(tmp_path / "t.svg")
    p = mpirun(n, "--dtype", "float64", "--verify", "--log", log, "--timeline", svg, *flags)
    assert p.returncode == 0, p.stdout + p.stderr
    verify_line(p, layout)
    pp = int(flags[1])
    summary = json.loads(open(log).read().splitlines()[-1])
    pl = summary["pipeline"]
    assert pl["schedule"] == (flags[flags.index("--schedule") + 1] if "--schedule" in flags else "1f1b")
    assert pl["micro_batches"] == int(flags[flags.index("--micro-batches") + 1])
    assert len(pl["peak_activation_bytes"]) == pp and all(b > 0 for b in pl["peak_activation_bytes"])
    assert 0 < pl["bubble_measured"] < 1 and 0 < pl["bubble_theory"] < 1, pl
    gantt = [line for line in p.stdout.splitlines() if line.strip().startswith("stage ") and "|" in line]
    assert len(gantt) == pp, p.stdout
    # the measured timeline (what the chart draws; a span too short for a cell shows no letter):
    # each stage ran its forwards and backwards in the order of its schedule's instructions
    events = [tuple(e[:3]) for e in pl["last_step_timeline"]]
    for stage in range(pp):
        mine = [(kind, mb) for st, kind, mb in events if st == stage]
        want = [(type(ins).__name__[0], ins.mb) for ins in schedules.schedule(pl["schedule"], stage, pp,
                                                                              pl["micro_batches"])
                if isinstance(ins, (schedules.Forward, schedules.Backward))]
        assert mine == want, (stage, mine, want)
    assert open(svg).read().startswith("<svg") and "stage 1" in open(svg).read()


def test_checkpoint_from_pp2_dp2_is_canonical_and_resumes_on_tp2_pp2(tmp_path):
    """model.npz and the optimizer shards hold every canonical tensor (gathered from the stages);
    resuming on another layout continues exactly as an uninterrupted run."""
    d, a, b = str(tmp_path / "ck"), str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    base = ["--dtype", "float64", "--n-layer", "2", "--lr-schedule", "constant", "--warmup", "0",
            "--micro-batches", "2"]
    p = mpirun(4, *base, "--pp", "2", "--dp", "2", "--steps", "2", "--save", d)
    assert p.returncode == 0, p.stderr
    state, ostate, meta = checkpoint.load(d)
    names = [n for n, _, _ in param_specs(GPTConfig(**{k: meta["config"][k] for k in meta["config"]}))]
    assert sorted(state) == sorted(names) and sorted(ostate["m"]) == sorted(names), sorted(state)
    assert meta["layout"]["pp"] == 2 and ostate["step"] == 2
    p = mpirun(4, *base, "--pp", "2", "--tp", "2", "--steps", "4", "--resume", d, "--log", b)
    assert p.returncode == 0, p.stderr
    p = mpirun(1, *base, "--steps", "4", "--log", a)
    assert p.returncode == 0, p.stderr
    la = [json.loads(x)["loss"] for x in open(a) if '"summary"' not in x][2:]
    lb = [json.loads(x)["loss"] for x in open(b) if '"summary"' not in x]
    np.testing.assert_allclose(lb, la, rtol=1e-12, err_msg="resumed on tp2 x pp2 from a dp2 x pp2 checkpoint")


@pytest.mark.parametrize("n,flags,message", [
    (3, ["--pp", "3", "--n-layer", "2"], "--pp 3 is more than --n-layer 2: every pipeline stage needs"),
    (2, ["--pp", "2", "--n-layer", "2", "--micro-batches", "3"], "--batch-size 8 is not divisible by --micro-batches 3"),
    (2, ["--timeline", "x.svg"], "--timeline x.svg draws a pipeline: it needs --pp > 1"),
])
def test_bad_pipeline_layout_exits_2_with_one_line(n, flags, message):
    assert_exit_2_one_line(mpirun(n, *flags), message)
