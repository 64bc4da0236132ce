"""MPI test session: every rank runs the same tests in the same order (see Makefile).

    timeout -k 10 900 .venv/bin/mpirun -n 4 .venv/bin/python -m pytest -q -p no:cacheprovider \
        --with-mpi tests/mpi

- Rank 0 reports as usual; the other ranks' terminal output goes to /dev/null.
- A test (or collection) that fails on any rank prints that rank's failure to stderr and ends
  the whole job at once with MPI_Abort, instead of leaving the others waiting for it.
- MINIPAR_COMM_TIMEOUT defaults to 60 s here, so a deadlock fails within a minute.
- Fixture `groups`: {k: Group} for k = 1, 2, 3 and the world size. The world is cut into
  consecutive blocks of k ranks; a rank left over (rank 3 when k = 3) gets the smaller
  remainder group, so every rank has work in every test.
"""
import os
import sys

import pytest
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()

os.environ.setdefault("MINIPAR_COMM_TIMEOUT", "60")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if RANK != 0:
        quiet = open(os.devnull, "w")
        reporter = config.pluginmanager.getplugin("terminalreporter")
        if reporter is None:
            sys.stdout = quiet      # the terminal reporter, created next, writes here
        else:
            reporter._tw = type(reporter._tw)(quiet)   # already created: silence its writer


def _abort(config, what, text):
    capman = config.pluginmanager.getplugin("capturemanager")
    lines = "".join(f"[rank {RANK}] {line}\n" for line in text.splitlines())
    message = f"\n[rank {RANK}] FAILED {what}\n{lines}[rank {RANK}] aborting all {SIZE} ranks\n"
    if capman is not None:
        capman.suspend_global_capture(in_=True)
    sys.__stderr__.write(message)
    from minipar.comm import abort_world
    abort_world(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and SIZE > 1:
        _abort(item.config, f"{item.nodeid} ({report.when})", report.longreprtext)


def pytest_collectreport(report):
    if report.failed and SIZE > 1:
        _abort(_CONFIG[0], f"collecting {report.nodeid}", report.longreprtext)


_CONFIG = []


def pytest_sessionstart(session):
    _CONFIG.append(session.config)


@pytest.fixture(scope="session")
def groups():
    from minipar.comm import Group
    out = {}
    for k in sorted({1, 2, 3, SIZE}):
        sub = WORLD.Split(color=RANK // k, key=RANK)
        out[k] = Group(sub)
        sub.Free()
    return out
