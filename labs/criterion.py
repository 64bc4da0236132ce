"""One criterion of one lab, run in its own process (what labs/grade.py launches):

    [mpirun -n R] python -m labs.criterion LAB_DIR CRITERION STUDENT.py

Loads the student's file by path and runs the criterion's check on every rank. A failure
prints one line, `FAIL rank r: <what>`, and ends the whole job (exit 1; under mpirun every
rank is aborted, so none is left waiting for the failed one).
"""
from __future__ import annotations

import sys
import traceback


def main(argv=None):
    lab_dir, name, student_path = (argv or sys.argv[1:])[:3]
    from mpi4py import MPI                      # noqa: PLC0415 - after the arguments

    from labs import framework                  # noqa: PLC0415
    from minipar import comm                    # noqa: PLC0415
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    try:
        lab = framework.load_lab(lab_dir)
        check = framework.criterion(lab, name).check
        student = framework.load(student_path, "student")
        check(student)
    except Exception as e:                      # noqa: BLE001 - every failure is the student's verdict
        kind = "" if isinstance(e, AssertionError) else f"{type(e).__name__}: "
        where = traceback.extract_tb(e.__traceback__)[-1]
        at = f" ({where.filename.rsplit('/', 1)[-1]}:{where.lineno})" if not isinstance(e, AssertionError) else ""
        print(f"FAIL rank {rank}: {kind}{e}{at}", flush=True)
        if world.Get_size() > 1:
            comm.abort_world(1)
        sys.exit(1)


if __name__ == "__main__":
    main()
