"""The docs stay true, and the project cites only itself.

- Every command line in a fenced block of README.md and docs/*.md that runs minipar
  (`python -m minipar.train ...`, under `mpirun` or not) is run with --dry-run appended: a
  renamed flag or a layout that no longer fits fails here. The dry runs of one world size
  share a job (tests/tools/dry_runs.py: minipar.train.trainer.main, one command after the other). `python -m minipar.plan ...` lines
  run as they are (the planner only computes). `python -m minipar.convert ...` lines run for
  real, on folders the docs' own commands make first (a --save of the trainer, or another
  conversion). Commands that run pytest or a script must name files that exist.
- No file of the repository refers to a document outside it (docs/design.md §10's rule: cite
  docs/design.md, a paper, or the formula itself).
- The README stays short, and docs/ has its pages.
"""
from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
DOCS = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(REPO, "docs"))
                              if f.endswith(".md"))
PAGES = ["design", "collectives", "data-parallel", "tensor-parallel", "pipeline", "zero", "mixed-precision",
         "checkpoints", "verify", "planner", "performance", "debugging", "pictures", "cluster", "recompute",
         "sequence-parallel", "context-parallel", "moe", "llama"]


def fenced_commands(text: str) -> list[str]:
    """The command lines inside ``` blocks: lines that start (after an optional `$ ` and
    VAR=value settings) with mpirun or `python -m minipar`, backslash continuations joined."""
    out, inside, pending = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            inside, pending = not inside, ""
            continue
        if not inside:
            continue
        line = pending + line.strip().removeprefix("$ ")
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        words = line.split()
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            words = words[1:]
        if words and (words[0] == "mpirun" or words[:3] == ["python", "-m", "minipar.train"]
                      or (words[:2] == ["python", "-m"] and words[2].startswith("minipar"))):
            out.append(" ".join(line.split()))
    return out


def doc_commands() -> list[tuple[str, str]]:
    seen, out = set(), []
    for doc in DOCS:
        with open(os.path.join(REPO, doc), encoding="utf-8") as f:
            for cmd in fenced_commands(f.read()):
                if cmd not in seen:
                    seen.add(cmd)
                    out.append((doc, cmd))
    return out


def runnable(cmd: str) -> tuple[dict, list[str], str]:
    """-> (environment additions, argv with this venv's python and mpirun, what it runs:
    "train", "plan", "convert", "plot", "explain", "pytest", "script" or "other")."""
    words = shlex.split(cmd, comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    argv = [os.path.join(BIN, "mpirun") if w == "mpirun" else sys.executable if w == "python" else w
            for w in words]
    if "minipar.train" in words:
        kind = "train"
    elif "minipar.plan" in words:
        kind = "plan"
    elif "minipar.convert" in words:
        kind = "convert"
    elif "minipar.plot" in words or "minipar.explain" in words:
        kind = "plot" if "minipar.plot" in words else "explain"
    elif "pytest" in words:
        kind = "pytest"
    elif any(w.startswith("scripts/") for w in words):
        kind = "script"
    else:
        kind = "other"
    return env, argv, kind


COMMANDS = doc_commands()
DRY_RUNS = os.path.join(REPO, "tests", "tools", "dry_runs.py")


def batch_key(argv: list[str], env: dict):
    """The job a train command's dry run can share: its world size and environment; None for
    one that must run alone (--resume: its checkpoint is made first)."""
    if "--resume" in argv:
        return None
    n = int(argv[argv.index("-n") + 1]) if "-n" in argv else 1
    return n, tuple(sorted(env.items()))


@pytest.fixture(scope="session")
def dry_runs(tmp_path_factory):
    """Every docs train command's dry run, one job per (world size, environment):
    cmd -> (exit code, stdout), or the job's stderr when it ended before answering."""
    import json                                                  # noqa: PLC0415
    groups = {}
    for _, cmd in COMMANDS:
        env, argv, kind = runnable(cmd)
        key = batch_key(argv, env) if kind == "train" else None
        if key is not None:
            groups.setdefault(key, []).append((cmd, argv[argv.index("minipar.train") + 1:] + ["--dry-run"]))
    results = {}
    for (n, env), items in groups.items():
        path = tmp_path_factory.mktemp("dry") / "commands.json"
        path.write_text(json.dumps([a for _, a in items]))
        launch = [os.path.join(BIN, "mpirun"), "-n", str(n)] if n > 1 else []
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                    "MINIPAR_COMM_TIMEOUT": "120", **dict(env)}
        p = subprocess.run([*launch, sys.executable, DRY_RUNS, str(path)], cwd=REPO, env=full_env,
                           capture_output=True, text=True, timeout=60 + 30 * len(items))
        lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
        for line in lines:
            if "i" in line:
                results[items[line["i"]][0]] = (line["code"], line["out"])
        for cmd, _ in items:
            results.setdefault(cmd, (p.returncode or 1, f"the job ended (exit {p.returncode}) before this "
                                     f"command answered:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"))
    return results


def test_the_docs_show_commands():
    kinds = {runnable(cmd)[2] for _, cmd in COMMANDS}
    assert {"train", "plan"} <= kinds and len(COMMANDS) >= 20, (kinds, len(COMMANDS))


@pytest.mark.parametrize("doc,cmd", COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_doc_command_runs(doc, cmd, tmp_path, dry_runs):
    env, argv, kind = runnable(cmd)
    if kind in ("pytest", "script"):
        paths = [w.split("::")[0] for w in argv if w.startswith(("tests/", "scripts/"))]
        missing = [p for p in paths if not os.path.exists(os.path.join(REPO, p))]
        assert paths and not missing, f"{doc}: `{cmd}` names missing files {missing}"
        return
    if kind in ("plot", "explain"):         # their flags parse and make sense (they need a run)
        module = importlib.import_module(f"minipar.{kind}")
        flags = argv[argv.index(f"minipar.{kind}") + 1:]
        try:
            args = module.build_parser().parse_args(flags)
            if kind == "explain":
                module.settle(args)
        except (SystemExit, Exception) as e:
            pytest.fail(f"{doc}: `{cmd}`: its flags do not parse: {e!r}")
        return
    assert kind in ("train", "plan", "convert"), f"{doc}: `{cmd}` runs none of minipar.train, plan, convert, " \
                                                 f"plot, explain"
    if cmd in dry_runs:                     # its dry run, in the job of its world size
        code, out = dry_runs[cmd]
        assert code == 0, f"{doc}: `{cmd}` exited {code}:\n{out[-3000:]}"
        assert "dry run: the flags, the layout" in out and "mechanisms:" in out, out
        return
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **env}
    if kind == "train":
        argv = argv + ["--dry-run"]
        if "--resume" in argv:              # the checkpoint the docs wrote before, made for real
            argv = resume_from_docs(argv, tmp_path, full_env, f"{doc}: `{cmd}`")
    if kind == "convert":                   # for real, from a folder the docs' commands make
        src, out = convert_paths(argv)
        made = made_by_docs(src, tmp_path, full_env, f"{doc}: `{cmd}`")
        argv = [made if w == src else str(tmp_path / "converted") if w == out else w for w in argv]
    p = subprocess.run(argv, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, f"{doc}: `{cmd}` exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    if kind == "train":
        assert "dry run: the flags, the layout" in p.stdout and "mechanisms:" in p.stdout, p.stdout


def resume_from_docs(argv, tmp_path, env, what) -> list[str]:
    """A --resume DIR command: DIR made for real as the docs make it (made_by_docs); -> argv
    resuming from there."""
    d = argv[argv.index("--resume") + 1]
    made = made_by_docs(d, tmp_path, env, what)
    return [made if w == d else w for w in argv]


def convert_paths(argv) -> tuple[str, str]:
    """(input, output) folders of a `python -m minipar.convert` command line."""
    from minipar.convert import cli                                 # noqa: PLC0415
    args = cli.build_parser().parse_args(argv[argv.index("minipar.convert") + 1:])
    return args.source, args.output


_MADE: dict = {}                            # a folder of the docs -> where this session made it


def made_by_docs(d: str, tmp_path, env, what) -> str:
    """The folder d that a docs command writes, made for real (once per session) in tmp_path:
    by the train command that saves it (--save d, cut to 2 steps), or by the convert command
    whose output it is (its own input made first, the same way). -> its path."""
    if d in _MADE:
        return _MADE[d]
    out = str(tmp_path / f"made-{len(_MADE)}")
    savers = [c for _, c in COMMANDS if runnable(c)[2] == "train" and f"--save {d}" in c and "--resume" not in c]
    makers = [c for _, c in COMMANDS if runnable(c)[2] == "convert" and convert_paths(runnable(c)[1])[1] == d]
    assert savers or makers, f"{what}: no command in the docs writes {d}"
    if savers:
        maker_env, argv, _ = runnable(savers[0])
        argv = [out if w == d else w for w in argv] + ["--steps", "2"]      # (last wins)
    else:
        maker_env, argv, _ = runnable(makers[0])
        src = convert_paths(argv)[0]
        made = made_by_docs(src, tmp_path, env, what)
        argv = [made if w == src else out if w == d else w for w in argv]
    p = subprocess.run(argv, cwd=REPO, env={**env, **maker_env}, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, f"{what}: making {d} with `{(savers or makers)[0]}` failed:\n{p.stderr[-2000:]}"
    _MADE[d] = out
    return out


def test_a_stale_command_fails_the_dry_run():
    """The check above can fail: a renamed flag and a layout that does not fit exit 2."""
    for bad in (["--micro-batch", "2"], ["--microbatches", "2"], ["--dp", "3"]):
        p = subprocess.run([sys.executable, "-m", "minipar.train", *bad, "--dry-run"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, (bad, p.stdout, p.stderr)


def test_the_shared_dry_run_job_reports_each_command(tmp_path):
    """tests/tools/dry_runs.py: a command that fails (a layout that does not fit) answers its
    exit code, and the job goes on to the next."""
    import json                                                  # noqa: PLC0415
    path = tmp_path / "commands.json"
    path.write_text(json.dumps([["--dp", "3", "--dry-run"], ["--dp", "2", "--dry-run"]]))
    p = subprocess.run([os.path.join(BIN, "mpirun"), "-n", "2", sys.executable, DRY_RUNS, str(path)], cwd=REPO,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    answers = [json.loads(x) for x in p.stdout.splitlines() if x.startswith('{"i"')]
    assert p.returncode == 0 and [a["code"] for a in answers] == [2, 0], (p.stdout, p.stderr)
    assert "dry run: the flags, the layout" in answers[1]["out"]


def test_fenced_commands_are_extracted():
    text = ("```\n$ mpirun -n 2 python -m minipar.train --dp 2 \\\n    --verify\n"
            "MINIPAR_TRACE=1 python -m minipar.plan --dp 2\nstep 0 | loss 5.5\n```\n"
            "python -m minipar.train outside a block\n")
    assert fenced_commands(text) == ["mpirun -n 2 python -m minipar.train --dp 2 --verify",
                                     "MINIPAR_TRACE=1 python -m minipar.plan --dp 2"]


# --- only documents inside the repository are cited --------------------------------------------

# (written with character classes, so that this file does not match itself)
OUTSIDE = re.compile(r"DESIG[N] [0-9]|DESIG[N]'s|DESIG[N]\.md|STYL[E]\.md|\b[Ii]ssue[s]? #?[0-9]+|the see[d]'s|"
                     r"\b[Tt]he see[d]s\b|see[d]s'|\.\./share[d]|share[d]/(seeds|hooks)")


def outside_references(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if OUTSIDE.search(line)]


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True)
    if out.returncode != 0:                     # not a git checkout: walk the tree
        return [os.path.relpath(os.path.join(d, f), REPO) for d, dirs, files in os.walk(REPO)
                if not any(part.startswith(".") for part in os.path.relpath(d, REPO).split(os.sep)[1:])
                for f in files]
    return out.stdout.split()


def test_no_reference_to_documents_outside_the_repository():
    hits = []
    for path in tracked_files():
        if not path.endswith((".py", ".md", ".cfg", ".toml", "Makefile", "run")):
            continue
        full = os.path.join(REPO, path)
        if os.path.isfile(full):
            with open(full, encoding="utf-8", errors="replace") as f:
                hits += [f"{path}: {line}" for line in outside_references(f.read())]
    assert not hits, "cite docs/design.md, a paper or the formula instead:\n" + "\n".join(hits[:20])


def test_the_reference_check_catches_planted_ones():
    planted = ["the names of DESI" + "GN 2.2", "see iss" + "ue 9", "as in iss" + "ue #12", "the se" + "ed's example",
               "The se" + "eds list seven", "read ../sha" + "red/STY" + "LE.md"]     # split: see OUTSIDE
    assert all(outside_references(t) for t in planted), [t for t in planted if not outside_references(t)]
    assert not outside_references("the same seed gives the same weights; docs/design.md §2")


# --- the shape of the documentation ------------------------------------------------------------

def test_readme_is_short_and_links_every_page():
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 300, len(readme.splitlines())
    for page in PAGES:
        assert os.path.isfile(os.path.join(REPO, "docs", page + ".md")), f"docs/{page}.md is missing"
        assert f"docs/{page}.md" in readme, f"README.md does not link docs/{page}.md"


def test_relative_links_resolve():
    broken = []
    for doc in DOCS:
        with open(os.path.join(REPO, doc), encoding="utf-8") as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.join(REPO, os.path.dirname(doc), target)):
                broken.append(f"{doc} -> {target}")
    assert not broken, broken


def test_no_library_line_over_120_characters():
    long = []
    for d, _, files in os.walk(os.path.join(REPO, "minipar")):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(d, f), encoding="utf-8") as fh:
                    long += [f"{os.path.relpath(os.path.join(d, f), REPO)}:{i}" for i, line in enumerate(fh, 1)
                             if len(line.rstrip("\n")) > 120]
    assert not long, long


# --- the names the docs cite exist -------------------------------------------------------------

def cited_names(text: str) -> tuple[list[str], list[str]]:
    """(file paths, module.attribute names) written in `code` spans of a page."""
    paths, names = [], []
    for span in re.findall(r"`([^`\n]+)`", text):
        paths += re.findall(r"((?:minipar|tests|scripts)/[\w/]+\.py)", span)
        if not span.startswith(("python", "mpirun", "$")):
            names += [f"{a}.{b}" for a, b in re.findall(r"\b([a-z_]+)\.([A-Za-z_]\w*)\b", span)
                      if b not in ("py", "md", "npz", "json", "jsonl", "svg", "txt")]
    return paths, names


def resolves(name: str) -> bool | None:
    """Does module.attribute exist? None when the first part is not one of minipar's modules
    (a variable such as `p.grad`). `model.x` is read as the Model interface's or a layout's."""
    import minipar                              # noqa: PLC0415, F401
    from minipar.model.contract import Model        # noqa: PLC0415
    from minipar.parallel.tensor.tensor_parallel import TensorParallelGPT  # noqa: PLC0415
    head, attr = name.split(".")
    if head == "model":
        return hasattr(Model, attr) or hasattr(TensorParallelGPT, attr) or None
    modules = {}                                # a file's or a package's name -> its modules
    for d, dirs, files in os.walk(os.path.join(REPO, "minipar")):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        here = os.path.relpath(d, REPO).replace(os.sep, ".")
        modules.setdefault(os.path.basename(d), []).append(here)
        for f in files:
            if f.endswith(".py") and f not in ("__init__.py", "__main__.py"):
                modules.setdefault(f[:-3], []).append(f"{here}.{f[:-3]}")
    if head not in modules:
        return None
    for name in modules[head]:
        module = importlib.import_module(name)
        if hasattr(module, attr):
            return True
        try:
            importlib.import_module(f"{name}.{attr}")
            return True
        except ImportError:
            pass
    return False


@pytest.mark.parametrize("doc", DOCS)
def test_the_code_names_a_page_cites_exist(doc):
    with open(os.path.join(REPO, doc), encoding="utf-8") as f:
        paths, names = cited_names(f.read())
    missing = [p for p in paths if not os.path.exists(os.path.join(REPO, p))]
    missing += [n for n in names if resolves(n) is False]
    assert not missing, f"{doc} cites what the code does not have: {sorted(set(missing))}"


def test_a_renamed_function_is_caught():
    assert resolves("stage.local_param_count") and resolves("comm.traffic_by_axis")
    assert resolves("stage.timeline_svg") is False and resolves("comm.small") is False
    assert resolves("p.grad") is None


# --- the one module list -----------------------------------------------------------------------

def listed_modules() -> list[str]:
    """The files docs/design.md's module list names, in its order."""
    with open(os.path.join(REPO, "docs", "design.md"), encoding="utf-8") as f:
        text = f.read()
    block = text.split("The modules, package by package", 1)[1].split("```", 2)[1]
    return [line.split()[0] for line in block.splitlines() if line.strip()]


def code_files() -> list[str]:
    """Every library file with code of its own: each .py under minipar/ but __main__.py and
    the __init__.py files that define no function or class (docstrings and re-exports)."""
    import ast                                  # noqa: PLC0415
    out = []
    root = os.path.join(REPO, "minipar")
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        for f in files:
            path = os.path.join(d, f)
            if not f.endswith(".py") or f == "__main__.py":
                continue
            if f == "__init__.py":
                with open(path, encoding="utf-8") as fh:
                    tree = ast.parse(fh.read())
                if not any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in tree.body):
                    continue
            out.append(os.path.relpath(path, root).replace(os.sep, "/"))
    return sorted(out)


def test_the_module_list_is_the_tree():
    listed = listed_modules()
    assert len(listed) == len(set(listed)), f"listed twice: {sorted({m for m in listed if listed.count(m) > 1})}"
    tree = code_files()
    assert not set(tree) - set(listed), f"docs/design.md's module list lacks {sorted(set(tree) - set(listed))}"
    assert not set(listed) - set(tree), f"docs/design.md lists files that are not there: {sorted(set(listed) - set(tree))}"


def test_the_module_list_check_fails_on_a_missing_file(tmp_path, monkeypatch):
    listed = listed_modules()
    assert "train/trainer.py" in listed and "autograd/tensor.py" in listed
    monkeypatch.setattr(sys.modules[__name__], "listed_modules", lambda: listed[1:])
    with pytest.raises(AssertionError, match="lacks"):
        test_the_module_list_is_the_tree()


def test_every_package_says_what_it_holds():
    """Each package's __init__.py opens with a docstring naming every module beside it."""
    import ast                                  # noqa: PLC0415
    root = os.path.join(REPO, "minipar")
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        if "__init__.py" not in files:
            continue
        with open(os.path.join(d, "__init__.py"), encoding="utf-8") as fh:
            doc = ast.get_docstring(ast.parse(fh.read())) or ""
        assert doc, f"{os.path.relpath(d, REPO)}/__init__.py has no docstring"
        names = [f for f in files if f.endswith(".py") and f not in ("__init__.py", "__main__.py")]
        names += [x + "/" for x in dirs]
        missing = [n for n in names if n.replace("/", "") not in doc]
        assert not missing, f"{os.path.relpath(d, REPO)}/__init__.py does not name {missing}"
