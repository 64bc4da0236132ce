"""The all-to-all on 5 ranks (p = 5: a non-power of two for Bruck, and an odd pairwise ring),
which the 4-rank MPI suite cannot reach: `mpirun -n 5` on tests/mpi/test_alltoall.py, whose
__main__ runs its checks (every algorithm, dtype, shape, variable sizes, the ledger, the rounds,
bad input) on that world."""
import os
import subprocess
import sys

from trainer_runs import MPIRUN, REPO


def test_all_to_all_on_five_ranks():
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIPAR_COMM_TIMEOUT="60")
    p = subprocess.run([MPIRUN, "-n", "5", sys.executable, os.path.join("tests", "mpi", "test_alltoall.py")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 0 and "all_to_all p=5: ok" in p.stdout, p.stdout + p.stderr
