"""Grade a lab:  python -m labs.grade NN [--student PATH | --mutant PATH | --solution]
                                      [--json REPORT] [--first-failure]
                python -m labs.grade NN --class DIR --out REPORTS/ [--jobs N]

    make lab L=02                        grades labs/02_*/student.py (yours, once you fill it in)
    python -m labs.grade 02 --student ~/ring.py
    python -m labs.grade 02 --mutant labs/02_ring/mutants/m01_no_reduction.mutant
    python -m labs.grade 02 --solution   minipar's own code behind the same signatures
    python -m labs.grade 02 --class submissions/ --out reports/    a whole class (labs/classroom.py)

The grader never imports the student's file. It reads it (UTF-8 text, at most 1 MiB) and scans
its syntax tree (labs/scan.py); a file the scan refuses is not run at all. Then each criterion
runs the file in a child of its own (labs/child.py, under mpirun when it needs ranks) inside a
sandbox (labs/sandbox.py): limits, a fresh scratch folder, a timeout, every process it left
killed. The child only hands back what the student's code returned; the oracle, the expected
values and every comparison are here, in the grader's process (each lab's lab.py). One line
per criterion: PASS, FAIL or NOT RUN, its time, and what went wrong (rank, case, largest
difference, first bad index) with a hint. --json writes the verdicts, after every child is
dead, atomically, with the sha256 of the exact bytes graded. Exit 0 when every criterion
passes, 1 when one does not, 2 for a usage error.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
import traceback
from dataclasses import asdict, dataclass

from labs import framework, twin
from labs.results import Results, Unreadable, read_capped
from labs.sandbox import Sandbox

MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
MAX_STUDENT_BYTES = 1 << 20
SCAN = "scan: imports and names"
HINT_SCAN = "use only what the handout names: labs/README.md lists what the scan refuses and why"


@dataclass
class Verdict:
    name: str
    status: str                          # "pass", "fail" or "not run"
    seconds: float = 0.0
    message: str = ""
    hint: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "pass"

    def line(self) -> str:
        word = {"pass": "PASS", "fail": "FAIL", "not run": "NOT RUN"}[self.status]
        text = f"{word:<7} {self.name:<36} {self.seconds:6.1f} s"
        if self.message:
            text += f"  {self.message}"
        if self.status == "fail" and self.hint:
            text += f"\n        hint: {self.hint}"
        return text


# --- reading the file -----------------------------------------------------------------------

def read_student(path: str) -> bytes:
    """The file's bytes; ValueError with one line for what is not a regular file or too big."""
    try:
        data = read_capped(path, MAX_STUDENT_BYTES)
    except Unreadable as e:
        raise ValueError(f"{path}: {e}") from None
    if data is None:
        raise ValueError(f"{path}: no such file")
    return data


def as_text(data: bytes) -> tuple[str | None, str]:
    """(the text, '') or (None, why it is not a Python source file)."""
    if b"\0" in data:
        at = data.index(b"\0")
        return None, f"a binary file (a NUL byte at offset {at}), not Python source"
    try:
        return data.decode("utf-8"), ""
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r}); save the file as UTF-8"


def safe_name(name: str) -> str:
    """The student's file name as the child sees it: letters, digits, _ and -, ending .py."""
    stem = os.path.splitext(os.path.basename(name))[0]
    stem = "".join(ch if ch.isalnum() or ch in "_-" else "_" for ch in stem)[:60] or "student"
    return stem + ".py"


def scan_verdict(lab, text: str, filename: str) -> Verdict:
    from labs import scan                       # noqa: PLC0415
    start = time.monotonic()
    try:
        found = scan.scan(text, filename, lab.ALLOWED)
    except SyntaxError as e:
        return Verdict(SCAN, "fail", time.monotonic() - start,
                       f"SyntaxError: {e.msg} ({filename}, line {e.lineno})", HINT_SCAN)
    except (ValueError, RecursionError, MemoryError) as e:
        return Verdict(SCAN, "fail", time.monotonic() - start, f"the file cannot be parsed: {type(e).__name__}",
                       HINT_SCAN)
    if found:
        more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
        return Verdict(SCAN, "fail", time.monotonic() - start,
                       f"{filename} refused: " + "; ".join(map(str, found[:3])) + more, HINT_SCAN)
    return Verdict(SCAN, "pass", time.monotonic() - start)


# --- one criterion --------------------------------------------------------------------------

def child_command(lab_dir: str, c: framework.Criterion, student: str, results: str, trusted: bool) -> list[str]:
    inner = [sys.executable, "-P", "-m", "labs.child", lab_dir, student, results]
    inner += ["--trusted"] if trusted else []
    inner += ["--trainer", "--", *c.trainer] if c.trainer else ["--run", c.run]
    return [MPIRUN, "-n", str(c.ranks), *inner] if c.ranks > 1 else inner


def exit_note(out) -> str:
    code = out.returncode
    note = ""
    if code is not None and code < 0:
        note = {9: "killed (SIGKILL)", 24: "killed: its CPU time ran out", 25: "killed: a file grew past the limit",
                11: "crashed (segmentation fault)", 6: "aborted"}.get(-code, f"killed by signal {-code}")
    elif code not in (0, None):
        note = f"exit code {code}"
    if out.output_bytes > 1 << 20:
        note += (", " if note else "") + f"printed {out.output_bytes:,} bytes"
    last = out.last_error_line()
    if last and "exited before" not in last:
        note += (", " if note else "") + f"last error line: {last[:300]}"
    return note


def run_criterion(lab_dir: str, lab, c: framework.Criterion, text: str, filename: str, sandbox: Sandbox,
                  trusted: bool = False, shared: dict | None = None) -> Verdict:
    """Run the criterion's child and judge what it handed back. `shared`: the records of
    drive functions already run for this file ({run name: (outcome, results)}): criteria that
    name the same drive function judge one record."""
    if shared is not None and c.run and c.run in shared:
        out, results = shared[c.run]
        start = time.monotonic()
        v = judge(c, out, results)
        v.seconds = time.monotonic() - start
        return v
    scratch = sandbox.scratch()
    keep = shared is not None and bool(c.run)
    try:
        student = os.path.join(scratch, "home", filename)
        with open(student, "w", encoding="utf-8") as f:
            f.write(text)
        results_dir = os.path.join(scratch, "results")
        env = {"MINIPAR_COMM_TIMEOUT": str(min(10.0, c.timeout / 3))}
        cases = framework.extra_cases(lab_dir)
        if cases:
            path = os.path.join(scratch, "home", "cases.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(cases, f)
            env["MINIPAR_LAB_CASES"] = path
        if sandbox.uid is not None:
            for p in (student, *([env["MINIPAR_LAB_CASES"]] if cases else [])):
                os.chown(p, sandbox.uid, sandbox.uid)
        out = sandbox.run(child_command(lab_dir, c, student, results_dir, trusted), scratch, env, c.timeout)
        results = Results(results_dir, c.ranks, exit_note(out))
        if keep:
            shared[c.run] = (out, results)
        return judge(c, out, results)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def judge(c: framework.Criterion, out, results: Results) -> Verdict:
    if out.stderr.startswith("jail:"):
        return Verdict(c.name, "fail", out.seconds, f"the sandbox could not start ({out.stderr.strip()[:300]}): "
                                                    f"a grader problem, not the student's")
    if out.timed_out:
        where = sorted({results.progress(r) for r in range(c.ranks)} - {""})
        kind = "a deadlock? MINIPAR_TRACE=1 shows every message" if c.is_mpi else "an infinite loop?"
        return Verdict(c.name, "fail", out.seconds,
                       f"did not finish within {c.timeout:g} s ({kind})"
                       + (f"; it was in the case {' / '.join(where)[:400]}" if where else ""), c.hint)
    try:
        if c.trainer:
            run = twin.judge(results, c.trainer, c.ranks)
            if c.judge is not None:
                c.judge(run)
            message = run.figures.get("line", "")
        else:
            c.judge(results)
            message = ""
    except AssertionError as e:
        return Verdict(c.name, "fail", out.seconds, str(e)[:4000], c.hint)
    except Unreadable as e:
        return Verdict(c.name, "fail", out.seconds, f"what the child handed back is unreadable: {e}", c.hint)
    except Exception as e:                      # noqa: BLE001 - a value the judge could not handle
        if os.environ.get("MINIPAR_LAB_DEBUG"):
            traceback.print_exc()
        return Verdict(c.name, "fail", out.seconds,
                       f"what came back could not be judged: {type(e).__name__}: {str(e)[:300]}", c.hint)
    return Verdict(c.name, "pass", out.seconds, message)


# --- a whole file ---------------------------------------------------------------------------

def grade(lab_dir: str, data: bytes, filename: str, sandbox: Sandbox, *, trusted: bool = False,
          scan: bool = True, first_failure: bool = False, skip=frozenset(), say=print) -> list[Verdict]:
    """Every criterion's verdict on the file `data` (its bytes), named `filename` for the
    student. The scan first (unless trusted or scan=False); a refused file runs nothing. The
    criteria named in `skip` are not run (labs-check --quick)."""
    lab = framework.load_lab(lab_dir)
    name = safe_name(filename)
    text, why = as_text(data)
    verdicts: list[Verdict] = []

    def add(v: Verdict):
        verdicts.append(v)
        say(v.line())

    if text is None:
        add(Verdict(SCAN, "fail", 0.0, why, HINT_SCAN))
    elif trusted or not scan:
        add(Verdict(SCAN, "pass", 0.0, "(not scanned: " + ("minipar's own code)" if trusted else "--no-scan)")))
    else:
        add(scan_verdict(lab, text, name))
    stopped = "" if verdicts[0].ok else "the file was refused before it ran"
    hung: dict[str, str] = {}                  # a student function -> the criterion it hung in
    shared: dict = {}                          # drive function -> its record, for criteria sharing it
    for c in lab.CRITERIA:
        blocked = sorted(set(c.uses) & set(hung))
        if stopped:
            add(Verdict(c.name, "not run", 0.0, f"({stopped})"))
            continue
        if blocked:
            add(Verdict(c.name, "not run", 0.0, f"({blocked[0]} did not finish in {hung[blocked[0]]!r})"))
            continue
        if c.name in skip:
            add(Verdict(c.name, "not run", 0.0, "(skipped)"))
            continue
        v = run_criterion(lab_dir, lab, c, text, name, sandbox, trusted, shared)
        add(v)
        if v.status == "fail" and v.message.startswith("did not finish"):
            hung.update({u: c.name for u in c.uses})
        if first_failure and v.status == "fail":
            stopped = "--first-failure: stopped after the first failure"
    return verdicts


def tally(verdicts: list[Verdict]) -> dict:
    return {s.replace(" ", "_"): sum(v.status == s for v in verdicts) for s in ("pass", "fail", "not run")}


def summary_line(verdicts: list[Verdict]) -> str:
    t = tally(verdicts)
    return f"{t['pass']} passed, {t['fail']} failed" + (f", {t['not_run']} not run" if t["not_run"] else "")


def write_report(path: str, report: dict):
    """The JSON report, written whole or not at all (a temporary file renamed into place)."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, path)


def report(lab_dir: str, path: str, data: bytes, graded_as: str, verdicts: list[Verdict], sandbox: Sandbox) -> dict:
    t = tally(verdicts)
    return {"lab": os.path.basename(lab_dir), "file": os.path.abspath(path), "graded_as": graded_as,
            "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "sandbox": sandbox.mode_line(),
            "passed": t["pass"], "failed": t["fail"], "not_run": t["not_run"], "total": len(verdicts),
            "criteria": [asdict(v) for v in verdicts]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labs.grade", description=__doc__.split("\n\n")[0])
    p.add_argument("lab", help="the lab: its number (02) or folder name (02_ring)")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--student", metavar="PATH", help="the file to grade, as it is [labs/NN_name/student.py]")
    who.add_argument("--mutant", metavar="PATH", help="a planted mistake: a .mutant patch of solution.py, or a .py")
    who.add_argument("--solution", action="store_true", help="grade minipar's own code (reference.py)")
    who.add_argument("--class", dest="klass", metavar="DIR", help="grade every file in DIR (labs/classroom.py)")
    p.add_argument("--json", metavar="REPORT", help="write the verdicts, with the file's sha256")
    p.add_argument("--out", metavar="DIR", help="with --class: one JSON per student, class.csv and class.md")
    p.add_argument("--jobs", type=int, default=0, metavar="N",
                   help="with --class: students graded at once [cores / 4, at least 1]")
    p.add_argument("--first-failure", action="store_true", help="stop at the first failing criterion")
    p.add_argument("--no-scan", action="store_true",
                   help="run the file without the scan (to see what the sandbox alone holds; never for a grade)")
    p.add_argument("--slot", type=int, default=0, help=argparse.SUPPRESS)   # --class: this worker's sandbox uid
    return p


def main(argv=None):
    p = parser()
    args = p.parse_args(argv)
    try:
        lab_dir = framework.find(args.lab)
    except ValueError as e:
        p.error(str(e))
    if args.klass:
        from labs import classroom               # noqa: PLC0415
        if not args.out:
            p.error("--class needs --out DIR for the reports")
        sys.exit(classroom.main(lab_dir, args.klass, args.out, args.jobs, args.first_failure))
    if args.out:
        p.error("--out goes with --class")
    if args.jobs < 0:
        p.error(f"--jobs {args.jobs}: at least 1")
    trusted = args.solution
    path = args.student or args.mutant or os.path.join(lab_dir, "reference.py" if trusted else "student.py")
    try:
        if args.mutant:
            data = framework.materialize(lab_dir, path).encode("utf-8")
        else:
            data = read_student(path)
    except (ValueError, OSError) as e:
        p.error(str(e))
    if args.json and os.path.isdir(args.json):
        p.error(f"--json {args.json}: is a directory")
    graded_as = "solution" if trusted else "mutant" if args.mutant else "student"
    sandbox = Sandbox(slot=args.slot)
    try:
        print(f"lab {os.path.basename(lab_dir)}: grading {path} as {graded_as} "
              f"(sha256 {hashlib.sha256(data).hexdigest()[:16]})", flush=True)
        print(sandbox.mode_line(), flush=True)
        verdicts = grade(lab_dir, data, os.path.basename(path), sandbox, trusted=trusted, scan=not args.no_scan,
                         first_failure=args.first_failure, say=lambda line: print(line, flush=True))
    finally:
        sandbox.close()
    print(summary_line(verdicts), flush=True)
    if args.json:
        write_report(args.json, report(lab_dir, path, data, graded_as, verdicts, sandbox))
    sys.exit(0 if all(v.ok for v in verdicts) else 1)


if __name__ == "__main__":
    main()
