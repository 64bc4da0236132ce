"""Failing cleanly (docs/design.md §10): an exception on any rank ends the whole job within
seconds, with that rank's traceback and a non-zero exit code; a problem that can be found
before training (a checkpoint that is missing a shard, one that a rank cannot read, a path
rank 0 cannot write) stops every rank with one line and exit code 2; a save that fails on
one rank leaves the last good checkpoint in place.

The mpirun runs carry MINIPAR_COMM_TIMEOUT=60 and a subprocess timeout as a backstop. Each
must end in well under that: the elapsed-time assertions detect hangs (a rank left waiting
in a collective), they are not performance assertions. Faults on one rank only are injected
by a small driver script that patches minipar on that rank, then calls minipar.train.trainer.main.
"""
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from minipar.train import checkpoint, trainer as train

from trainer_runs import MPIRUN, REPO, TINY, TINY_MPI, assert_exit_2_one_line, assert_main_exits_2, mpirun

HANG = 30.0            # seconds: a run that takes longer than this was left waiting

DRIVER = """
import sys
from mpi4py import MPI
from minipar.train import checkpoint, trainer as train
RANK = MPI.COMM_WORLD.Get_rank()
{patch}
train.main(sys.argv[1:])
"""


def timed(fn, *args, **kw):
    t0 = time.monotonic()
    p = fn(*args, **kw)
    return p, time.monotonic() - t0


def run_driver(tmp_path, n, patch, *flags):
    """mpirun -n N python driver.py TINY_MPI flags, where driver.py applies `patch` first."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(patch=patch))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MINIPAR_COMM_TIMEOUT="60")
    return subprocess.run([MPIRUN, "-n", str(n), sys.executable, str(script), *TINY_MPI, *flags],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------- an exception on one rank

RAISE_ON_RANK_1 = """
real_step = train.train_step
def train_step(s, step):
    if RANK == 1 and step == 2:
        raise RuntimeError("injected failure on rank 1 at step 2")
    return real_step(s, step)
train.train_step = train_step
"""


def test_exception_on_one_rank_mid_training_ends_the_job_with_its_traceback(tmp_path):
    """tp2 x pp2: when rank 1 dies at step 2 its tensor-parallel partner waits in an
    all-reduce and the other stage in a receive; the whole job must end at once."""
    p, seconds = timed(run_driver, tmp_path, 4, RAISE_ON_RANK_1, "--tp", "2", "--pp", "2", "--n-layer", "2")
    assert p.returncode != 0, p.stderr
    assert seconds < HANG, f"the job took {seconds:.1f} s to end: ranks were left waiting"
    assert "[rank 1] Traceback (most recent call last):" in p.stderr, p.stderr
    assert "[rank 1] RuntimeError: injected failure on rank 1 at step 2" in p.stderr, p.stderr
    # rank 0 prints step 0 before step 1's collectives, which need rank 1; its step-1 line
    # may or may not get out before the abort (rank 1 starts step 2 as soon as they end)
    assert "step     0" in p.stdout and "step     2" not in p.stdout, p.stdout


# ---------------------------------------------------------------- what only rank 0 writes

@pytest.mark.parametrize("n,flags,what", [
    (4, ["--log"], "run.jsonl"),
    (2, ["--pp", "2", "--n-layer", "2", "--timeline"], "t.svg"),
], ids=["log", "timeline"])
def test_rank0_output_in_a_missing_directory_stops_every_rank_before_training(tmp_path, n, flags, what):
    """Only rank 0 writes --log and --timeline: it opens (checks) them before the ranks
    agree on the configuration, so all exit 2 together instead of the others waiting."""
    path = str(tmp_path / "no" / "such" / what)
    p, seconds = timed(mpirun, n, *flags, path)
    assert_exit_2_one_line(p, path)
    assert seconds < HANG, f"{seconds:.1f} s"


# ---------------------------------------------------------------- checkpoints at resume

@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A checkpoint of 4 ZeRO-2 shards at step 2."""
    d = str(tmp_path_factory.mktemp("sharded") / "ck")
    p = mpirun(4, "--zero", "2", "--steps", "2", "--save", d)
    assert p.returncode == 0, p.stderr
    return d


def test_missing_shard_stops_every_rank_with_one_line(tmp_path, sharded):
    d = str(tmp_path / "ck")
    shutil.copytree(sharded, d)
    victim = os.path.join(d, checkpoint.shard_name(3))
    os.remove(victim)
    p, seconds = timed(mpirun, 2, "--tp", "2", "--resume", d)
    assert_exit_2_one_line(p, f"checkpoint file {victim} is missing")
    assert seconds < HANG, f"{seconds:.1f} s"


UNREADABLE_ON_RANK_2 = """
import builtins
real_open = builtins.open
def open_(path, *a, **k):
    if RANK == 2 and str(path).endswith("rank-00001.npz"):
        raise PermissionError(13, "Permission denied", str(path))
    return real_open(path, *a, **k)
builtins.open = open_
"""


def test_shard_that_one_rank_cannot_read_stops_every_rank_with_its_message(tmp_path, sharded):
    """Every rank reads every shard before any message; rank 2 alone fails (as on a node
    that does not see the file): all 4 exit 2, and the line is rank 2's."""
    p, seconds = timed(run_driver, tmp_path, 4, UNREADABLE_ON_RANK_2, "--tp", "2", "--steps", "4", "--resume", sharded)
    path = os.path.join(sharded, checkpoint.shard_name(1))
    assert_exit_2_one_line(p, f"checkpoint file {path} cannot be read: Permission denied")
    assert seconds < HANG, f"{seconds:.1f} s"


# ---------------------------------------------------------------- a save that fails on one rank

FAIL_SECOND_SAVE_ON_RANK_2 = """
real_write = checkpoint._write_npz
shards = []
def write(path, arrays):
    if RANK == 2 and path.endswith("rank-00002.npz"):
        shards.append(path)
        if len(shards) == 2:
            raise OSError(28, "No space left on device (simulated on rank 2)")
    real_write(path, arrays)
checkpoint._write_npz = write
"""


def test_save_failing_on_one_rank_ends_the_job_and_keeps_the_last_good_checkpoint(tmp_path):
    """--save-every 2: the save at step 2 succeeds, the one at step 4 fails on rank 2 while
    the other ranks have written their shards. All ranks learn it before rank 0 commits:
    DIR still holds step 2, and the job ends with rank 2's one line (a full disk is no bug:
    no traceback) and exit code 5."""
    d = str(tmp_path / "ck")
    p, seconds = timed(run_driver, tmp_path, 4, FAIL_SECOND_SAVE_ON_RANK_2, "--zero", "1", "--steps", "6",
                       "--save-every", "2", "--save", d)
    assert p.returncode == 5 and seconds < HANG, (p.returncode, seconds, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    assert f"[rank 2] checkpoint {d} not written: this rank failed to write its files into {d}.tmp: " \
           f"No space left on device (simulated on rank 2) (ENOSPC)" in p.stderr, p.stderr
    assert "keeps the last good checkpoint" in p.stderr
    _, ostate, meta = checkpoint.load(d)
    assert meta["step"] == 2 and ostate["step"] == 2, (meta["step"], ostate["step"])
    assert "step     4" not in p.stdout, p.stdout           # nobody trained on after the failed save


# ---------------------------------------------------------------- one process: each message

@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """A one-process float32 checkpoint at step 4 (TINY)."""
    d = str(tmp_path_factory.mktemp("single") / "D")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "matmul_peak_flops", lambda dtype, seconds=0.1: 1e11)
        train.run(train.build_parser().parse_args(TINY + ["--save", d]))
    return d


def rewrite_shard(path, change):
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    change(arrays)
    np.savez(path, **arrays)


def bad_checkpoint_case(case, d, tmp_path):
    """Break checkpoint copy d: -> (extra flags, substrings of the one error line)."""
    shard = os.path.join(d, checkpoint.shard_name(0))
    if case == "missing-shard":
        os.remove(shard)
        return [], [shard, "missing"]
    if case == "truncated-shard":
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
        return [], [shard, "corrupt"]
    if case == "garbage-shard":
        with open(shard, "w") as f:
            f.write("garbage")
        return [], [shard, "corrupt"]
    if case == "sizes-disagree":
        rewrite_shard(shard, lambda a: a.update(v=a["v"][:-1]))
        return [], [shard, "index has 7,664 elements, m 7,664, v 7,663; meta.json lists 7,664"]
    if case == "incomplete":
        rewrite_shard(shard, lambda a: a["index"].__setitem__(7663, -1))     # ln_f.bias[15]
        return [], [d, "incomplete", "cover 7,663 of 7,664 elements", "ln_f.bias[15]"]
    if case == "model-of-another-shape":
        with np.load(os.path.join(d, "model.npz")) as z:
            arrays = {k: z[k] for k in z.files}
        arrays["wpe.weight"] = arrays["wpe.weight"][:8]
        np.savez(os.path.join(d, "model.npz"), **arrays)
        return [], [os.path.join(d, "model.npz"), "wpe.weight has shape (8, 16), the model's is (16, 16)"]
    if case == "model-of-another-dtype":
        with np.load(os.path.join(d, "model.npz")) as z:
            arrays = {k: z[k].astype(np.float64) for k in z.files}
        np.savez(os.path.join(d, "model.npz"), **arrays)
        return [], [os.path.join(d, "model.npz"), "float64 arrays", "says float32"]
    if case == "flags-of-another-model":
        return ["--n-head", "4"], ["--n-head 4 does not match the checkpoint", "n_head = 2"]
    if case == "save-in-missing-dir":
        path = str(tmp_path / "no" / "ck")
        return ["--save", path], [f"--save {path}: directory {tmp_path / 'no'} does not exist"]
    if case == "save-onto-a-file":
        path = tmp_path / "file"
        path.write_text("x")
        return ["--save", str(path)], [f"--save {path} exists and is not a directory"]
    raise AssertionError(case)


CASES = ["missing-shard", "truncated-shard", "garbage-shard", "sizes-disagree", "incomplete",
         "model-of-another-shape", "model-of-another-dtype", "flags-of-another-model",
         "save-in-missing-dir", "save-onto-a-file"]


@pytest.mark.parametrize("case", CASES)
def test_bad_checkpoint_one_line_exit_2(tmp_path, single, capsys, case):
    d = str(tmp_path / "D")
    shutil.copytree(single, d)
    flags, needles = bad_checkpoint_case(case, d, tmp_path)
    assert_main_exits_2(TINY + ["--steps", "6", "--resume", d, *flags], needles, capsys, case)


def test_the_checkpoint_left_by_a_failed_save_resumes(tmp_path, single):
    """After a failed save (DIR.tmp left behind, half written) DIR resumes and the next save
    replaces the stale DIR.tmp."""
    d = str(tmp_path / "D")
    shutil.copytree(single, d)
    os.makedirs(os.path.join(d + ".tmp", "optim"))
    open(os.path.join(d + ".tmp", "MINIPAR-CHECKPOINT"), "w").close()    # a save writes it first
    with open(os.path.join(d + ".tmp", checkpoint.shard_name(3)), "w") as f:
        f.write("half a shard")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "matmul_peak_flops", lambda dtype, seconds=0.1: 1e11)
        train.run(train.build_parser().parse_args(TINY + ["--steps", "6", "--resume", d, "--save", d]))
    assert json.load(open(os.path.join(d, "meta.json")))["step"] == 6
    assert not os.path.exists(d + ".tmp") and os.listdir(os.path.join(d, "optim")) == ["rank-00000.npz"]


LATE_CONFIG_ERROR_ON_RANK_1 = """
from minipar.config.flags import ConfigError
real_init = train.init_model
def init_model(*a, **k):
    if RANK == 1:
        raise ConfigError("simulated error on rank 1 after the ranks agreed")
    return real_init(*a, **k)
train.init_model = init_model
"""


def test_config_error_on_one_rank_after_the_agreement_ends_the_job(tmp_path):
    """A ConfigError that only some ranks meet after every rank agreed on the configuration
    (none is known today: the guard for the next one): its line, exit code 2, and the others
    are not left waiting for the rank that stopped."""
    p, seconds = timed(run_driver, tmp_path, 4, LATE_CONFIG_ERROR_ON_RANK_1, "--tp", "2")
    assert p.returncode == 2 and seconds < HANG, (p.returncode, seconds, p.stderr)
    assert "minipar.train: error: simulated error on rank 1 after the ranks agreed" in p.stderr, p.stderr
