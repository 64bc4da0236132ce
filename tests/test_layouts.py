"""The 3D matrix: every mechanism composed, through the CLI, against the single-process run.

Each case launches `mpirun -n N python -m minipar.train ... --verify` (4 or 8 ranks, the
tiny model of trainer_runs.py with 2 layers, 3 steps) and requires --verify's OK: losses and
every parameter tensor within 1e-10 relative of the twin in float64 (losses within 5e-2
with fp16/bf16, as --verify judges them). Gradient clipping is on (--grad-clip 1, and the
tiny model's first norms are above 1), so the global norm over tp, pp and dp, with ZeRO's
shards, is exercised by every case. The summary of the float64 runs must also show the
communication the formulas predict: ZeRO's bytes per step at ratio 1.000.

These ten are a sample that keeps `make test` within its budget: one case per mechanism and
composition. scripts/verify_matrix.py runs every dp x tp x pp layout of 4 and 8 ranks with
each ZeRO stage, schedule and precision (and cp, MoE); run it before changing the trainer.
"""
import pytest

from trainer_runs import mpirun, read_log

MATRIX = [
    # (ranks, flags): dp x tp x pp, zero stage, schedule, precision
    (4, "--tp 2 --zero 2 --micro-batches 2"),
    (4, "--tp 2 --zero 3 --untied"),
    (4, "--tp 2 --pp 2 --schedule gpipe --micro-batches 2"),
    (4, "--dp 2 --pp 2 --zero 1 --schedule naive --micro-batches 2 --untied"),
    (4, "--dp 2 --tp 2 --zero 1 --precision fp16"),
    (4, "--dp 2 --pp 2 --zero 2 --precision bf16 --micro-batches 2"),
    (8, "--dp 2 --tp 2 --pp 2 --zero 1"),
    # the schedules past 1F1B: zero-bubble (B and W split) and interleaved (2 chunks per rank)
    (4, "--dp 2 --pp 2 --zero 1 --schedule zb-h1 --micro-batches 4"),
    (4, "--tp 2 --pp 2 --sp --schedule zb-h2 --micro-batches 4"),
    (4, "--dp 2 --pp 2 --zero 2 --n-layer 4 --schedule interleaved --virtual-stages 2 --micro-batches 2"),
]


@pytest.mark.parametrize("n,flags", MATRIX, ids=[f"{n}-{f.replace(' ', '')}" for n, f in MATRIX])
def test_layout_verifies(tmp_path, n, flags):
    log = tmp_path / "run.jsonl"
    mixed = "--precision" in flags
    dtype = [] if mixed else ["--dtype", "float64"]
    p = mpirun(n, "--n-layer", "2", "--steps", "3", "--grad-clip", "1", *dtype, *flags.split(),
               "--verify", "--log", str(log), timeout=180)
    assert p.returncode == 0, f"mpirun -n {n} {flags}\n{p.stdout}\n{p.stderr}"
    verify = [line for line in p.stdout.splitlines() if line.startswith("verify: dp=")]
    assert len(verify) == 1 and verify[0].endswith("-> OK"), p.stdout
    rows, summary = read_log(log)
    assert summary["verify"]["ok"] and summary["verify"]["tolerance"] == (5e-2 if mixed else 1e-10)
    assert max(r["grad_norm"] for r in rows) > 1.0, "clipping never engaged"
    z = summary.get("zero")
    if z is not None and not mixed:
        assert z["bytes_per_step"] == z["theory_bytes_per_step"], z
    layout = summary["layout"]
    assert layout["dp"] * layout["tp"] * layout["pp"] == n
