"""minipar.comm without MPI ranks: the library never calls MPI's own collectives (a scan of
the source), and, in two small mpirun jobs, a stuck rank or a failing test ends the job
with its message instead of hanging."""
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from minipar.comm.static_check import mpi_collective_uses

ROOT = Path(__file__).resolve().parents[1]
MPIRUN = Path(sys.executable).parent / "mpirun"

def test_scanner_catches_collectives():
    """The scan itself: it must see each way of calling a collective, and not our own names."""
    bad = textwrap.dedent("""
        from mpi4py import MPI
        MPI.COMM_WORLD.Allreduce(x, y)
        g.comm.Bcast(x, root=0)
        comm.Barrier()
        req = self.comm.Iallreduce(x, y)
        g.comm.allgather(obj)
        MPI.COMM_WORLD.reduce(obj)
        g.comm.gather(obj)
        f = g.comm.Reduce_scatter_block
    """)
    assert sorted(line for line, _ in mpi_collective_uses(bad)) == [3, 4, 5, 6, 7, 8, 9, 10]
    fine = textwrap.dedent("""
        out = comm.reduce(g, x, 0)
        parts = comm.gather(g, x, 0)
        piece = comm.scatter(g, x, 0)
        total = np.add.reduce(x)
        functools.reduce(np.add, xs)
        req = g.comm.Isend([buf, MPI.BYTE], dst, tag)
        sub = MPI.COMM_WORLD.Split(color, key); dup = sub.Dup()
    """)
    assert mpi_collective_uses(fine) == []


def test_library_never_calls_mpi_collectives():
    files = sorted((ROOT / "minipar").rglob("*.py"))
    assert any(f.parent.name == "comm" for f in files), "minipar/comm/ not found"
    found = [f"{f.relative_to(ROOT)}:{line}: {text}"
             for f in files for line, text in mpi_collective_uses(f.read_text(), str(f))]
    assert not found, "MPI's own collectives in library code (only tests and benchmarks " \
                      "may use them):\n" + "\n".join(found)


# ------------------------------------------------------------ jobs that must end, not hang

def _mpirun(n, args, timeout):
    if not MPIRUN.exists():
        pytest.skip(f"no mpirun next to {sys.executable}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPIR_"))}
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start = time.monotonic()
    proc = subprocess.run([str(MPIRUN), "-n", str(n), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc, time.monotonic() - start


def test_a_stuck_rank_ends_the_job_with_a_timeout_naming_op_step_and_peer(tmp_path):
    """Rank 1 never joins the all_reduce: rank 0 gives up after MINIPAR_COMM_TIMEOUT and its
    uncaught CommTimeout ends the whole job (the hook Group installs), well before rank 1's
    60 s nap is over."""
    script = tmp_path / "stuck.py"
    script.write_text(textwrap.dedent("""
        import os, time
        import numpy as np
        from mpi4py import MPI
        os.environ["MINIPAR_COMM_TIMEOUT"] = "1"
        from minipar.comm import Group, all_reduce
        g = Group(MPI.COMM_WORLD)
        if g.rank == 0:
            all_reduce(g, np.ones(8))
        else:
            time.sleep(60)
    """))
    proc, seconds = _mpirun(2, [sys.executable, str(script)], timeout=120)
    assert proc.returncode != 0
    assert seconds < 45, f"the job took {seconds:.0f} s to end"
    assert "CommTimeout: rank 0: all_reduce step 1/1 gave up after" in proc.stderr, proc.stderr
    assert "receive from rank 1" in proc.stderr, proc.stderr


def test_a_failing_mpi_test_ends_the_run_with_its_message(tmp_path):
    """tests/mpi/conftest.py: rank 1 fails while rank 0 waits in a barrier; the run ends at
    once, printing rank 1's assertion."""
    shutil.copy(ROOT / "tests" / "mpi" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_fails.py").write_text(textwrap.dedent("""
        from mpi4py import MPI
        def test_rank_one_fails():
            if MPI.COMM_WORLD.Get_rank() == 1:
                assert 6 * 7 == 41, "rank one's own message"
            MPI.COMM_WORLD.Barrier()
    """))
    proc, seconds = _mpirun(2, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                "--with-mpi", str(tmp_path)], timeout=120)
    assert proc.returncode != 0
    assert seconds < 60, f"the run took {seconds:.0f} s to end"
    assert "[rank 1] FAILED" in proc.stderr and "rank one's own message" in proc.stderr, \
        proc.stdout + proc.stderr


def test_environment_switches_trace_and_debug(tmp_path):
    """MINIPAR_TRACE=1 prints each message as `rank 0 -> 1 | all_reduce step 1/1 | 8192 B`;
    MINIPAR_DEBUG=1 turns rank 0's all_reduce against rank 1's all_gather into an error
    naming both calls, and the job ends."""
    script = tmp_path / "switches.py"
    script.write_text(textwrap.dedent("""
        import numpy as np
        from mpi4py import MPI
        from minipar.comm import Group, all_gather, all_reduce
        g = Group(MPI.COMM_WORLD)
        assert g.trace and g.debug
        all_reduce(g, np.ones(1024))
        (all_reduce if g.rank == 0 else all_gather)(g, np.ones(4, np.float32))
    """))
    env_switches = {"MINIPAR_TRACE": "1", "MINIPAR_DEBUG": "1"}
    saved = {k: os.environ.get(k) for k in env_switches}
    os.environ.update(env_switches)
    try:
        proc, seconds = _mpirun(2, [sys.executable, str(script)], timeout=120)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    assert proc.returncode != 0
    assert "rank 0 -> 1 | all_reduce step 1/1 | 8192 B" in proc.stdout, proc.stdout
    assert "rank 1 -> 0 | all_reduce step 1/1 | 8192 B" in proc.stdout, proc.stdout
    assert "CollectiveMismatch" in proc.stderr, proc.stderr
    assert "rank 0 (world 0): call #2: all_reduce(float32, shape=(4,), op=sum)" in proc.stderr
    assert "rank 1 (world 1): call #2: all_gather(dtype=float32" in proc.stderr, proc.stderr
