"""What a lab is, for its grader (labs/grade.py), the trainer runner (labs/run.py) and the
check that every grader can fail (labs/check_all.py).

A lab is a folder labs/NN_name/:

    README.md      the handout: background, the contract, hints, how to check
    student.py     the stub a student fills in: full signatures and docstrings, every body
                   `raise NotImplementedError("lab NN: ... see labs/NN_name/README.md")`
    solution.py    a solution written by hand, as a student would (CI grades it)
    reference.py   minipar's own code behind the stub's signatures (grade --solution)
    lab.py         the seam and the criteria (below)
    mutants/*.mutant  typical mistakes, each a patch of solution.py: its first line names the
                   criterion that must catch it, `# criterion: <name>`, comment lines say the
                   mistake, then blocks `--- solution.py` (lines of the solution) and
                   `+++ mutant` (what replaces them). A mutant may also be a whole student
                   file, mutants/*.py (a teacher's private ones usually are).

lab.py defines
    TITLE          one line
    CRITERIA       [Criterion, ...] in the order they are graded
    install(student) -> counter
                   puts the student's functions at the seam of minipar, on this rank, for
                   the real trainer; counter() is how many times they ran here
    and the check functions the criteria name.

Every criterion runs in a subprocess of its own, under mpirun when it needs ranks, with a
timeout that ends the whole job; inside it, the student's module is a copy in a scratch
folder, loaded by path (never minipar's code under the student's name).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass, field
from typing import Callable

LABS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(LABS)


@dataclass
class Criterion:
    """One graded property. check(student) runs on every rank of `ranks` and raises
    AssertionError with the numbers when the property fails; trainer: flags of
    `python -m minipar.train` to run with the student's code at the seam instead (the run
    must pass --verify and the student's code must have run on every rank)."""
    name: str
    ranks: int = 1
    check: Callable | None = None
    trainer: list = field(default_factory=list)
    timeout: float = 60.0
    hint: str = ""


def lab_dirs() -> list[str]:
    """Every lab folder, in teaching order."""
    return sorted(os.path.join(LABS, d) for d in os.listdir(LABS)
                  if d[:2].isdigit() and os.path.isfile(os.path.join(LABS, d, "lab.py")))


def find(lab: str) -> str:
    """'2', '02' or '02_ring' -> the lab's folder; ValueError naming the labs there are."""
    for d in lab_dirs():
        base = os.path.basename(d)
        if base == lab or (lab.isdigit() and int(base[:2]) == int(lab)):
            return d
    names = ", ".join(os.path.basename(d) for d in lab_dirs())
    raise ValueError(f"no lab {lab!r} (labs: {names})")


def load(path: str, name: str):
    """The module in file `path`, loaded under `name` (and registered, so it can pickle)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_lab(lab_dir: str):
    return load(os.path.join(lab_dir, "lab.py"), f"lab_{os.path.basename(lab_dir)[:2]}")


def criterion(lab, name: str) -> Criterion:
    for c in lab.CRITERIA:
        if c.name == name:
            return c
    raise ValueError(f"no criterion {name!r} in this lab (criteria: {[c.name for c in lab.CRITERIA]})")


def materialize(lab_dir: str, path: str) -> str:
    """The whole student file a mutant stands for: a .py mutant is one; a .mutant is the lab's
    solution.py with each `--- solution.py` block replaced by the `+++ mutant` block after it
    (each must occur exactly once), under the mutant's comment lines."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not path.endswith(".mutant"):
        return text
    lines = text.splitlines(keepends=True)
    head = 0
    while head < len(lines) and lines[head].startswith("#"):
        head += 1
    blocks, mode = [], None
    for line in lines[head:]:
        if line.rstrip("\n") == "--- solution.py":
            blocks.append(["", ""])
            mode = 0
        elif line.rstrip("\n") == "+++ mutant" and blocks:
            mode = 1
        elif mode is None:
            raise ValueError(f"{path}: expected '--- solution.py', got {line!r}")
        else:
            blocks[-1][mode] += line
    with open(os.path.join(lab_dir, "solution.py"), encoding="utf-8") as f:
        code = f.read()
    for old, new in blocks:
        if code.count(old) != 1:
            raise ValueError(f"{path}: a '--- solution.py' block occurs {code.count(old)} times in "
                             f"solution.py, not once: {old.splitlines()[:1]}")
        code = code.replace(old, new)
    return "".join(lines[:head]) + code


def mutant_criterion(path: str) -> str:
    """The criterion a mutant's first line names: `# criterion: <name>`."""
    with open(path, encoding="utf-8") as f:
        first = f.readline().strip()
    prefix = "# criterion:"
    if not first.startswith(prefix):
        raise ValueError(f"{path}: the first line must be '{prefix} <name>', got {first!r}")
    return first[len(prefix):].strip()


def extra_dir(lab_dir: str) -> str | None:
    """A teacher's private cases for this lab: $MINIPAR_LAB_EXTRA/NN_name/ (mutants/*.py and
    cases.json), or None."""
    root = os.environ.get("MINIPAR_LAB_EXTRA")
    d = os.path.join(root, os.path.basename(lab_dir.rstrip("/"))) if root else None
    return d if d and os.path.isdir(d) else None


def extra_cases(lab_dir: str) -> dict:
    """The teacher's cases.json for this lab ({} without one): e.g. {"sizes": [...], "seeds": [...]}."""
    import json                                 # noqa: PLC0415
    d = extra_dir(lab_dir)
    path = os.path.join(d, "cases.json") if d else None
    if not path or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def trainer_flags(*extra, **change) -> list[str]:
    """The tiny float64 model the trainer criteria run (3 steps, --verify), with `change`
    (n_head=4 -> --n-head 4) and `extra` flags: e.g. trainer_flags("--dp", "4", batch_size=12)."""
    values = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "batch_size": 8, "steps": 3,
              "dtype": "float64", "sample": 0, **change}
    flags = [x for k, v in values.items() if v is not None for x in (f"--{k.replace('_', '-')}", str(v))]
    return [*extra, *flags, "--verify"]


def collective_uses(student, dispatcher=()) -> list[str]:
    """'line N: code' of each MPI collective the student's file references (the scan minipar's
    own code passes), and of each comm.<name> for a name in `dispatcher` (minipar.comm's own
    collectives: calling them would grade minipar, not the student)."""
    import ast                                  # noqa: PLC0415

    from minipar.comm.static_check import mpi_collective_uses  # noqa: PLC0415
    with open(student.__file__, encoding="utf-8") as f:
        source = f.read()
    found = [f"line {line}: {text}" for line, text in mpi_collective_uses(source)]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "comm" \
                and node.attr in dispatcher:
            found.append(f"line {node.lineno}: {ast.unparse(node)} (minipar's own collective)")
    return found


def gathered(g, x):
    """Every rank's x, stacked (p, *x.shape), by MPI's own Allgather: an oracle's inputs (a
    grader may use MPI's collectives; the student may not). Equal shapes on every rank."""
    import numpy as np                          # noqa: PLC0415
    x = np.ascontiguousarray(x)
    out = np.empty((g.size, *x.shape), dtype=x.dtype)
    g.comm.Allgather(x, out)
    return out


class Done:
    """A comm.Handle that finished when it was made: what a lab's seam returns for the
    non-blocking collectives when the student's functions block."""
    done = True

    def __init__(self, value):
        self.value = value

    def test(self):
        return True

    def wait(self):
        return self.value


def expect(got, want, what: str, rtol: float = 0.0, atol: float = 0.0):
    """AssertionError naming `what`, the largest difference and the first bad index, unless
    got equals want within the tolerances."""
    diff = first_difference(got, want, rtol=rtol, atol=atol)
    assert diff is None, f"{what}: {diff}"


def first_difference(got, want, rtol: float = 1e-12, atol: float = 0.0) -> str | None:
    """None when got equals want within tolerance (shapes and dtypes too), else a line
    naming the largest difference and the first bad index."""
    import numpy as np                          # noqa: PLC0415 - keep `import labs` light
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shape {got.shape}, want {want.shape}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, want {want.dtype}"
    if got.size == 0:
        return None
    g, w = got.astype(np.float64).ravel(), want.astype(np.float64).ravel()
    bad = ~np.isclose(g, w, rtol=rtol, atol=atol) & ~(np.isnan(g) & np.isnan(w))
    if not bad.any():
        return None
    first = int(np.argmax(bad))
    worst = float(np.nanmax(np.abs(g - w)))
    return f"largest |difference| {worst:.3g}; first bad index {first}: got {g[first].item()!r}, " \
           f"want {w[first].item()!r}"
