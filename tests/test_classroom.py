"""python -m labs.grade NN --class DIR --out REPORTS/: a mixed class, hostile files in the
middle (one aims a detached process at another student's report), graded two at a time;
every student's verdict is their own."""
import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from labs import framework  # noqa: E402

LAB = os.path.join(REPO, "labs", "02_ring")
HOSTILE = os.path.join(REPO, "tests", "hostile")


def test_a_mixed_class_with_hostile_files_in_the_middle(tmp_path):
    klass, out = tmp_path / "submissions", tmp_path / "reports"
    klass.mkdir()
    shutil.copy(os.path.join(LAB, "solution.py"), klass / "alice.py")
    (klass / "bob.py").write_text(framework.materialize(LAB, os.path.join(LAB, "mutants", "m01_no_reduction.mutant")))
    # mallory aims at alice's report: a detached process rewrites it while the class is graded
    shutil.copy(os.path.join(HOSTILE, "forge_results.py"), klass / "mallory.py")
    text = open(os.path.join(HOSTILE, "rewrite_report_later.py")).read().replace("@REPORT@", str(out / "alice.json"))
    (klass / "mallory2.py").write_text(text)
    (klass / "carol.py").write_bytes("# résumé\n".encode("latin-1"))
    shutil.copy(os.path.join(LAB, "student.py"), klass / "dave.py")
    os.symlink(klass / "alice.py", klass / "link.py")
    p = subprocess.run([sys.executable, "-m", "labs.grade", "02", "--class", str(klass), "--out", str(out),
                        "--jobs", "2", "--first-failure"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    import time
    time.sleep(5)                                   # longer than mallory2's delayed write
    with open(out / "class.csv", newline="") as f:
        rows = {r[0]: r for r in csv.reader(f)}
    header = rows.pop("student")
    total = len(header) - 3
    assert set(rows) == {"alice", "bob", "mallory", "mallory2", "carol", "dave", "link"}
    for good in ("alice",):
        assert rows[good][1:-2] == ["PASS"] * total and rows[good][-2] == str(total), rows[good]
        report = json.loads((out / f"{good}.json").read_text())
        assert report["passed"] == total and report["sha256"] == \
            hashlib.sha256((klass / f"{good}.py").read_bytes()).hexdigest()
    assert rows["bob"][header.index("reduce_scatter against NumPy")] == "FAIL"
    assert rows["bob"][header.index("all_gather against NumPy")] == "NOT RUN"
    for refused in ("carol", "link"):
        assert rows[refused][1] == "FAIL", rows[refused]
    assert "NotImplementedError" in json.loads((out / "dave.json").read_text())["criteria"][1]["message"]
    for hostile in ("mallory", "mallory2"):
        assert rows[hostile][1] == "FAIL" and rows[hostile][-2] == "0", rows[hostile]
    md = (out / "class.md").read_text()
    assert md.startswith("| student | scan: imports and names |") and "| alice |" in md
