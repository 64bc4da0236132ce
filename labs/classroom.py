"""Grading a class:  python -m labs.grade NN --class DIR --out REPORTS/ [--jobs N] [--first-failure]

Every regular file in DIR (not its subfolders; a link is refused, not followed) is one
student's submission. Each is graded by a worker process of its own (`python -m labs.grade NN
--student FILE --json REPORTS/<name>.json`), which makes its own sandbox (labs/sandbox.py: as
root, an unprivileged uid per worker slot, and a root of its own without DIR and REPORTS/),
fresh scratch folders and children: a submission
that hangs, floods, forks, crashes or tampers reaches nothing of another's. N workers run at
once. Then REPORTS/ holds:

    <name>.json    the student's report (verdicts, sha256 of the graded bytes)
    <name>.log     what the worker printed
    class.csv      students x criteria: PASS / FAIL / NOT RUN, then passed and total
    class.md       the same table in Markdown

Without full privilege separation (not root), the grader also checks after each worker that
minipar/ and labs/ are unchanged, and stops the class, naming the students graded since the
last good check, if they are not.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import time

from labs import framework
from labs.grade import SCAN, write_report
from labs.results import read_capped
from labs.sandbox import Sandbox

MAX_REPORT_BYTES = 4 << 20
SHORT = {"pass": "PASS", "fail": "FAIL", "not run": "NOT RUN"}


def tree_digest() -> str:
    """sha256 over every file of minipar/ and labs/ (names and contents)."""
    h = hashlib.sha256()
    for top in ("minipar", "labs"):
        for folder, dirs, files in sorted(os.walk(os.path.join(framework.REPO, top))):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                path = os.path.join(folder, name)
                h.update(path.encode())
                try:
                    with open(path, "rb") as f:
                        h.update(f.read())
                except OSError:
                    h.update(b"<unreadable>")
    return h.hexdigest()


def submissions(folder: str) -> list[tuple[str, str, str]]:
    """(report name, path, '' or why it is refused) for every entry of `folder`, sorted."""
    out, used = [], set()
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) or entry.startswith("."):
            continue
        stem = "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in os.path.splitext(entry)[0])[:60] or "x"
        name = stem
        while name in used:
            name += "_"
        used.add(name)
        why = "" if stat.S_ISREG(st.st_mode) else "not a regular file (a link, a FIFO or a device): not graded"
        out.append((name, path, why))
    return out


def refused_report(lab_dir: str, path: str, why: str) -> dict:
    return {"lab": os.path.basename(lab_dir), "file": os.path.abspath(path), "graded_as": "student",
            "sha256": None, "passed": 0, "failed": 1, "not_run": 0, "total": 1,
            "criteria": [{"name": SCAN, "status": "fail", "seconds": 0.0, "message": why, "hint": ""}]}


def read_report(path: str) -> dict | None:
    try:
        data = read_capped(path, MAX_REPORT_BYTES)
        return json.loads(data) if data else None
    except (ValueError, OSError):
        return None


def table(names: list[str], reports: dict, criteria: list[str]) -> list[list[str]]:
    rows = [["student", *criteria, "passed", "total"]]
    for name in names:
        r = reports.get(name)
        if r is None:
            rows.append([name, *["-"] * len(criteria), "grader error", str(len(criteria))])
            continue
        status = {c.get("name"): c.get("status") for c in r.get("criteria", [])}
        rows.append([name, *[SHORT.get(status.get(c), "-") for c in criteria], str(r.get("passed", 0)),
                     str(len(criteria))])
    return rows


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines) + "\n"


def write_text(path: str, text: str):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def worker(lab_dir: str, path: str, report: str, slot: int, first_failure: bool) -> list[str]:
    """One student's grading (in the full sandbox its child sees neither the class's folder
    nor the reports: they are outside the child's root)."""
    cmd = [sys.executable, "-m", "labs.grade", os.path.basename(lab_dir), "--student", path, "--json", report,
           "--slot", str(slot)]
    return cmd + (["--first-failure"] if first_failure else [])


def main(lab_dir: str, folder: str, out: str, jobs: int, first_failure: bool) -> int:
    if not os.path.isdir(folder):
        print(f"labs.grade: error: --class {folder}: not a folder", file=sys.stderr)
        return 2
    out_abs, folder_abs = os.path.realpath(out), os.path.realpath(folder)
    if out_abs == folder_abs or out_abs.startswith(folder_abs + os.sep):
        print(f"labs.grade: error: --out {out} is inside --class {folder}: the reports would be graded "
              f"as submissions", file=sys.stderr)
        return 2
    os.makedirs(out, exist_ok=True)
    lab = framework.load_lab(lab_dir)
    criteria = [SCAN] + [c.name for c in lab.CRITERIA]
    jobs = jobs or max(1, (os.cpu_count() or 1) // 4)
    limit = 60 + sum(c.timeout + 30 for c in lab.CRITERIA)   # a worker's whole grading
    todo = submissions(folder)
    probe = Sandbox()
    partial = probe.mode == "partial"
    print(f"class: {len(todo)} submission(s) in {folder}, lab {os.path.basename(lab_dir)}, {jobs} at once; "
          f"{probe.mode_line()}", flush=True)
    probe.close()
    digest = tree_digest() if partial else ""
    reports, running, queue, since_check = {}, {}, list(todo), []
    start = time.monotonic()
    while queue or running:
        while queue and len(running) < jobs:
            name, path, why = queue.pop(0)
            report = os.path.join(out, f"{name}.json")
            if why:
                write_report(report, refused_report(lab_dir, path, why))
                reports[name] = read_report(report)
                print(f"  {name}: refused: {why}", flush=True)
                continue
            slot = next(s for s in range(jobs) if s not in {v[1] for v in running.values()})
            if os.path.lexists(report):
                os.unlink(report)
            log = open(os.path.join(out, f"{name}.log"), "wb")
            proc = subprocess.Popen(worker(lab_dir, path, report, slot, first_failure), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=framework.REPO)
            running[name] = (proc, slot, log, time.monotonic())
        time.sleep(0.2)
        for name, (proc, slot, log, t0) in list(running.items()):
            if proc.poll() is None and time.monotonic() - t0 < limit:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
            del running[name]
            r = read_report(os.path.join(out, f"{name}.json"))
            reports[name] = r
            since_check.append(name)
            if r is None:
                print(f"  {name}: grader error (worker exit code {proc.returncode}; see {name}.log)", flush=True)
            else:
                first = next((c for c in r["criteria"] if c["status"] == "fail"), None)
                print(f"  {name}: {r['passed']}/{r['total']}" + (f"  first failure: {first['name']}"
                                                               if first else ""), flush=True)
            if partial and not running:
                now = tree_digest()
                if now != digest:
                    print(f"labs.grade: error: minipar/ or labs/ changed while grading {since_check}: stop, "
                          f"restore the checkout (git status), and grade those again as root", file=sys.stderr)
                    return 3
                since_check = []
    names = [n for n, _, _ in todo]
    rows = table(names, reports, criteria)
    buf = io.StringIO()
    csv.writer(buf).writerows(rows)
    write_text(os.path.join(out, "class.csv"), buf.getvalue())
    write_text(os.path.join(out, "class.md"), markdown(rows))
    errors = [n for n in names if reports.get(n) is None]
    print(f"class: {len(names)} graded in {time.monotonic() - start:.0f} s; {out}/class.csv and class.md"
          + (f"; grader errors: {errors}" if errors else ""), flush=True)
    return 1 if errors else 0
