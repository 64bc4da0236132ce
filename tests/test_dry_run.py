"""--dry-run: every check a run makes before its first step, the start-up description and the
planner's figures for this layout, then exit 0 with nothing trained and nothing written; on
one process and under mpirun. (tests/test_docs.py runs every documented command so.)"""
import json
import os
import subprocess
import sys

from minipar.train import checkpoint
from trainer_runs import REPO, TINY, assert_exit_2_one_line, assert_main_exits_2, mpirun, run_tiny


def test_dry_run_trains_and_writes_nothing(tmp_path, capsys):
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    out = run_tiny("--dry-run", "--log", str(log), "--save", str(ckpt), "--save-every", "1")
    printed = capsys.readouterr().out
    assert out == {"dry_run": True}
    assert "mechanisms:" in printed and "plan: each rank holds" in printed, printed
    assert not any(line.startswith("step ") for line in printed.splitlines()), printed
    assert printed.rstrip().endswith("nothing trained, nothing written"), printed
    assert not log.exists() and not ckpt.exists() and not os.path.exists(str(ckpt) + ".tmp")


def test_dry_run_checks_the_outputs_it_would_write(tmp_path, capsys):
    assert_main_exits_2(TINY + ["--dry-run", "--log", str(tmp_path / "no" / "log.jsonl")],
                        ["--log", "does not exist"], capsys, "log in a missing directory")


def test_dry_run_checks_a_checkpoint(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    run_tiny("--save", ckpt)
    capsys.readouterr()
    run_tiny("--resume", ckpt, "--steps", "8", "--dry-run")
    assert "the checkpoint and the data check out" in capsys.readouterr().out
    assert checkpoint.load(ckpt)[2]["step"] == 4                    # untouched
    assert_main_exits_2(TINY + ["--resume", ckpt, "--n-layer", "2", "--dry-run"],
                        ["--n-layer 2 does not match the checkpoint"], capsys, "resume, other model")


def test_dry_run_under_mpirun_prints_the_planners_figures(tmp_path):
    flags = ["--dp", "2", "--pp", "2", "--zero", "1", "--micro-batches", "2", "--n-layer", "2"]
    p = mpirun(4, *flags, "--dry-run", "--log", str(tmp_path / "log.jsonl"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("dry run: ") == 1 and "on all 4 rank(s)" in p.stdout, p.stdout
    assert not (tmp_path / "log.jsonl").exists()
    model = ["--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8"]     # TINY_MPI's
    plan = subprocess.run([sys.executable, "-m", "minipar.plan", *model, *flags, "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    stages = json.loads(plan.stdout)["memory_per_stage"]
    lines = [line for line in p.stdout.splitlines() if line.startswith("  plan: a rank of stage")]
    assert len(lines) == 2, p.stdout
    from minipar.comm.ledger import human_bytes
    for line, mem in zip(lines, stages):
        assert f"holds {human_bytes(mem['model_states'])} of model states" in line, (line, mem)


def test_dry_run_refuses_a_layout_on_every_rank():
    assert_exit_2_one_line(mpirun(4, "--dp", "3", "--dry-run"), "world size 4 != dp*tp*pp = 3*1*1 = 3")
