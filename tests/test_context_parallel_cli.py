"""--cp from the command line, as a user runs it (mpirun, tiny model): the one-line errors
before any message, --verify against the one-process twin in float64 (cp 4 zig-zag, and
cp 2 contiguous composed with dp and ZeRO), and the summary's ring bytes equal to the
formula. Checkpoints across cp: tests/test_checkpoint_layouts.py. The ring itself:
tests/mpi/test_ring_attention.py; the full matrix (cp x tp, cp x pp, fp16/bf16, ...):
scripts/verify_matrix.py.
"""
import json
import os

import pytest

from test_failing_cleanly import run_driver
from test_sequence_parallel_cli import NOTE_PREPARE_ERRORS
from trainer_runs import assert_exit_2_one_line, mpirun, read_log

pytestmark = pytest.mark.usefixtures("fixed_peak")


@pytest.mark.parametrize("flags, message", [
    (["--cp", "2", "--block-size", "18"],
     "--cp 2 cuts each sequence into 2 x cp = 4 chunks: --block-size 18 is not divisible by 4"),
    (["--cp-layout", "contiguous"], "--cp-layout contiguous places the tokens of a cp group: it needs --cp > 1"),
    (["--cp", "3"], "world size 2 is not divisible by cp*tp*pp = 3*1*1 = 3"),
])
def test_bad_cp_flags_stop_every_rank_before_any_message(tmp_path, flags, message):
    notes = tmp_path / "notes"
    notes.mkdir()
    p = run_driver(tmp_path, 2, NOTE_PREPARE_ERRORS.format(notes=str(notes)), *flags)
    assert_exit_2_one_line(p, message)
    said = {name: (notes / name).read_text() for name in sorted(os.listdir(notes))}
    assert list(said) == ["rank-0", "rank-1"] and all(
        v.startswith("0 messages before: ") and message in v for v in said.values()), said


@pytest.mark.parametrize("layout", [
    ["--cp", "4"],
    ["--cp", "2", "--dp", "2", "--zero", "1", "--cp-layout", "contiguous", "--micro-batches", "2"],
])
def test_verify_passes_and_the_ring_sends_the_formula(tmp_path, layout):
    """float64 --verify (1e-10 relative, in practice ~1e-15) at the longest sequence, the
    block size; the ring's bytes on the cp axis per step == context_parallel.step_traffic."""
    log = str(tmp_path / "log.jsonl")
    p = mpirun(4, *layout, "--dtype", "float64", "--verify", "--log", log)
    verify = [line for line in p.stdout.splitlines() if line.startswith("verify: dp=")]
    assert p.returncode == 0 and len(verify) == 1 and verify[0].endswith("-> OK"), p.stdout + p.stderr
    rows, summary = read_log(log)
    cp = summary["context_parallel"]
    assert cp["bytes_per_step"] == cp["theory_bytes_per_step"] > 0, cp
    assert all(r["bytes_by_axis"]["cp"] == cp["theory_bytes_per_step"] for r in rows), rows
    C = int(layout[1])
    blocks = cp["sub_blocks_per_rank"]
    assert blocks == ([2 * C + 1] * C if "contiguous" not in layout else [4 * r + 3 for r in range(C)])
    assert summary["layout"]["cp"] == C
    assert f"context parallelism over {C} ranks" in p.stdout
    json.dumps(summary)


# Two mistakes a context-parallel implementation can make; --verify must catch each.
PLANTED = {
    # every rank embeds its tokens at positions 0..T/C-1, as if its share were a whole sequence
    "positions": """
import numpy as np
from minipar.model import contract as interfaces
interfaces.Model.position_ids = lambda self, t: np.arange(t)
""",
    # gradients (and the loss) summed over dp only, not over dp x cp
    "gradient sum": """
from minipar.parallel import grid
real_init = grid.ProcessGrid.__init__
def init(self, *a, **k):
    real_init(self, *a, **k)
    self.grad_group = self.dp_group
grid.ProcessGrid.__init__ = init
""",
}


@pytest.mark.parametrize("mistake", list(PLANTED))
def test_verify_fails_on_a_planted_cp_mistake(tmp_path, mistake):
    p = run_driver(tmp_path, 2, PLANTED[mistake], "--cp", "2", "--dtype", "float64", "--steps", "2", "--verify")
    verify = [line for line in p.stdout.splitlines() if line.startswith("verify: dp=1 cp=2")]
    assert p.returncode == 1 and len(verify) == 1 and verify[0].endswith("-> FAILED"), p.stdout + p.stderr
