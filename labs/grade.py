"""Grade a lab:  python -m labs.grade NN [--student PATH | --solution] [--json REPORT] [--first-failure]

    make lab L=02                        grades labs/02_*/student.py (yours, once you fill it in)
    python -m labs.grade 02 --student ~/ring.py
    python -m labs.grade 02 --solution   minipar's own code behind the same signatures

Only the student's file is copied, into a scratch folder; each criterion then runs in its own
process (under mpirun when it needs ranks) with a timeout that ends the whole job, and prints
one line: PASS or FAIL, the criterion, its time, and for a failure what went wrong (rank,
case, largest difference, first bad index) and a hint. --json writes the verdicts with the
file's sha256, for a teacher grading a class. Exit 0 when every criterion passes.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from labs import framework

MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")


def command(lab_dir: str, c: framework.Criterion, student: str) -> list[str]:
    if c.trainer:
        inner = [sys.executable, "-m", "labs.run", lab_dir, "--student", student, "--", *c.trainer]
    else:
        inner = [sys.executable, "-m", "labs.criterion", lab_dir, c.name, student]
    return [MPIRUN, "-n", str(c.ranks), *inner] if c.ranks > 1 else inner


def run_criterion(lab_dir: str, c: framework.Criterion, student: str) -> dict:
    """-> {"name", "ok", "seconds", "message"}; the job is killed, all of it, at the timeout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPIR_"))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=framework.REPO,
               MINIPAR_COMM_TIMEOUT=str(min(20.0, c.timeout / 3)))
    start = time.monotonic()
    proc = subprocess.Popen(command(lab_dir, c, student), cwd=framework.REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=c.timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    seconds = time.monotonic() - start
    ok = proc.returncode == 0 and not timed_out
    message = ""
    if timed_out:
        message = f"did not finish within {c.timeout:g} s (a deadlock? MINIPAR_TRACE=1 shows every message)"
    elif not ok:
        fails = [line for line in (out + "\n" + err).splitlines() if line.startswith("FAIL ")]
        verdicts = [line for line in out.splitlines() if line.startswith("verify:") and "-> FAILED" in line]
        errors = [line for line in err.splitlines()
                  if line.strip() and "Abort(" not in line and "aborting" not in line]
        if fails:
            message = fails[0][5:].split("FAIL rank")[0]
        elif verdicts:                          # the trainer ran, and --verify disagreed
            message = verdicts[-1]
        else:
            message = errors[-1].strip() if errors else f"exit code {proc.returncode}"
    elif c.trainer:
        verdicts = [line for line in out.splitlines() if line.startswith("verify:") and "vs 1 process" in line]
        message = verdicts[-1].rsplit("; ", 1)[-1] if verdicts else ""
    return {"name": c.name, "ok": ok, "seconds": round(seconds, 2), "message": message}


def grade(lab_dir: str, student: str, first_failure: bool = False, say=print) -> list[dict]:
    """Grade the file `student` (a copy of it) against every criterion of the lab."""
    lab = framework.load_lab(lab_dir)
    results = []
    with tempfile.TemporaryDirectory(prefix="minipar-lab-") as scratch:
        copy = os.path.join(scratch, "student.py")
        with open(copy, "w", encoding="utf-8") as f:      # a .mutant becomes the file it stands for
            f.write(framework.materialize(lab_dir, student))
        for c in lab.CRITERIA:
            r = run_criterion(lab_dir, c, copy)
            results.append(r)
            line = f"{'PASS' if r['ok'] else 'FAIL'}  {c.name:<34} {r['seconds']:6.1f} s"
            if r["message"]:
                line += f"  {r['message']}"
            if not r["ok"] and c.hint:
                line += f"\n      hint: {c.hint}"
            say(line)
            if first_failure and not r["ok"]:
                break
    return results


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m labs.grade", description=__doc__.split("\n\n")[0])
    p.add_argument("lab", help="the lab: its number (02) or folder name (02_ring)")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--student", metavar="PATH", help="the file to grade [labs/NN_name/student.py]")
    who.add_argument("--solution", action="store_true", help="grade minipar's own code (reference.py)")
    p.add_argument("--json", metavar="REPORT", help="write the verdicts, with the file's sha256")
    p.add_argument("--first-failure", action="store_true", help="stop at the first failing criterion")
    args = p.parse_args(argv)
    try:
        lab_dir = framework.find(args.lab)
    except ValueError as e:
        p.error(str(e))
    student = args.student or os.path.join(lab_dir, "reference.py" if args.solution else "student.py")
    if not os.path.isfile(student):
        p.error(f"--student {student}: no such file")
    with open(student, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    name = os.path.basename(lab_dir)
    print(f"lab {name}: grading {student} (sha256 {digest[:16]})", flush=True)
    results = grade(lab_dir, student, args.first_failure, say=lambda line: print(line, flush=True))
    passed = sum(r["ok"] for r in results)
    total = len(framework.load_lab(lab_dir).CRITERIA)
    print(f"{passed} passed, {total - passed} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lab": name, "student": os.path.abspath(student), "sha256": digest,
                       "passed": passed, "total": total, "criteria": results}, f, indent=1)
    sys.exit(0 if passed == total else 1)


if __name__ == "__main__":
    main()
