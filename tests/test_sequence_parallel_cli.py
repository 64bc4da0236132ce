"""--sp from the command line, as a user runs it (mpirun, tiny model): the one-line error
when the sequence does not split, --sp with tp 1, --verify, the replicas' bits with
--recompute full, and checkpoints that move between --sp and plain tensor parallelism.

The mechanism itself (each collective, the ledger, equality with tensor parallelism) is
tested under mpirun in tests/mpi/test_sequence_parallel.py.
"""
import json
import os

import pytest

from test_checkpoint_layouts import F64, assert_resumed_equals_uninterrupted, ok
from test_failing_cleanly import run_driver
from trainer_runs import TINY_MPI, assert_exit_2_one_line, mpirun, read_log, run_tiny

pytestmark = pytest.mark.usefixtures("fixed_peak")
TINY_1 = TINY_MPI[TINY_MPI.index("--n-head"):]            # run_tiny's model and batch as under mpirun

# Each rank notes what prepare (setup.prepare: validation, which sends nothing) raised, and
# how many messages the rank had sent or received by then (the ledger of comm).
NOTE_PREPARE_ERRORS = """
import os
from minipar import comm
from minipar.config import flags as config
real_prepare = train.prepare
def prepare(args, world):
    try:
        return real_prepare(args, world)
    except config.ConfigError as e:
        calls = sum(a["calls"] for a in comm.traffic_by_axis().values())
        with open(os.path.join({notes!r}, f"rank-{{RANK}}"), "w") as f:
            f.write(f"{{calls}} messages before: {{e}}")
        raise
train.prepare = prepare
"""


def test_block_size_not_divisible_by_tp_stops_every_rank_before_any_message(tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    p = run_driver(tmp_path, 2, NOTE_PREPARE_ERRORS.format(notes=str(notes)),
                   "--tp", "2", "--sp", "--block-size", "15")
    message = "--sp splits each sequence over --tp 2: --block-size 15 is not divisible by 2"
    assert_exit_2_one_line(p, message)
    said = {name: (notes / name).read_text() for name in sorted(os.listdir(notes))}
    assert said == {f"rank-{r}": f"0 messages before: {message}" for r in range(2)}, said


def test_sp_with_tp_1_runs_and_says_there_is_nothing_to_split(tmp_path, capsys):
    """One process: --sp is accepted, says so, and changes nothing (float64: the same losses)."""
    logs = [str(tmp_path / f"{x}.jsonl") for x in ("sp", "plain")]
    run_tiny(*TINY_1, "--dtype", "float64", "--sp", "--log", logs[0])
    out = capsys.readouterr().out
    mechanisms = [line for line in out.splitlines() if line.startswith("  mechanisms:")]
    assert mechanisms == ["  mechanisms: sequence parallelism over tp 1 (nothing to split)"], out
    run_tiny(*TINY_1, "--dtype", "float64", "--log", logs[1])
    sp, plain = ([(r["loss"], r["grad_norm"]) for r in read_log(log)[0]] for log in logs)
    assert sp == plain and len(sp) == 4, (sp, plain)


def weights_sha256(p) -> str:
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout.split("weights sha256 ")[1].split(")")[0]


def test_verify_dp2_tp2_sp_zero2_and_full_recompute_gives_the_same_bits():
    """--verify (the one-process twin) passes in float64; then the same layout with
    --recompute full ends with replicas of the same sha256 as without it."""
    layout = ["--dp", "2", "--tp", "2", "--sp", "--zero", "2", "--micro-batches", "2", "--dtype", "float64"]
    p = mpirun(4, *layout, "--verify")
    verify = [line for line in p.stdout.splitlines() if line.startswith("verify: dp=2 tp=2")]
    assert len(verify) == 1 and verify[0].endswith("-> OK"), p.stdout + p.stderr
    assert "tensor parallelism over 2 ranks with sequence parallelism" in p.stdout, p.stdout
    none = weights_sha256(p)
    assert weights_sha256(mpirun(4, *layout, "--recompute", "full")) == none


def test_sp_checkpoint_resumes_with_plain_tp_and_on_one_process(tmp_path):
    """Saved under --tp 2 --sp at step 3, resumed to step 6 under --tp 2 without --sp and on
    one process: both continue as the uninterrupted one-process run (float64, 1e-12)."""
    d = str(tmp_path / "ck")
    ref, tp2, one = (str(tmp_path / f"{x}.jsonl") for x in ("ref", "tp2", "one"))
    ok(mpirun(2, *F64, "--tp", "2", "--sp", "--steps", "3", "--save", d))
    meta = json.load(open(os.path.join(d, "meta.json")))
    assert meta["step"] == 3 and meta["layout"]["tp"] == 2, meta
    ok(mpirun(2, *F64, "--tp", "2", "--steps", "6", "--resume", d, "--log", tp2))
    run_tiny(*TINY_1, *F64, "--steps", "6", "--resume", d, "--log", one)
    run_tiny(*TINY_1, *F64, "--steps", "6", "--log", ref)
    assert_resumed_equals_uninterrupted(tp2, ref, 3, "tp2 sp -> tp2")
    assert_resumed_equals_uninterrupted(one, ref, 3, "tp2 sp -> 1 process")
