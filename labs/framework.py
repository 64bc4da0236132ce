"""What a lab is, for its grader (labs/grade.py), the trainer runner (labs/run.py) and the
check that every grader can fail (labs/check_all.py).

A lab is a folder labs/NN_name/:

    README.md      the handout: background, the contract, hints, how to check
    student.py     the stub a student fills in: full signatures and docstrings, every body
                   `raise NotImplementedError("lab NN: ... see labs/NN_name/README.md")`
    solution.py    a solution written by hand, as a student would (CI grades it)
    reference.py   minipar's own code behind the stub's signatures (grade --solution)
    drive.py       the student's side: the cases, run on the student's code in a child
                   process (never the oracle), and the seam
    lab.py         the grader's side: the criteria, the oracle and the judges
    mutants/*.mutant  typical mistakes, each a patch of solution.py: its first line names the
                   criterion that must catch it, `# criterion: <name>`, comment lines say the
                   mistake, then blocks `--- solution.py` (lines of the solution) and
                   `+++ mutant` (what replaces them). A mutant may also be a whole student
                   file, mutants/*.py (a teacher's private ones usually are).

drive.py defines
    OWN            ["module:name", ...]: minipar's own implementations of what the student
                   writes; while a criterion runs, reaching one from the student's file raises
    install(student) -> counter
                   puts the student's functions at the seam of minipar, on this rank, for
                   the real trainer; counter() is how many times they ran here
    and one function per computing criterion, NAME(student, out): on every rank of the
    criterion, out.case(text) before each case and out.put(key, value) for each value the
    student's code returns (labs/child.py runs it).
lab.py defines
    TITLE          one line
    ALLOWED        labs.scan.Allowed: the imports and minipar names a solution may use
    CRITERIA       [Criterion, ...] in the order they are graded, each judged in the grader's
                   process from what the child handed back (labs/results.py)
    and the judges the criteria name (what several labs' judges share: labs/judging.py,
    and labs/pipeline_lists.py for the schedule labs).

The grader never imports the student's file: the scan (labs/scan.py) reads it, and each
criterion runs it in a sandboxed child (labs/sandbox.py) that only returns values.
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
    """One graded property.

    run: the name of drive.py's function that the child runs on every rank of `ranks`;
    judge(results) then decides in the grader's process, raising AssertionError with the
    numbers when the property fails (labs/results.py: results.get(rank, key)).
    trainer: flags of `python -m minipar.train` that the child runs with the student's code at
    the seam; the grader judges the run's log and checkpoint against the single-process twin
    it computes itself (labs/twin.py), then calls judge(run) if one is given.
    uses: the student's functions the criterion calls; after one of them ran out of time,
    later criteria that use it are reported "not run"."""
    name: str
    ranks: int = 1
    run: str | None = None
    judge: Callable | None = None
    trainer: list = field(default_factory=list)
    timeout: float = 60.0
    hint: str = ""
    uses: tuple = ()
    memory_mb: int = 3072

    @property
    def is_mpi(self) -> bool:
        return self.ranks > 1


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
    """The lab's lab.py (the grader's side); never in a process that runs the student's code."""
    return load(os.path.join(lab_dir, "lab.py"), f"lab_{os.path.basename(lab_dir)[:2]}")


def load_drive(lab_dir: str):
    """The lab's drive.py (the cases and the seam): what the child and the judges share."""
    return load(os.path.join(lab_dir, "drive.py"), f"drive_{os.path.basename(lab_dir)[:2]}")


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
    """The teacher's cases.json for this lab ({} without one): e.g. {"sizes": [...], "seeds": [...]}.
    In a criterion's child the grader hands over its copy ($MINIPAR_LAB_CASES): the child's
    unprivileged user may not read the teacher's folder."""
    import json                                 # noqa: PLC0415
    path = os.environ.get("MINIPAR_LAB_CASES")
    if not path:
        d = extra_dir(lab_dir)
        path = os.path.join(d, "cases.json") if d else None
    if not path or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def trainer_flags(*extra, **change) -> list[str]:
    """The tiny float64 model the trainer criteria run (3 steps), with `change`
    (n_head=4 -> --n-head 4) and `extra` flags: e.g. trainer_flags("--dp", "4", batch_size=12)."""
    values = {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "batch_size": 8, "steps": 3,
              "dtype": "float64", "sample": 0, **change}
    flags = [x for k, v in values.items() if v is not None for x in (f"--{k.replace('_', '-')}", str(v))]
    return [*extra, *flags]


def rank_groups(sizes):
    """(p, Group) for each p of `sizes` whose group holds this rank: ranks 0..p-1 of the world
    make the group (every rank takes part in cutting it; the others sit that p out), and its
    communicator is freed once the caller's loop body is done with it."""
    from mpi4py import MPI                      # noqa: PLC0415 - only the children need MPI

    from minipar import comm                    # noqa: PLC0415
    world = MPI.COMM_WORLD
    for p in sizes:
        if p > world.Get_size():
            continue
        sub = world.Split(0 if world.Get_rank() < p else MPI.UNDEFINED, world.Get_rank())
        if sub == MPI.COMM_NULL:
            continue
        yield p, comm.Group(sub)
        sub.Free()


def place(sizes, world_rank: int) -> tuple[int, int, int]:
    """(group index, rank in the group, p) of a world rank in a layout: `sizes` cut the world's
    ranks, in order, into groups of those sizes (e.g. (3, 1): ranks 0-2 and rank 3)."""
    start = 0
    for gi, n in enumerate(sizes):
        if world_rank < start + n:
            return gi, world_rank - start, n
        start += n
    raise ValueError(f"rank {world_rank} is outside the layout {sizes}")


def layout_groups(layouts):
    """(layout index, sizes, group index, rank in the group, Group) for each layout of
    `layouts` (tuples of group sizes covering the world, as place() cuts them), on this rank;
    every rank takes part in each layout, and its group is freed after the caller's loop body."""
    from mpi4py import MPI                      # noqa: PLC0415 - only the children need MPI

    from minipar import comm                    # noqa: PLC0415
    world = MPI.COMM_WORLD
    for li, sizes in enumerate(layouts):
        gi, r, _ = place(sizes, world.Get_rank())
        sub = world.Split(gi, world.Get_rank())
        g = comm.Group(sub)
        sub.Free()
        yield li, sizes, gi, r, g
        g.comm.Free()


def expect(got, want, what: str, rtol: float = 0.0, atol: float = 0.0):
    """AssertionError naming `what`, the largest difference and the first bad index, unless
    got equals want within the tolerances."""
    diff = first_difference(got, want, rtol=rtol, atol=atol)
    assert diff is None, f"{what}: {diff}"


def first_difference(got, want, rtol: float = 1e-12, atol: float = 0.0) -> str | None:
    """None when got equals want within tolerance (shapes and dtypes too), else a line
    naming the largest difference and the first bad index."""
    import numpy as np                          # noqa: PLC0415 - keep `import labs` light
    if not isinstance(got, (np.ndarray, np.generic, int, float, bool, list, tuple)):
        return f"got {type(got).__name__} {got!r:.200}, want an array of {np.asarray(want).dtype}"
    try:
        got = np.asarray(got)
    except (ValueError, TypeError) as e:
        return f"got a value NumPy cannot make an array of ({e})"
    want = np.asarray(want)
    if got.dtype.kind not in "biufc":
        return f"got an array of {got.dtype}, want {want.dtype}"
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
    d = np.abs(g - w)
    worst = float(np.max(d[~np.isnan(d)])) if (~np.isnan(d)).any() else float("nan")
    return f"largest |difference| {worst:.3g}; first bad index {first}: got {g[first].item()!r}, " \
           f"want {w[first].item()!r}"
