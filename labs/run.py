"""The real trainer with a student's code at the lab's seam, on every rank (the student's own
tool; the grader judges its trainer criteria itself, labs/twin.py):

    .venv/bin/python -m labs.run 02 -n 4 --student ring.py -- --dp 4 --zero 2 --verify

-n N starts the ranks itself (mpirun -n N next to this Python). Each rank installs the
student's functions where minipar's own would run (drive.install; for the collective labs the
dispatcher is forced onto them), runs `python -m minipar.train` with the flags after `--`, and
then rank 0 says on which ranks the student's code ran and how many times: a run that never
reached the student's code judged minipar's own and fails. With more ranks than cores, a
pipeline's measured bubble measures the waiting for a core as much as the schedule: rank 0
then prints the simulated bubble beside it. Exit code: the trainer's (1 when --verify fails),
or 1 when the student's code never ran somewhere.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def parse(argv):
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    mine = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="python -m labs.run", description=__doc__.split("\n\n")[0])
    p.add_argument("lab", help="its number (02) or folder")
    p.add_argument("-n", type=int, metavar="N", help="start N ranks (mpirun -n N) [this process alone]")
    p.add_argument("--student", metavar="PATH", help="the student's file [labs/NN_name/student.py]")
    return p, p.parse_args(mine), flags


def relaunch(args, flags):
    """Start this command again under mpirun -n N (the mpirun beside this Python)."""
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [mpirun, "-n", str(args.n), sys.executable, "-m", "labs.run", args.lab]
    cmd += ["--student", args.student] if args.student else []
    os.execv(mpirun, cmd + ["--", *flags])


def oversubscribed_note(summary: dict, world: int) -> str:
    cores = os.cpu_count() or 1
    pl = summary.get("pipeline") if isinstance(summary, dict) else None
    if world <= cores or not pl:
        return ""
    return (f"note: {world} ranks share {cores} cores, so the measured bubble "
            f"{pl['bubble_measured']:.3f} measures the waiting for a core as much as the schedule; "
            f"simulated (each stage's own op times, a core each) {pl['bubble_simulated']:.3f}, "
            f"theory {pl['bubble_theory']:.3f}")


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p, args, flags = parse(argv)
    if args.n is not None:
        if args.n < 1:
            p.error(f"-n {args.n}: at least 1")
        if "PMI_RANK" not in os.environ and "PMI_SIZE" not in os.environ:
            relaunch(args, flags)

    from mpi4py import MPI                      # noqa: PLC0415

    from labs import child, framework           # noqa: PLC0415
    from minipar import comm                    # noqa: PLC0415
    try:
        lab_dir = args.lab if os.path.isdir(args.lab) else framework.find(args.lab)
    except ValueError as e:
        p.error(str(e))
    path = args.student or os.path.join(lab_dir, "student.py")
    if not os.path.isfile(path):
        p.error(f"--student {path}: no such file")
    drive = framework.load_drive(lab_dir)
    try:
        student = child.load_student(os.path.abspath(path))
    except Exception as e:                      # noqa: BLE001 - one line naming the student's own line
        print(f"labs.run: {child.describe(e, os.path.abspath(path), 'importing ' + os.path.basename(path))}",
              file=sys.stderr, flush=True)
        sys.exit(1)
    all_gather = comm.all_gather                # minipar's own, kept before the seam may replace it
    code, calls, summary = child.run_trainer(drive, student, flags)
    world = comm.Group(MPI.COMM_WORLD)
    mine = np.array([calls()], dtype=np.int64)
    counts = [int(n) for n in (all_gather(world, mine) if world.size > 1 else mine)]
    ran = [r for r, n in enumerate(counts) if n > 0]
    if code == 2 and not ran:                   # the trainer refused its flags: it said why
        sys.exit(code)
    if world.rank == 0:
        if len(ran) == world.size:
            print(f"labs.run: the student's code ({os.path.basename(path)}) ran on every rank "
                  f"{ran}: {sum(counts)} calls, per rank {counts}", flush=True)
        else:
            idle = [r for r in range(world.size) if r not in ran]
            print(f"FAIL rank {idle[0]}: the student's code never ran on rank(s) {idle} "
                  f"(calls per rank {counts}): this run judged minipar's own code", flush=True)
        note = oversubscribed_note(summary, world.size)
        if note:
            print(note, flush=True)
    sys.exit(code if len(ran) == world.size else 1)


if __name__ == "__main__":
    main()
