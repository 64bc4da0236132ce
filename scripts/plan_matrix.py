"""The planner against the trainer on every layout: tests/test_plan_trainer.py's LAYOUTS (what
`make test` runs) and its MORE, each a trainer run whose bytes per step, memory and peak
activations must equal what `python -m minipar.plan` says for the same flags.

    python scripts/plan_matrix.py            # 56 layouts, about three minutes on 2 cores

Exit code: pytest's (0 when all pass).
"""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    env = dict(os.environ, MINIPAR_PLAN_MATRIX="all", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              os.path.join(ROOT, "tests", "test_plan_trainer.py")], cwd=ROOT, env=env))
