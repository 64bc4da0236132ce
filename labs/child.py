"""The student's side of one criterion: run the student's code and hand back what it returned.
It judges nothing: the grader (labs/grade.py), in its own process, compares.

    [mpirun -n R] python -P -m labs.child LAB_DIR STUDENT.py RESULTS --run NAME
    [mpirun -n R] python -P -m labs.child LAB_DIR STUDENT.py RESULTS --trainer -- FLAGS

Every rank, in order:
  1. loads the lab's drive.py (the cases and the seam: never the lab's lab.py, which holds
     the oracle);
  2. replaces each function of minipar that the student writes again (drive.OWN) by a guard
     that raises "minipar's own <name> was called" when it is reached from the student's
     file (defence in depth behind the scan);
  3. loads the student's file by path, under its own file name (tracebacks name it);
  4. --run NAME: calls drive.NAME(student, out) where out records each value it returns;
     --trainer: puts the student's code at the seam (drive.install) and runs
     `python -m minipar.train FLAGS --log RESULTS/log.jsonl --save RESULTS/checkpoint`,
     recording the exit code and how many times the student's code ran on this rank;
  5. writes its record (labs/results.py) and exits; on an exception it first records the
     exception with the case it was in and the student's line, and on several ranks then
     ends the whole job, so no rank waits for this one.
--trusted (minipar's own reference.py) skips step 2.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from labs import framework
from labs.results import Encoder, write


class OwnCalled(RuntimeError):
    """minipar's own implementation of what the student writes was reached from the student's file."""


class Recorder:
    """What the drive functions call: case(text) before each case, put(key, value) for each
    value the student's code returned (or that the drive measured about it)."""

    def __init__(self, folder: str, rank: int):
        self.folder, self.rank = folder, rank
        self.encoder = Encoder()
        self.values: dict = {}
        self.current = ""

    def case(self, text: str):
        self.current = text
        with open(os.path.join(self.folder, f"progress{self.rank}"), "w", encoding="utf-8") as f:
            f.write(text[:2000])

    def put(self, key: str, value):
        self.values[key] = self.encoder.encode(value)

    def finish(self, **meta):
        write(self.folder, self.rank, self.values, self.encoder.arrays, {"case": self.current, **meta})


def student_line(tb, student_file: str) -> str:
    """'ring.py, line 23: out = a + b' for the innermost frame in the student's file, or
    the innermost frame anywhere when none is the student's."""
    frames = traceback.extract_tb(tb)
    mine = [f for f in frames if f.filename == student_file]
    others = [f for f in frames if not f.filename.startswith(framework.LABS + os.sep)]
    f = (mine or others or [None])[-1]
    if f is None:
        return ""
    code = (f.line or "").strip()
    return f"{os.path.basename(f.filename)}, line {f.lineno}" + (f": {code}" if code else "")


def describe(e: BaseException, student_file: str, case: str) -> str:
    """One line: the case, the exception and where in the student's file it was raised."""
    if isinstance(e, SyntaxError) and e.filename == student_file:
        return f"SyntaxError: {e.msg} ({os.path.basename(student_file)}, line {e.lineno})"
    if isinstance(e, SystemExit):
        text = f"the code called sys.exit({e.code!r})"
    elif isinstance(e, KeyboardInterrupt):
        text = "KeyboardInterrupt"
    else:
        try:
            message = str(e)
        except BaseException:                   # noqa: BLE001 - a hostile __str__
            message = "<its message could not be printed>"
        text = f"{type(e).__name__}: {message}"
    where = student_line(e.__traceback__, student_file)
    text = text[:1500] + (f" ({where})" if where else "")
    return f"{case}: {text}" if case else text


def guard(dotted: str, student_file: str):
    """Replace module:attr (or module:Class.method) by a guard that raises OwnCalled when a
    frame of the student's file is on the stack."""
    module_name, _, path = dotted.partition(":")
    owner = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    original = getattr(owner, attr)
    name = f"{module_name}.{path}"

    def guarded(*args, **kwargs):
        f = sys._getframe(1)                    # noqa: SLF001 - the grader's own process of inspection
        while f is not None:
            if f.f_code.co_filename == student_file:
                raise OwnCalled(f"minipar's own {name} was called (from {os.path.basename(student_file)}, "
                                f"line {f.f_lineno}): this lab grades your code, not minipar's")
            f = f.f_back
        return original(*args, **kwargs)

    guarded.__name__ = getattr(original, "__name__", attr)
    guarded.__module__ = getattr(original, "__module__", module_name)
    guarded.__doc__ = getattr(original, "__doc__", None)
    if isinstance(owner, type) and not isinstance(original, type):
        guarded = staticmethod(guarded) if isinstance(owner.__dict__.get(attr), staticmethod) else guarded
    setattr(owner, attr, guarded)


def load_student(path: str):
    """The student's module, loaded from its file under its own name (tracebacks show it)."""
    return framework.load(path, "student")


def contract_names(lab_dir: str) -> list[str]:
    """The functions and classes the lab's stub (student.py) defines at its top level, and
    each class's methods as "Class.method"."""
    import ast                                  # noqa: PLC0415
    with open(os.path.join(lab_dir, "student.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    names = []
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            names.append(n.name)
        if isinstance(n, ast.ClassDef):
            names += [f"{n.name}.{m.name}" for m in n.body if isinstance(m, ast.FunctionDef)]
    return names


def check_own_definitions(student, names: list[str], student_file: str):
    """Every function, class and method of the contract is defined in the student's own file,
    not taken from elsewhere (minipar, a lab's answer) nor inherited from it: AttributeError
    or TypeError naming it."""
    for name in names:
        obj = student
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if obj is None:
            raise AttributeError(f"the file defines no {name} (the stub's contract names it)")
        fn = getattr(obj, "__func__", None) or getattr(obj, "fget", None) or obj   # static, class, property
        code = getattr(fn, "__code__", None)
        # a class or a decorated function (functools.lru_cache, wraps) carries its module
        mine = getattr(fn, "__module__", None) == student.__name__ or \
            (code is not None and code.co_filename == student_file)
        if not mine:
            where = getattr(fn, "__module__", None) or type(fn).__name__
            raise TypeError(f"{name} is not defined in {os.path.basename(student_file)} (it comes from "
                            f"{where}): write it yourself")


def run_trainer(drive, student, flags: list[str]) -> tuple[int, object, dict]:
    """The real trainer with the student's code at the seam: -> (exit code, the seam's
    counter, the run's summary or {})."""
    from minipar.train import trainer as train                   # noqa: PLC0415
    calls = drive.install(student)
    code, summary = 0, {}
    try:
        summary = train.main(flags) or {}
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, calls, summary


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    mine = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m labs.child")
    p.add_argument("lab_dir")
    p.add_argument("student")
    p.add_argument("results")
    p.add_argument("--run", metavar="NAME")
    p.add_argument("--trainer", action="store_true")
    p.add_argument("--trusted", action="store_true")
    args = p.parse_args(mine)

    from mpi4py import MPI                      # noqa: PLC0415

    from minipar import comm                    # noqa: PLC0415
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    out = Recorder(args.results, rank)
    student_file = os.path.abspath(args.student)
    error = None
    extra = {}
    try:
        drive = framework.load(os.path.join(args.lab_dir, "drive.py"), "lab_drive")
        if not args.trusted:
            for dotted in getattr(drive, "OWN", ()):
                guard(dotted, student_file)
        out.case("importing the file")
        student = load_student(student_file)
        if not args.trusted:
            check_own_definitions(student, contract_names(args.lab_dir), student_file)
        out.case("")
        if args.trainer:
            flags += ["--log", os.path.join(args.results, "log.jsonl"),
                      "--save", os.path.join(args.results, "checkpoint")]
            code, calls, _ = run_trainer(drive, student, flags)
            extra = {"exit": code, "calls": int(calls())}
            if hasattr(calls, "record"):
                calls.record(out)
        else:
            getattr(drive, args.run)(student, out)
    except BaseException as e:                  # noqa: BLE001 - every failure is recorded, none judged here
        error = describe(e, student_file, out.current)
        extra["error_type"] = type(e).__name__
    out.finish(error=error, **extra)
    sys.stdout.flush()
    if error is not None and size > 1:
        comm.abort_world(1)
    MPI.Finalize()               # a rank that leaves without it makes mpirun kill the others
    os._exit(0 if error is None else 1)   # no atexit hook of the student's runs


if __name__ == "__main__":
    main()
