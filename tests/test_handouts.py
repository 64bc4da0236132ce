"""Every command printed in the labs' handouts (labs/README.md and labs/*/README.md) works as
printed, from the repository root after `make install`, with no activated environment.

Here, for `make test`: every command has a form this test knows, names the project's own
Python (.venv/bin/...), an existing lab and existing files under labs/, and flags its program
accepts: the trainer's are checked as far as the trainer checks them before any message is
sent (minipar.train.setup.prepare, the layout for the ranks given). With MINIPAR_HANDOUTS_RUN=1
(`make labs-check-full`) every command also runs, as printed: exit 0, or 1 where it grades the
untouched stub, and never a traceback or a usage error."""
import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from labs import framework  # noqa: E402

RUN = os.environ.get("MINIPAR_HANDOUTS_RUN") == "1"
PY = ".venv/bin/python"


def commands() -> list[tuple[str, str]]:
    """(handout, command line) for every command line in a code block of a handout."""
    out = []
    for path in [os.path.join(REPO, "labs", "README.md")] + sorted(glob.glob(os.path.join(REPO, "labs", "*",
                                                                                           "README.md"))):
        inside, pending = False, ""
        for line in open(path, encoding="utf-8"):
            if line.startswith("```"):
                inside = not inside
                continue
            if not inside:
                continue
            text = pending + line.strip()
            if text.endswith("\\"):
                pending = text[:-1] + " "
                continue
            pending = ""
            first = text.split(" ", 1)[0]
            if first in ("make", PY, ".venv/bin/mpirun", "python", "python3", "mpirun", "pytest"):
                out.append((os.path.relpath(path, REPO), text))
    return out


def lab_arg(args: list[str]) -> str:
    lab = args[0]
    framework.find(lab)
    return lab


def check_paths(args: list[str]):
    for a in args:
        if a.startswith("labs/") and not os.path.exists(os.path.join(REPO, a)):
            raise AssertionError(f"{a} does not exist")


def parse_ok(parser, args):
    try:
        return parser.parse_args(args)
    except SystemExit as e:
        raise AssertionError(f"its flags are refused: {args}") from e


def check(command: str):
    words = shlex.split(command)
    check_paths(words)
    if words[0] == "make":
        targets = re.findall(r"^([a-z][\w-]*):", open(os.path.join(REPO, "Makefile")).read(), re.M)
        assert words[1] in targets, f"make {words[1]}: no such target"
        for w in words[2:]:
            if w.startswith("L="):
                framework.find(w[2:])
        return
    ranks = 1
    if words[0] == ".venv/bin/mpirun":
        assert words[1] == "-n", command
        ranks, words = int(words[2]), words[3:]
    assert words[0] == PY, f"run the project's Python, {PY} (no environment is activated after make install)"
    assert words[1] == "-m", command
    module, args = words[2], words[3:]
    if module == "labs.grade":
        from labs import grade
        parse_ok(grade.parser(), args)
        lab_arg(args)
    elif module == "labs.run":
        from labs import run
        from minipar.train import trainer as train
        from minipar.config.flags import ConfigError
        from minipar.train.setup import prepare
        p, a, flags = run.parse(args)
        framework.find(a.lab)
        targs = parse_ok(train.build_parser(), flags)
        try:
            prepare(targs, a.n or 1)
        except ConfigError as e:
            raise AssertionError(f"the trainer refuses it on {a.n or 1} rank(s): {e}") from None
    elif module in ("minipar.explain", "minipar.plan"):
        import importlib
        parse_ok(importlib.import_module(module).build_parser(), args)
    elif module == "minipar.train":
        from minipar.train import trainer as train
        from minipar.config.flags import ConfigError
        from minipar.train.setup import prepare
        targs = parse_ok(train.build_parser(), args)
        try:
            prepare(targs, ranks)
        except ConfigError as e:
            raise AssertionError(f"the trainer refuses it on {ranks} rank(s): {e}") from None
    elif re.fullmatch(r"labs\.\d\d_\w+\.show", module):
        assert os.path.exists(os.path.join(REPO, *module.split(".")) + ".py"), module
    else:
        raise AssertionError(f"a command this test does not know: {module}")


CASES = commands()


def test_the_handouts_print_commands():
    assert len(CASES) >= 30 and len({h for h, _ in CASES}) >= 12


@pytest.mark.parametrize("handout, command", CASES, ids=[f"{h}: {c[:60]}" for h, c in CASES])
def test_a_handout_command_works_as_printed(handout, command):
    check(command)
    if not RUN:
        return
    if "--class" in command or re.search(r"(^|[\s=/])ring\.py\b", command):
        pytest.skip("names the reader's own files")
    p = subprocess.run(command, shell=True, cwd=REPO, capture_output=True, text=True, timeout=900,
                       env={k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")})
    out = p.stdout + p.stderr
    stub = "student.py" in command or command.startswith("make lab ") and "STUDENT=" not in command
    failed = (1, 2) if command.startswith("make ") else (1,)      # make says 2 for a failed recipe
    assert p.returncode in ((0, *failed) if stub else (0,)), f"exit {p.returncode}: {out[-2000:]}"
    if stub and "NotImplementedError: lab " in out:
        return                                  # the untouched stub says what to write, and where
    assert "Traceback" not in out and "error: " not in out, out[-2000:]
