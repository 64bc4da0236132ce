"""--precision fp16|bf16 under mpirun, as a user runs it: losses track fp32, the gradient
all-reduce carries half the bytes, the memory is 2P + 2P + 12P, a huge loss scale skips
steps without touching anything, and --verify passes with dp, tp and pp."""
import json
import os

import numpy as np
import pytest

from minipar.train import checkpoint
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel.pipeline import stage as pipeline

from trainer_runs import mpirun, read_log

SMALL = ["--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--block-size", "64", "--batch-size", "16",
         "--steps", "50"]


def test_fp16_and_bf16_track_fp32_with_dp2_and_send_half_the_gradient_bytes(tmp_path):
    runs = {}
    for mode in ("fp32", "fp16", "bf16"):
        log = str(tmp_path / f"{mode}.jsonl")
        p = mpirun(2, *SMALL, "--precision", mode, "--log", log)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "replicas identical across 2 dp ranks" in p.stdout and "(ratio 1.000)" in p.stdout, p.stdout
        runs[mode] = read_log(log)
    ref_rows, ref_sum = runs["fp32"]
    P = ref_sum["params_count"]
    for mode in ("fp16", "bf16"):
        rows, summary = runs[mode]
        dev = [abs(r["loss"] - q["loss"]) / q["loss"] for r, q in zip(rows, ref_rows)]
        assert len(rows) == 50 and max(dev) < 0.03, f"{mode}: losses off fp32 by up to {max(dev):.2e}"
        assert abs(summary["final_loss"] - ref_sum["final_loss"]) / ref_sum["final_loss"] < 0.01
        assert ref_sum["final_loss"] < 3.2, ref_sum["final_loss"]                 # it learned
        # the ledger: 2(p-1)/p x the gradient bytes = 4P in fp32 at p = 2, 2P in fp16/bf16
        assert {r["grad_sync_bytes"] for r in ref_rows} == {4 * P}
        assert {r["grad_sync_bytes"] for r in rows} == {2 * P}, f"{mode}: {rows[0]['grad_sync_bytes']} != 2P"
        mem = summary["memory"]
        assert [mem["params"], mem["grads"], mem["optimizer"]] == [2 * P, 2 * P, 12 * P], mem
        assert summary["precision"]["skipped_steps"] == 0 and not any(r["skipped"] for r in rows)
    mem = ref_sum["memory"]
    assert [mem["params"], mem["grads"], mem["optimizer"]] == [4 * P, 4 * P, 8 * P], mem


def test_loss_scale_window_doubles_the_scale_after_that_many_clean_steps(tmp_path):
    """--loss-scale-window 2: the scale doubles after every 2 clean steps in a row (the
    checkpoint keeps the window); it is fp16's and a new run's only, refused otherwise."""
    d, log = str(tmp_path / "D"), str(tmp_path / "log.jsonl")
    p = mpirun(1, "--precision", "fp16", "--loss-scale", "64", "--loss-scale-window", "2", "--steps", "5",
               "--log", log, "--save", d)
    assert p.returncode == 0, p.stdout + p.stderr
    rows, _ = read_log(log)
    assert [r["loss_scale"] for r in rows] == [64, 64, 128, 128, 256] and not any(r["skipped"] for r in rows)
    assert json.load(open(os.path.join(d, "meta.json")))["loss_scaler"]["growth_interval"] == 2
    for flags, says in ((["--precision", "bf16", "--loss-scale-window", "4"], "is for --precision fp16"),
                        (["--precision", "fp16", "--loss-scale-window", "0"], "must be >= 1, got 0"),
                        (["--precision", "fp16", "--loss-scale-window", "4", "--resume", d, "--steps", "6"],
                         "--loss-scale-window sets a new run's scaler")):
        p = mpirun(1, *flags, "--steps", "6")
        assert p.returncode == 2 and says in p.stderr, p.stderr


def test_huge_loss_scale_skips_every_step_and_leaves_the_model_at_its_init(tmp_path):
    """--loss-scale 1e30 overflows every fp16 gradient: each step is skipped on all 4 ranks
    (dp2 x tp2) and halves the scale; the checkpoint is then the float32 init, zero moments."""
    d, log = str(tmp_path / "D"), str(tmp_path / "log.jsonl")
    p = mpirun(4, "--dp", "2", "--tp", "2", "--precision", "fp16", "--loss-scale", "1e30", "--save", d,
               "--log", log, "--steps", "3")
    assert p.returncode == 0, p.stdout + p.stderr
    rows, summary = read_log(log)
    assert [r["skipped"] for r in rows] == [True] * 3, rows
    assert [r["loss_scale"] for r in rows] == [1e30, 5e29, 2.5e29] and all(r["grad_norm"] is None for r in rows)
    assert summary["precision"]["skipped_steps"] == 3 and summary["precision"]["loss_scale_final"] == 1.25e29
    assert "3 of 3 steps skipped" in p.stdout and "skipped (inf/NaN gradient)" in p.stdout, p.stdout
    meta = json.load(open(os.path.join(d, "meta.json")))
    assert meta["loss_scaler"]["scale"] == 1.25e29 and meta["precision"] == "fp16"
    init = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16), seed=0, dtype=np.float32).state_dict()
    with np.load(os.path.join(d, "model.npz")) as z:
        assert sorted(z.files) == sorted(init)
        for n in init:
            np.testing.assert_array_equal(z[n], init[n], err_msg=f"{n} moved on a skipped step")
    _, ostate, _ = checkpoint.load(d)                  # the optimizer shards, scattered back
    assert ostate["step"] == 0
    assert all(not a.any() for k in ("m", "v") for a in ostate[k].values()), "Adam's moments moved on a skipped step"


@pytest.mark.parametrize("n,mode,flags,layout", [
    (4, "fp16", ["--tp", "2", "--pp", "2", "--n-layer", "2", "--micro-batches", "2"], "dp=1 tp=2 pp=2"),
    (4, "bf16", ["--dp", "2", "--tp", "2", "--untied"], "dp=2 tp=2 pp=1"),
])
def test_verify_mixed_precision_and_memory_of_the_local_parameters(tmp_path, n, mode, flags, layout):
    log = str(tmp_path / "log.jsonl")
    p = mpirun(n, "--precision", mode, "--verify", "--log", log, "--steps", "6", *flags)
    assert p.returncode == 0, p.stdout + p.stderr
    verify = [line for line in p.stdout.splitlines() if line.startswith(f"verify: {layout} vs 1 process")]
    assert len(verify) == 1 and verify[0].endswith("on losses -> OK"), p.stdout
    _, summary = read_log(log)
    assert summary["verify"]["loss_rel"] < 1e-3, summary["verify"]     # 6 steps: far inside 5e-2
    n_layer = int(flags[flags.index("--n-layer") + 1]) if "--n-layer" in flags else 1
    cfg = GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, block_size=16, tie_embeddings="--untied" not in flags)
    P = pipeline.local_param_count(cfg, 0, summary["layout"]["pp"], summary["layout"]["tp"])   # rank 0's
    mem = summary["memory"]
    assert [mem["params"], mem["grads"], mem["optimizer"]] == [2 * P, 2 * P, 12 * P], (mem, P)
