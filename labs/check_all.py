"""make labs-check: every lab's grader can fail, and passes what it should.

For every lab folder:
  - minipar's own code (reference.py) and the hand-written solution.py pass every criterion;
  - the untouched stub fails, with its NotImplementedError text;
  - every mutant (at least 3) fails first at the criterion its header names;
  - every trainer criterion fails on at least one mutant when graded alone (a mistake that
    earlier criteria catch must also sink the real run: the trainer criterion can fail);
  - no stub holds a body of the solution or the reference: each stub function is a docstring
    and `raise NotImplementedError(...)` (compared on the syntax tree);
  - every minipar name a hint mentions exists.
Prints one line per lab and a total; exit 1 on any finding. `python -m labs.check_all 02 07`
checks only those labs; --jobs N checks N labs at once, each in a worker process with a sandbox
of its own; --quick grades one mutant per lab (the first by name) instead of all,
not reference.py (minipar's own code, which tests/ checks), and the solution in only the
first of a lab's trainer criteria: what `make labs-check` runs inside `make test`. `make labs-check-full` runs every mutant.
"""
from __future__ import annotations

import ast
import importlib
import os
import re
import sys
import time

from labs import framework
from labs.grade import grade, run_criterion
from labs.sandbox import Sandbox

MIN_MUTANTS = 3


def stub_findings(lab_dir: str) -> list[str]:
    """Stub functions that are more than a docstring and a NotImplementedError, or that share
    a body with the solution or the reference."""
    def functions(path):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}

    stub = functions(os.path.join(lab_dir, "student.py"))
    answers = [functions(os.path.join(lab_dir, name)) for name in ("solution.py", "reference.py")]
    found = []
    for name, fn in stub.items():
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        raises = len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])
        if not raises:
            found.append(f"student.py: {name} has a body beyond its docstring and NotImplementedError")
        for answer in answers:
            if name in answer and [ast.dump(s) for s in answer[name].body] == [ast.dump(s) for s in fn.body]:
                found.append(f"student.py: {name} has the answer's body")
    if not stub:
        found.append("student.py defines no function")
    return found


def hint_findings(lab) -> list[str]:
    """Names like comm.traffic or minipar.comm.algorithms.ring in the hints that do not exist."""
    found = []
    for c in lab.CRITERIA:
        for dotted in re.findall(r"\b((?:minipar\.)?(?:comm|train|parallel|ops|tensor|model|optim|precision)"
                                 r"(?:\.[A-Za-z_]\w*)+)", c.hint):
            parts = dotted.split(".")
            if parts[0] != "minipar":
                parts = ["minipar"] + parts
            obj, ok = importlib.import_module("minipar"), True
            for i, part in enumerate(parts[1:], start=1):
                if hasattr(obj, part):
                    obj = getattr(obj, part)
                    continue
                try:
                    obj = importlib.import_module(".".join(parts[:i + 1]))
                except ImportError:
                    ok = False
                    break
            if not ok:
                found.append(f"hint of {c.name!r} names {dotted}, which does not exist")
    return found


def trainer_findings(lab, lab_dir: str, mutants: list[str], sandbox: Sandbox) -> list[str]:
    """Each trainer criterion, graded alone on the mutants in turn, must fail on one."""
    found = []
    for c in lab.CRITERIA:
        if not c.trainer:
            continue
        for path in mutants:
            text = framework.materialize(lab_dir, path)
            if not run_criterion(lab_dir, lab, c, text, "mutant.py", sandbox).ok:
                break
        else:
            found.append(f"no mutant fails {c.name!r}: it is not shown that it can fail")
    return found


def quick_skip(lab) -> set[str]:
    """What --quick does not grade the solution in: every trainer criterion after the first."""
    trainers = [c.name for c in lab.CRITERIA if c.trainer]
    return set(trainers[1:])


def graded(lab_dir: str, path: str, sandbox: Sandbox, **kw):
    """The verdicts on the file at `path` (a .mutant: the file it stands for), quietly."""
    text = framework.materialize(lab_dir, path)
    return grade(lab_dir, text.encode("utf-8"), os.path.basename(path), sandbox, say=lambda line: None, **kw)


def check_lab(lab_dir: str, say, sandbox: Sandbox, quick: bool = False) -> tuple[list[str], int, float]:
    """-> (findings, mutants caught, seconds to grade the solution)."""
    lab = framework.load_lab(lab_dir)
    names = [c.name for c in lab.CRITERIA]
    findings = stub_findings(lab_dir) + hint_findings(lab)
    if not hasattr(lab, "ALLOWED"):
        findings.append("lab.py has no ALLOWED: the scan would not know what a solution may use")
    # --quick grades the hand-written solution only (minipar's own code is what tests/ checks),
    # and in the trainer only its first trainer criterion (the seams installed, the run compared)
    skip = quick_skip(lab) if quick else set()
    for who in ("solution.py",) if quick else ("reference.py", "solution.py"):
        start = time.monotonic()
        for v in graded(lab_dir, os.path.join(lab_dir, who), sandbox, trusted=who == "reference.py", skip=skip):
            if not v.ok and v.name not in skip:
                findings.append(f"{who} fails {v.name!r}: {v.message}")
        solution_seconds = time.monotonic() - start                  # the last: solution.py
    stub = [v for v in graded(lab_dir, os.path.join(lab_dir, "student.py"), sandbox, first_failure=True)
            if v.status == "fail"]
    if not stub or "NotImplementedError" not in stub[0].message:
        findings.append(f"the stub does not fail with its NotImplementedError: {stub[:1]}")
    folders = [os.path.join(lab_dir, "mutants")]
    if framework.extra_dir(lab_dir):                                  # a teacher's private mutants
        folders.append(os.path.join(framework.extra_dir(lab_dir), "mutants"))
    mutants = sorted(os.path.join(d, m) for d in folders if os.path.isdir(d)
                     for m in os.listdir(d) if m.endswith((".py", ".mutant")))
    if len(mutants) < MIN_MUTANTS:
        findings.append(f"{len(mutants)} mutants, at least {MIN_MUTANTS} wanted")
    chosen = mutants[:1] if quick else mutants
    caught = 0
    from labs.grade import SCAN                                       # noqa: PLC0415
    for path in chosen:
        m = os.path.relpath(path, lab_dir)
        want = framework.mutant_criterion(path)
        if want not in names + [SCAN]:
            findings.append(f"{m} names {want!r}, not a criterion ({[SCAN] + names})")
            continue
        failed = next((v for v in graded(lab_dir, path, sandbox, first_failure=True) if v.status == "fail"), None)
        if failed is None:
            findings.append(f"{m} passes every criterion")
        elif failed.name != want:
            findings.append(f"{m} fails {failed.name!r} first, its header names {want!r}: {failed.message[:200]}")
        else:
            caught += 1
    if not quick:
        findings += trainer_findings(lab, lab_dir, mutants, sandbox)
    passed = f"{len(names) - len(skip)} of them (--quick: the first trainer criterion only)" if skip else "all"
    say(f"{os.path.basename(lab_dir)}: {len(names)} criteria; {'solution' if quick else 'reference and solution'} pass "
        f"{passed} (solution graded in {solution_seconds:.1f} s); stub fails; {caught} of {len(chosen)} mutants "
        f"caught" + (f" (--quick: {len(mutants)} in all)" if quick else "")
        + ("" if not findings else f"; {len(findings)} finding(s)"))
    return findings, caught, solution_seconds


_worker_sandbox = None


def _worker_start():
    global _worker_sandbox
    from multiprocessing import util            # noqa: PLC0415
    _worker_sandbox = Sandbox()                 # a uid and scratch of its own (labs/sandbox.py)
    util.Finalize(None, _worker_sandbox.close, exitpriority=10)   # its scratch removed when the worker ends


def _worker_check(args):
    """One lab in a worker process of --jobs: (folder, findings, caught, its line)."""
    d, quick = args
    lines = []
    findings, n, _ = check_lab(d, say=lines.append, sandbox=_worker_sandbox, quick=quick)
    return d, findings, n, "\n".join(lines)


def check_labs(dirs, quick: bool, jobs: int, say) -> tuple[list, int]:
    """(findings, mutants caught) over the labs, `jobs` labs at once (each worker process its
    own sandbox); lines in the labs' order when jobs is 1, as each lab ends otherwise."""
    results = []
    if jobs <= 1:
        sandbox = Sandbox()
        say(sandbox.mode_line())
        try:
            for d in dirs:
                findings, n, _ = check_lab(d, say=say, sandbox=sandbox, quick=quick)
                results.append((d, findings, n))
        finally:
            sandbox.close()
    else:
        import multiprocessing                  # noqa: PLC0415
        probe = Sandbox()
        say(probe.mode_line() + f"; {jobs} labs at once")
        probe.close()
        with multiprocessing.get_context("fork").Pool(jobs, initializer=_worker_start) as pool:
            for d, findings, n, lines in pool.imap_unordered(_worker_check, [(d, quick) for d in dirs]):
                say(lines)
                results.append((d, findings, n))
            pool.close()                        # the workers end by themselves (not terminated):
            pool.join()                         # each removes its sandbox's scratch folder
    results.sort(key=lambda r: dirs.index(r[0]))
    return [f"{os.path.basename(d)}: {f}" for d, fs, _ in results for f in fs], sum(n for _, _, n in results)


def main(argv=None):
    import argparse  # noqa: PLC0415
    ap = argparse.ArgumentParser(prog="python -m labs.check_all", description=__doc__.split("\n\n")[0])
    ap.add_argument("labs", nargs="*", metavar="NN", help="only these labs (02, 07_schedules, ...) [all]")
    ap.add_argument("--quick", action="store_true",
                    help="one mutant per lab, not reference.py, and one trainer criterion for the solution")
    ap.add_argument("--jobs", type=int, default=1, metavar="N",
                    help="check N labs at once, each in a worker process with a sandbox of its own [1]")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error(f"--jobs {a.jobs}: want 1 or more")
    try:
        dirs = [framework.find(w) for w in a.labs] if a.labs else framework.lab_dirs()
    except ValueError as e:
        ap.error(str(e))
    start = time.monotonic()
    all_findings, caught = check_labs(dirs, a.quick, min(a.jobs, len(dirs)), say=lambda line: print(line, flush=True))
    for f in all_findings:
        print(f"  FINDING {f}")
    print(f"labs-check: {len(dirs)} lab(s), {caught} mutants caught, {len(all_findings)} finding(s), "
          f"{time.monotonic() - start:.0f} s")
    sys.exit(1 if all_findings else 0)


if __name__ == "__main__":
    main()
