"""--cp-impl from the command line (mpirun, tiny model): Ulysses and the all-gather of K and V
beside the ring. The one-line errors before any message (--cp-impl without --cp; Ulysses on
heads that the cp ranks cannot share), --verify against the one-process twin in float64 with
the summary's bytes equal to the formula, and planted mistakes that --verify must catch. The
attention itself: tests/mpi/test_cp_impls.py; the matrix (dp, ZeRO, tp, pp, recomputation,
fp16/bf16, Llama's GQA): scripts/verify_matrix.py --match=--cp-impl."""
import pytest

from test_failing_cleanly import run_driver
from test_sequence_parallel_cli import NOTE_PREPARE_ERRORS
from trainer_runs import assert_exit_2_one_line, mpirun, read_log

pytestmark = pytest.mark.usefixtures("fixed_peak")
GQA = ["--arch", "llama", "--n-head", "4", "--n-kv-head", "2", "--ffn-hidden", "24"]


@pytest.mark.parametrize("flags, message", [
    (["--cp-impl", "ulysses"], "--cp-impl ulysses is how a cp group attends: it needs --cp > 1"),
    (["--cp", "2", "--cp-impl", "ulysses", "--n-head", "3", "--n-embd", "24"],
     "--cp-impl ulysses gives each of the cp 2 ranks whole query heads: 3 heads (after tp) are not "
     "divisible by 2 (--n-head 3, 3 key/value heads, --tp 1)"),
    (["--cp", "2", "--cp-impl", "ulysses", "--arch", "llama", "--n-head", "6", "--n-kv-head", "3", "--n-embd", "24"],
     "--cp-impl ulysses gives each of the cp 2 ranks whole key/value heads: 3 (after tp) neither divides "
     "nor is divided by 2 (--n-head 6, 3 key/value heads, --tp 1)"),
    (["--cp", "2", "--cp-impl", "hybrid", "--cp-ulysses", "3"], "--cp-ulysses 3 must divide --cp 2"),
    (["--cp", "2", "--cp-ulysses", "2"], "--cp-ulysses 2 is the Ulysses degree of --cp-impl hybrid, not of "
                                         "--cp-impl ring"),
])
def test_bad_cp_impl_flags_stop_every_rank_before_any_message(tmp_path, flags, message):
    notes = tmp_path / "notes"
    notes.mkdir()
    p = run_driver(tmp_path, 2, NOTE_PREPARE_ERRORS.format(notes=str(notes)), *flags)
    assert_exit_2_one_line(p, message)
    said = sorted(notes.iterdir())
    assert [f.name for f in said] == ["rank-0", "rank-1"] and all(
        f.read_text().startswith("0 messages before: ") for f in said)


# cp 4 and the grouped-query heads for each impl; with dp, ZeRO and the contiguous layout for hybrid
# (Ulysses and the all-gather with dp and every ZeRO stage: scripts/verify_matrix.py)
CP_LAYOUTS = [(impl, layout) for impl in ("ulysses", "allgather", "hybrid") for layout in (
    ["--cp", "4", "--n-head", "4"],
    GQA + ["--cp", "4"],                                  # Ulysses: each KV head on 2 of the 4 ranks
)] + [("hybrid", ["--cp", "2", "--dp", "2", "--zero", "1", "--cp-layout", "contiguous", "--micro-batches", "2"])]


@pytest.mark.parametrize("impl,layout", CP_LAYOUTS, ids=[f"{i}-{' '.join(f)}" for i, f in CP_LAYOUTS])
def test_verify_passes_and_the_bytes_are_the_formula(tmp_path, impl, layout):
    log = str(tmp_path / "log.jsonl")
    degree = ["--cp-ulysses", "2"] if impl == "hybrid" and "4" in layout else []   # cp 4: Ulysses 2 x ring 2
    p = mpirun(4, *layout, "--cp-impl", impl, *degree, "--dtype", "float64", "--verify", "--log", log)
    verify = [line for line in p.stdout.splitlines() if line.startswith("verify: dp=")]
    assert p.returncode == 0 and len(verify) == 1 and verify[0].endswith("-> OK"), p.stdout + p.stderr
    rows, summary = read_log(log)
    cp = summary["context_parallel"]
    assert cp["impl"] == impl and cp["bytes_per_step"] == cp["theory_bytes_per_step"] > 0, cp
    assert all(r["bytes_by_axis"]["cp"] == cp["theory_bytes_per_step"] for r in rows), rows
    assert f"context parallel: cp={layout[layout.index('--cp') + 1]} {impl}" in p.stdout


@pytest.mark.parametrize("impl,model", [("ring", []), ("ulysses", []), ("allgather", GQA)],
                         ids=["ring-gpt2", "ulysses-gpt2", "allgather-llama-gqa"])
def test_sp_splits_each_cp_ranks_tokens_and_verifies(tmp_path, impl, model):
    """--tp 2 --sp --cp 2: the tp ranks split each cp rank's T/2 tokens (GPT-2's learned
    positions: the rows of the cp rank's global positions, PositionsOfShard); equal to the
    twin, the cp bytes the formula's and sp's collectives sp_count's on T/cp tokens."""
    log = str(tmp_path / "log.jsonl")
    p = mpirun(4, "--tp", "2", "--sp", "--cp", "2", "--n-head", "4", *model, "--cp-impl", impl,
               "--dtype", "float64", "--verify", "--log", log)
    verify = [line for line in p.stdout.splitlines() if line.startswith("verify: dp=")]
    assert p.returncode == 0 and len(verify) == 1 and verify[0].endswith("-> OK"), p.stdout + p.stderr
    _, summary = read_log(log)
    cp = summary["context_parallel"]
    assert cp["bytes_per_step"] == cp["theory_bytes_per_step"] > 0, cp
    assert "= sp_count x 1 micro-batch(es)" in p.stdout, p.stdout


def test_sp_with_cp_catches_positions_taken_as_if_the_rank_held_the_first_tokens(tmp_path):
    """Planted: each tp rank takes wpe rows [r t/tp, (r+1) t/tp), as without cp, instead of
    its share of the cp rank's global positions; --verify fails."""
    patch = """
from minipar.parallel.tensor import sequence_parallel
forward = sequence_parallel.PositionsOfShard.forward
def first_tokens(self, wpe, pos, group):
    return forward(self, wpe, list(range(len(pos))), group)
sequence_parallel.PositionsOfShard.forward = first_tokens
"""
    p = run_driver(tmp_path, 4, patch, "--tp", "2", "--sp", "--cp", "2", "--n-head", "4", "--dtype", "float64",
                   "--steps", "2", "--verify")
    verify = [line for line in p.stdout.splitlines() if line.startswith("verify: dp=1 cp=2 tp=2")]
    assert p.returncode == 1 and len(verify) == 1 and verify[0].endswith("-> FAILED"), p.stdout + p.stderr


# Mistakes each implementation could make; --verify must catch every one.
PLANTED = {
    # Ulysses: every rank attends with key/value head 0, whatever its query heads read
    "ulysses heads": (["--cp-impl", "ulysses"] + GQA, """
import numpy as np
from minipar.parallel.context import ulysses
ulysses.kv_heads_of = lambda j, Hkv, C: np.array([0])
"""),
    # Ulysses: the gathered tokens taken in rank order, as if that were the sequence's order
    "ulysses order": (["--cp-impl", "ulysses"], """
import numpy as np
from minipar.parallel.context import ulysses
def positions(self, got):
    B, n, k, hs = got.shape
    return got.reshape(B, n, k * hs)
ulysses.UlyssesAttention._positions = positions
"""),
    # all-gather: the gathered keys masked as if rank order were position order
    "allgather mask": (["--cp-impl", "allgather"], """
import numpy as np
from minipar.parallel.context import allgather_attention
allgather_attention._order = lambda C, T, layout: np.arange(T)
"""),
}


@pytest.mark.parametrize("mistake", list(PLANTED))
def test_verify_fails_on_a_planted_mistake(tmp_path, mistake):
    flags, patch = PLANTED[mistake]
    p = run_driver(tmp_path, 2, patch, "--cp", "2", *flags, "--dtype", "float64", "--steps", "2", "--verify")
    verify = [line for line in p.stdout.splitlines() if line.startswith("verify: dp=1 cp=2")]
    assert p.returncode == 1 and len(verify) == 1 and verify[0].endswith("-> FAILED"), p.stdout + p.stderr


def test_hybrid_from_the_hosts_checks_the_heads_once_it_knows_them():
    """Without --cp-ulysses, hybrid's degree comes from the hosts (one host: Ulysses over all 4
    cp ranks), known only once the groups are made: 2 heads on 4 ranks then stops every rank
    with the same line and exit code 2, not a traceback."""
    p = mpirun(4, "--cp", "4", "--cp-impl", "hybrid")
    assert p.returncode == 2, p.stdout + p.stderr
    line = ("minipar.train: error: --cp-impl ulysses gives each of the cp 4 ranks whole query heads: 2 heads "
            "(after tp) are not divisible by 4 (--n-head 2, 2 key/value heads, --tp 1, Ulysses over the cp "
            "ranks of a host)")
    assert line in p.stderr and "Traceback" not in p.stderr, p.stderr
