"""Mixture of experts and expert parallelism from the command line (mpirun, tiny model):
--verify in float64 against the one-process twin (which runs every expert itself), with and
without dropping; the all-to-all bytes of every step equal to expert_parallel.ep_bytes; the
trap (expert gradients summed over the whole dp group) caught by --verify; checkpoints that
move between expert layouts; the one-line errors. The layer itself: tests/test_moe.py; the
full matrix: scripts/verify_matrix.py --match=--moe-experts.
"""
import json
import os

import pytest

from test_checkpoint_layouts import F64, assert_resumed_equals_uninterrupted, ok
from test_failing_cleanly import run_driver
from test_sequence_parallel_cli import NOTE_PREPARE_ERRORS
from trainer_runs import TINY_MPI, assert_exit_2_one_line, mpirun, read_log, run_tiny

pytestmark = pytest.mark.usefixtures("fixed_peak")
MOE = ["--moe-experts", "4", "--moe-top-k", "2", "--dtype", "float64", "--n-layer", "2"]


@pytest.mark.parametrize("layout", [
    ["--dp", "4", "--ep", "2", "--zero", "1"],
    ["--dp", "2", "--ep", "2", "--pp", "2", "--micro-batches", "2", "--moe-capacity-factor", "1.0"],
])
def test_verify_and_the_all_to_all_bytes(tmp_path, layout):
    log = str(tmp_path / "log.jsonl")
    p = mpirun(4, *MOE, *layout, "--verify", "--log", log)
    verify = [line for line in p.stdout.splitlines() if line.startswith("verify: dp=")]
    assert p.returncode == 0 and len(verify) == 1 and verify[0].endswith("-> OK"), p.stdout + p.stderr
    rows, summary = read_log(log)
    assert all(r["bytes_by_axis"]["ep"] == r["ep_theory_bytes"] > 0 for r in rows), rows
    ep = summary["expert_parallel"]
    assert ep["ep"] == 2 and ep["experts_per_rank"] == 2
    dropped = [b["dropped_fraction"] for b in summary["moe"].values()]
    assert all(d > 0 for d in dropped) if "--moe-capacity-factor" in layout else all(d == 0 for d in dropped)


# the classic mistake: every gradient, the experts' too, summed over the whole dp group
SUM_EXPERTS_OVER_DP = """
from minipar.parallel.expert import expert_parallel
from minipar.parallel import grid
real_init = grid.ProcessGrid.__init__
def init(self, *a, **k):
    real_init(self, *a, **k)
    self.expert_group = self.dp_group
grid.ProcessGrid.__init__ = init
"""


def test_the_run_fails_when_expert_gradients_are_summed_over_all_of_dp(tmp_path):
    """Each expert's weights then take in other experts' gradients: the replicas of an expert
    still agree, but the weights differ from the twin's, and ranks 0 and 2 (both ep rank 0)
    ... the replica check after training stops the job, naming the ranks."""
    p = run_driver(tmp_path, 4, SUM_EXPERTS_OVER_DP, *MOE, "--dp", "4", "--ep", "2", "--steps", "2", "--verify")
    assert p.returncode != 0 and "data-parallel replicas diverged" in p.stderr, p.stdout + p.stderr


def test_checkpoint_moves_between_expert_layouts(tmp_path):
    """Saved on dp 4 x ep 4 (one expert per rank) at step 3 -> resumed on dp 4 x ep 2 and on one
    process (every expert local): both continue as the uninterrupted run there. (Without the
    load-balancing loss: its routing groups, a dp rank's micro-batch, change with dp.)"""
    d = str(tmp_path / "ck")
    MOE0 = MOE + ["--moe-aux-coef", "0"]
    ok(mpirun(4, *F64, *MOE0, "--ep", "4", "--steps", "3", "--save", d))
    meta = json.load(open(os.path.join(d, "meta.json")))
    assert meta["config"]["moe_experts"] == 4 and len(meta["optimizer"]["shards"]) == 4, meta
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    ok(mpirun(4, *F64, *MOE0, "--ep", "2", "--steps", "6", "--resume", d, "--log", b))
    ok(mpirun(4, *F64, *MOE0, "--ep", "2", "--steps", "6", "--log", a))
    assert_resumed_equals_uninterrupted(b, a, 3, "dp4 ep4 -> dp4 ep2")
    tiny = TINY_MPI[TINY_MPI.index("--n-head"):]
    a, b = str(tmp_path / "a1.jsonl"), str(tmp_path / "b1.jsonl")
    run_tiny(*tiny, *F64, *MOE0, "--steps", "6", "--resume", d, "--log", b)
    run_tiny(*tiny, *F64, *MOE0, "--steps", "6", "--log", a)
    assert_resumed_equals_uninterrupted(b, a, 3, "dp4 ep4 -> 1 process")


@pytest.mark.parametrize("flags, message", [
    (["--moe-experts", "4", "--ep", "3"], "--ep 3 must divide both dp = 2"),
    (["--moe-experts", "3", "--ep", "2"], "--ep 2 must divide both dp = 2"),
    (["--ep", "2"], "--ep 2 splits the experts of a mixture of experts: it needs --moe-experts > 0"),
    (["--moe-experts", "4", "--moe-top-k", "5"], "--moe-top-k 5 must be between 1 and --moe-experts 4"),
    (["--moe-top-k", "1"], "--moe-top-k is for a mixture of experts: it needs --moe-experts > 0"),
    (["--moe-experts", "4", "--tp", "2", "--sp"], "--moe-experts does not combine with --sp yet"),
])
def test_bad_moe_flags_stop_every_rank_before_any_message(tmp_path, flags, message):
    notes = tmp_path / "notes"
    notes.mkdir()
    p = run_driver(tmp_path, 2, NOTE_PREPARE_ERRORS.format(notes=str(notes)), *flags)
    assert_exit_2_one_line(p, message)
