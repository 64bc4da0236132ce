"""Running the trainer from tests, shared by the CLI test files.

In process: `run_tiny(*flags)` runs `minipar.train.trainer.run` on a tiny model (the fixture
`fixed_peak` in conftest.py replaces the start-up matmul-peak measurement, a quarter of a
second per run, by a constant). As a user runs it: `mpirun(n, *flags)` launches
`mpirun -n N python -m minipar.train` with a timeout and one BLAS thread per rank.
"""
import json
import os
import subprocess
import sys

import pytest

from minipar.train import trainer as train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "16", "--block-size", "16",
        "--batch-size", "4", "--steps", "4", "--sample", "0"]
TINY_MPI = TINY[:-5] + ["8", "--steps", "4", "--sample", "0"]          # batch 8: divides by dp*m


def run_tiny(*flags) -> dict:
    """The tiny model, then `flags` (argparse keeps the last of a repeated flag)."""
    return train.run(train.build_parser().parse_args(TINY + list(flags)))


def read_log(path):
    """-> (per-step rows, the summary object), checking that the summary comes last, once."""
    with open(path) as f:
        objs = [json.loads(line) for line in f if line.strip()]
    assert objs and objs[-1].get("summary") is True, f"{path}: last object is not the summary"
    rows = objs[:-1]
    assert not any(o.get("summary") for o in rows), f"{path}: a summary before the end"
    return rows, objs[-1]


def mpirun(n, *flags, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIPAR_COMM_TIMEOUT="60")
    return subprocess.run([MPIRUN, "-n", str(n), sys.executable, "-m", "minipar.train", *TINY_MPI, *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def assert_exit_2_one_line(p, message):
    """Every rank exited 2; stderr has exactly one error line, naming `message`; no traceback."""
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert p.stderr.count("minipar.train: error:") == 1 and message in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and p.stdout == "", (p.stdout, p.stderr)


def assert_main_exits_2(argv, needles, capsys, case):
    """train.main(argv) in process: exit code 2, one `minipar.train: error:` line on stderr
    holding every needle, and no training output before it."""
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    out, err = capsys.readouterr()
    assert e.value.code == 2, f"{case}: exit code {e.value.code}, stderr {err!r}"
    assert err.startswith("minipar.train: error: ") and err.count("\n") == 1, f"{case}: stderr {err!r}"
    for s in needles:
        assert s in err, f"{case}: {s!r} not in {err!r}"
    assert "minipar:" not in out, f"{case}: training output before the error: {out!r}"
