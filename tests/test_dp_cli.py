"""The trainer under mpirun, as a user runs it: --verify, layout errors, exit codes.

Each test launches `mpirun -n N python -m minipar.train` with a timeout, one BLAS thread
per rank, on a tiny model.
"""
import json
import re

import numpy as np
import pytest

from minipar.train import trainer as train, verify

from trainer_runs import TINY_MPI as TINY, assert_exit_2_one_line, mpirun


@pytest.mark.parametrize("mode", ["bucketed", "naive"])
def test_verify_dp2_float64_passes(mode):
    p = mpirun(2, "--dtype", "float64", "--verify", "--dp-mode", mode, "--micro-batches", "2")
    assert p.returncode == 0, p.stdout + p.stderr
    verify = [line for line in p.stdout.splitlines() if line.startswith("verify: dp=2")]
    assert len(verify) == 1 and verify[0].endswith("-> OK"), p.stdout
    assert "replicas identical across 2 dp ranks" in p.stdout, p.stdout
    assert "(ratio 1.000)" in p.stdout or mode == "naive", p.stdout   # naive: small per-parameter all-reduces


@pytest.mark.parametrize("n,flags,message", [
    (3, ["--dp", "2"], "world size 3 != dp*tp*pp = 2*1*1 = 2"),
    (2, ["--batch-size", "6", "--micro-batches", "2"], "--batch-size 6 is not divisible by dp*micro-batches = 2*2 = 4"),
    (2, ["--pp", "2"], "--pp 2 is more than --n-layer 1: every pipeline stage needs at least one layer"),
    (4, ["--tp", "4"], "--n-head 2 is not divisible by --tp 4"),
    (2, ["--data", "/nonexistent/corpus.txt"], "data file '/nonexistent/corpus.txt' not found"),
])
def test_bad_layout_exits_2_on_every_rank_with_one_line(n, flags, message):
    assert_exit_2_one_line(mpirun(n, *flags), message)


def test_verify_fails_with_exit_1_beyond_tolerance(monkeypatch, capsys):
    """A twin that disagrees by 1e-9 relative in float64 fails --verify (tolerance 1e-10)."""
    real = verify.run_twin

    def off_twin(*a, **k):
        losses, norms, state = real(*a, **k)
        return [x * (1 + 1e-9) for x in losses], norms, state

    monkeypatch.setattr(verify, "run_twin", off_twin)
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--dtype", "float64", "--verify"])
    assert e.value.code == 1
    assert "-> FAILED" in capsys.readouterr().out


def test_verify_judges_the_gradient_norms(monkeypatch, capsys):
    """The same with the twin's gradient norms off by 1e-9 relative, losses exact: the norm
    (what clipping uses, over every rank's gradients) is judged in float64 too."""
    real = verify.run_twin

    def off_twin(*a, **k):
        losses, norms, state = real(*a, **k)
        return losses, [x * (1 + 1e-9) for x in norms], state

    monkeypatch.setattr(verify, "run_twin", off_twin)
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--dtype", "float64", "--verify"])
    assert e.value.code == 1
    out = capsys.readouterr().out
    assert "-> FAILED" in out and "grad norm rel 1.000e-09" in out, out


def test_verify_single_process_passes_exactly(capsys):
    s = train.run(train.build_parser().parse_args(TINY + ["--dtype", "float64", "--verify"]))
    assert s["verify"]["ok"] and s["verify"]["loss_abs"] == 0.0 and s["verify"]["param_abs"] == 0.0, s["verify"]
    assert np.isfinite(s["final_loss"])


@pytest.mark.parametrize("n,flags", [
    (4, ["--dp", "2", "--tp", "2", "--untied", "--micro-batches", "2"]),
    (3, ["--tp", "3", "--n-head", "3", "--n-embd", "24"]),          # V = 256 padded to 258
    (4, ["--tp", "4", "--n-head", "4"]),
])
def test_verify_tensor_parallel_float64_passes(n, flags):
    p = mpirun(n, "--dtype", "float64", "--verify", *flags)
    assert p.returncode == 0, p.stdout + p.stderr
    verify = [line for line in p.stdout.splitlines() if line.startswith("verify: ")]
    assert verify and verify[-1].endswith("-> OK"), p.stdout
    tp_line = [line for line in p.stdout.splitlines() if line.strip().startswith("tensor parallel: ") and "all-reduces/step" in line]
    assert len(tp_line) == 1, p.stdout
    # the ledger's count equals Megatron's: "N all-reduces/step of E elements (Megatron: ... = N, E elements)"
    m = re.search(r"(\d+) all-reduces/step of ([\d,]+) elements \(Megatron: .* = (\d+), ([\d,]+) elements\)", tp_line[0])
    assert m and m.group(1) == m.group(3) and m.group(2) == m.group(4), tp_line[0]


def test_checkpoint_reshards_from_dp2_tp2_to_tp4(tmp_path):
    """Save on dp2 x tp2, resume on tp4: the resumed steps equal an uninterrupted tp4 run."""
    d, a, b = str(tmp_path / "ck"), str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    base = ["--dtype", "float64", "--n-head", "4", "--lr-schedule", "constant", "--warmup", "0"]
    p = mpirun(4, *base, "--dp", "2", "--tp", "2", "--steps", "3", "--save", d)
    assert p.returncode == 0, p.stderr
    p = mpirun(4, *base, "--tp", "4", "--steps", "6", "--resume", d, "--log", b)
    assert p.returncode == 0, p.stderr
    p = mpirun(4, *base, "--tp", "4", "--steps", "6", "--log", a)
    assert p.returncode == 0, p.stderr
    la = [json.loads(x)["loss"] for x in open(a) if '"summary"' not in x][3:]
    lb = [json.loads(x)["loss"] for x in open(b) if '"summary"' not in x]
    np.testing.assert_allclose(lb, la, rtol=1e-12, err_msg="resumed on tp4 from a dp2 x tp2 checkpoint")
