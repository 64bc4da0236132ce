"""Several `python -m minipar.train ... --dry-run` command lines in one job (tests/test_docs.py):
one mpirun per world size instead of one per command, since starting 4 Pythons costs more
than a dry run.

    mpirun -n N python tests/tools/dry_runs.py COMMANDS.json

COMMANDS.json: a list of argument lists (what follows `python -m minipar.train`, --dry-run
included). Each runs as `python -m minipar.train` would (minipar.train.trainer.main), one after the
other on every rank; rank 0 prints one JSON line per command, {"i", "code", "out"}, before
the next starts ("start" lines say which one is running, should a rank end the job).
"""
import contextlib
import io
import json
import sys

from mpi4py import MPI

from minipar.train import trainer as train


def main(path):
    rank = MPI.COMM_WORLD.Get_rank()
    with open(path) as f:
        commands = json.load(f)
    for i, argv in enumerate(commands):
        if rank == 0:
            print(json.dumps({"start": i}), flush=True)
        out, code = io.StringIO(), 0
        with contextlib.redirect_stdout(out):
            try:
                train.main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        if rank == 0:
            print(json.dumps({"i": i, "code": code, "out": out.getvalue()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
