"""The labs' machinery itself (labs/framework.py, grade.py, run.py, check_all.py); every lab's
grader is proved by `make labs-check`. Here: the checks that protect a class from a grader
that judges the wrong code."""
import os
import shutil
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from labs import check_all, framework  # noqa: E402

TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "4",
        "--steps", "2", "--sample", "0"]


def test_a_run_where_the_students_code_never_ran_fails():
    """One process has no dp group: no reduce-scatter runs, so the seam was never reached and
    labs.run must say so instead of passing on minipar's own code."""
    p = subprocess.run([sys.executable, "-m", "labs.run", "02", "--student",
                        os.path.join(REPO, "labs", "02_ring", "solution.py"), "--", *TINY],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
    assert p.returncode == 1 and "the student's code never ran on rank(s) [0]" in p.stdout, (p.stdout, p.stderr)


def test_stub_check_catches_a_stub_with_the_answer(tmp_path):
    lab = tmp_path / "02_ring"
    shutil.copytree(os.path.join(REPO, "labs", "02_ring"), lab)
    assert check_all.stub_findings(str(lab)) == []
    shutil.copyfile(lab / "solution.py", lab / "student.py")         # the answer handed out
    found = check_all.stub_findings(str(lab))
    assert any("has the answer's body" in f for f in found) and \
        any("beyond its docstring" in f for f in found), found


def test_hint_check_catches_a_name_that_does_not_exist():
    class Lab:
        CRITERIA = [framework.Criterion("x", hint="see comm.traffic() and minipar.comm.algorithms.ring.all_gather"),
                    framework.Criterion("y", hint="comm.no_such_function shows it")]
    assert check_all.hint_findings(Lab) == ["hint of 'y' names comm.no_such_function, which does not exist"]


def test_mutant_headers_and_lab_names():
    assert framework.find("2") == framework.find("02") == framework.find("02_ring")
    with pytest.raises(ValueError, match="no lab '99'"):
        framework.find("99")
    path = os.path.join(REPO, "labs", "02_ring", "mutants", "m01_no_reduction.mutant")
    assert framework.mutant_criterion(path) == "reduce_scatter against NumPy"
    student = framework.materialize(os.path.join(REPO, "labs", "02_ring"), path)
    assert student.startswith("# criterion: reduce_scatter against NumPy\n") and \
        "sending = arriving" in student and "sending = reduce(arriving" not in student
    assert framework.first_difference([1.0, 2.0], [1.0, 2.5]) == \
        "largest |difference| 0.5; first bad index 1: got 2.0, want 2.5"
    assert framework.first_difference([1.0, 2.0], [1.0, 2.0]) is None


def test_a_mutant_patch_that_no_longer_applies_is_an_error(tmp_path):
    lab = os.path.join(REPO, "labs", "02_ring")
    stale = tmp_path / "m99_stale.mutant"
    stale.write_text("# criterion: reduce_scatter against NumPy\n# stale\n--- solution.py\n"
                     "    this line is not in solution.py\n+++ mutant\n    pass\n")
    with pytest.raises(ValueError, match="occurs 0 times in solution.py"):
        framework.materialize(lab, str(stale))


def test_labs_run_starts_its_ranks_says_where_the_code_ran_and_names_oversubscription():
    """-n 4 starts mpirun itself; rank 0 names the ranks the student's code ran on and the
    calls; with more ranks than cores, the pipeline's measured bubble is flagged and the
    simulated one printed beside it."""
    p = subprocess.run([sys.executable, "-m", "labs.run", "02", "-n", "4", "--student",
                        os.path.join(REPO, "labs", "02_ring", "solution.py"), "--",
                        "--dp", "2", "--pp", "2", "--zero", "1", "--micro-batches", "2", *TINY, "--n-layer", "2"],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "the student's code (solution.py) ran on every rank [0, 1, 2, 3]" in p.stdout, p.stdout
    if (os.cpu_count() or 1) < 4:
        assert "ranks share" in p.stdout and "simulated" in p.stdout, p.stdout


def test_a_syntax_error_names_the_students_own_file_and_line(tmp_path):
    """Not student.py, not <frozen importlib._bootstrap>: the file as the student named it."""
    bad = tmp_path / "my_ring.py"
    bad.write_text("import numpy as np\n\n\ndef reduce_scatter(g, x, op='sum'):\n    return x +\n")
    for cmd in (["labs.run", "02", "--student", str(bad), "--", *TINY],
                ["labs.grade", "02", "--student", str(bad), "--first-failure"]):
        p = subprocess.run([sys.executable, "-m", *cmd], cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": REPO})
        out = p.stdout + p.stderr
        assert p.returncode == 1 and "SyntaxError" in out and "(my_ring.py, line 5)" in out, out
        assert "frozen importlib" not in out and "Traceback" not in out, out


def test_quick_skips_only_the_later_trainer_criteria_and_a_skipped_one_runs_nothing():
    """labs-check --quick grades the solution in the first trainer criterion only; a skipped
    criterion is a "not run" verdict that started nothing (even for a file that would fail it)."""
    from labs.grade import grade                                   # noqa: PLC0415
    lab_dir = framework.find("19")
    lab = framework.load_lab(lab_dir)
    trainers = [c.name for c in lab.CRITERIA if c.trainer]
    assert len(trainers) == 2 and check_all.quick_skip(lab) == {trainers[1]}
    stub = open(os.path.join(lab_dir, "student.py"), "rb").read()
    skip = {c.name for c in lab.CRITERIA}
    verdicts = grade(lab_dir, stub, "student.py", sandbox=None, skip=skip, say=lambda line: None)
    assert [v.status for v in verdicts[1:]] == ["not run"] * len(skip)
    assert all(v.message == "(skipped)" for v in verdicts[1:]), verdicts


def test_check_all_with_jobs_leaves_no_scratch_folder(tmp_path):
    """Each --jobs worker's sandbox removes its scratch folder when the worker ends (a pool's
    workers are let finish, not terminated)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    os.chmod(tmp_path, 0o711)                   # the sandbox's uid passes through to its scratch
    os.chmod(tmp, 0o711)
    p = subprocess.run([sys.executable, "-m", "labs.check_all", "--quick", "--jobs", "2", "16", "17"], cwd=REPO,
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
    assert p.returncode == 0 and "2 lab(s), 2 mutants caught, 0 finding(s)" in p.stdout, p.stdout + p.stderr
    left = [f for f in os.listdir(tmp) if f.startswith("minipar-grade-")]
    assert left == [], left


def test_lab14_seam_keeps_minipars_fused_gather_so_the_collectives_are_sp_counts():
    """The student's f runs inside minipar's GatherSequenceLinear (kept shard, re-gathered in
    backward), so the run sends what sequence_parallel.sp_count says, recomputation included,
    and agrees with one process."""
    p = subprocess.run([sys.executable, "-m", "labs.run", "14", "-n", "2", "--student",
                        os.path.join(REPO, "labs", "14_sequence_parallel", "solution.py"), "--",
                        "--tp", "2", "--sp", "--recompute", "full", *TINY, "--dtype", "float64", "--verify"],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
    assert p.returncode == 0, p.stdout + p.stderr
    assert "regather 3" in p.stdout and ": = sp_count x 1 micro-batch(es)" in p.stdout, p.stdout
    assert "-> OK" in p.stdout and "ran on every rank [0, 1]" in p.stdout, p.stdout
