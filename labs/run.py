"""The real trainer with a student's code at the lab's seam, on every rank:

    mpirun -n 4 python -m labs.run 02 [--student PATH] -- --dp 4 --zero 2 --verify

installs the student's functions where minipar's own would run (lab.py's install; for the
collective labs the dispatcher is forced onto them), runs `python -m minipar.train` with
the flags after `--`, then checks that the student's code ran on every rank: a lab never
passes by judging minipar's own code by mistake. Exit code: the trainer's (1 when --verify
fails), or 1 when the student's code never ran somewhere.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    mine = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m labs.run", description=__doc__.split("\n\n")[0])
    p.add_argument("lab", help="its number (02) or folder")
    p.add_argument("--student", metavar="PATH", help="the student's file [labs/NN_name/student.py]")
    args = p.parse_args(mine)

    from mpi4py import MPI                      # noqa: PLC0415

    from labs import framework                  # noqa: PLC0415
    from minipar import comm, train             # noqa: PLC0415
    lab_dir = args.lab if os.path.isdir(args.lab) else framework.find(args.lab)
    lab = framework.load_lab(lab_dir)
    student = framework.load(args.student or os.path.join(lab_dir, "student.py"), "student")
    all_gather = comm.all_gather                # minipar's own, kept before the seam may replace it
    calls = lab.install(student)
    code = 0
    try:
        train.main(flags)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    world = comm.Group(MPI.COMM_WORLD)
    counts = all_gather(world, np.array([calls()], dtype=np.int64)) if world.size > 1 else [calls()]
    idle = [r for r, n in enumerate(counts) if n == 0]
    if idle:
        if world.rank == 0:
            print(f"FAIL rank {idle[0]}: the student's code never ran on rank(s) {idle} "
                  f"(calls per rank {list(map(int, counts))}): this run judged minipar's own code", flush=True)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
