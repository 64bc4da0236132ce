"""Sharded checkpoints across layouts (docs/design.md §9): each rank writes the optimizer
state it holds, with every element's canonical position, and any layout resumes from any
other exactly as the uninterrupted run in the target layout (float64: 1e-12 relative).

Runs are subprocess `mpirun`s of the tiny model (trainer_runs.py), the single-process
targets in-process. Also: what each layout writes, and the index of optimizer_shard checked
against the canonical flat vector in-process.
"""
import json
import math
import os

import numpy as np
import pytest
from mpi4py import MPI

from minipar.train import checkpoint
from minipar import comm
from minipar.model.gpt import GPT, GPTConfig, param_specs
from minipar.optim.adamw import AdamW
from minipar.parallel.parallelize import parts
from minipar.parallel.zero import build as zero, stage3

from trainer_runs import TINY_MPI, mpirun, read_log, run_tiny

F64 = ["--dtype", "float64", "--lr-schedule", "constant", "--warmup", "0", "--n-layer", "2"]
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16)             # TINY_MPI's model, 2 layers
P = sum(math.prod(s) for _, s, _ in param_specs(CFG))
pytestmark = pytest.mark.usefixtures("fixed_peak")


def losses(path, key="loss"):
    return [r[key] for r in read_log(path)[0]]


def rel_diff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / np.abs(b)))


def assert_resumed_equals_uninterrupted(resumed, uninterrupted, k, what, rtol=1e-12):
    """Steps k.. of the uninterrupted log == the resumed log: losses and gradient norms."""
    for key in ("loss", "grad_norm"):
        a, b = losses(resumed, key), losses(uninterrupted, key)[k:]
        assert len(a) == len(b) > 0, (a, b)
        np.testing.assert_allclose(a, b, rtol=rtol, err_msg=f"{what}: {key} resumed vs uninterrupted")
        print(f"{what}: {key} max relative difference {rel_diff(a, b):.2e}")


def ok(p):
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def test_dp4_zero2_resumes_on_tp2_pp2(tmp_path):
    """Four ZeRO-2 shards (one per dp rank, each a 1/4 of every padded unit) -> a layout
    where each rank holds a tp half of a pipeline stage."""
    d, a, b = str(tmp_path / "ck"), str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    ok(mpirun(4, *F64, "--zero", "2", "--steps", "3", "--save", d))
    meta = json.load(open(os.path.join(d, "meta.json")))
    assert meta["format"] == 2 and meta["layout"] == {"dp": 4, "cp": 1, "tp": 1, "pp": 1, "zero": 2}, meta["layout"]
    shards = meta["optimizer"]["shards"]
    assert sorted(shards) == [checkpoint.shard_name(r) for r in range(4)] == sorted(
        "optim/" + f for f in os.listdir(os.path.join(d, "optim"))), shards
    # each rank: a quarter of every unit (wte, each block, the rest) padded to a multiple of 4
    units = [[n for n, _, _ in param_specs(CFG) if n == "wte.weight"]] + \
        [[n for n, _, _ in param_specs(CFG) if n.startswith(f"h.{i}.")] for i in range(2)] + \
        [[n for n, _, _ in param_specs(CFG) if n in ("wpe.weight", "ln_f.weight", "ln_f.bias")]]
    sizes = {n: math.prod(s) for n, s, _ in param_specs(CFG)}
    quarter = sum(-(-sum(sizes[n] for n in u) // 4) for u in units)
    assert set(shards.values()) == {quarter}, (shards, quarter)
    ok(mpirun(4, *F64, "--tp", "2", "--pp", "2", "--steps", "6", "--resume", d, "--log", b))
    ok(mpirun(4, *F64, "--tp", "2", "--pp", "2", "--steps", "6", "--log", a))
    assert_resumed_equals_uninterrupted(b, a, 3, "dp4 zero2 -> tp2 x pp2")


def test_dp4_zero3_resumes_on_one_process_without_zero(tmp_path):
    """ZeRO-3 shards (parameters sharded too: model.npz is all-gathered for the save) -> a
    plain single process."""
    d, a, b = str(tmp_path / "ck"), str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    ok(mpirun(4, *F64, "--zero", "3", "--steps", "3", "--save", d))
    assert len(json.load(open(os.path.join(d, "meta.json")))["optimizer"]["shards"]) == 4
    tiny = TINY_MPI[TINY_MPI.index("--n-head"):]
    run_tiny(*tiny, *F64, "--steps", "6", "--resume", d, "--log", b)
    run_tiny(*tiny, *F64, "--steps", "6", "--log", a)
    assert_resumed_equals_uninterrupted(b, a, 3, "dp4 zero3 -> 1 process, zero 0")


def test_cp2_dp2_zero1_resumes_on_cp4(tmp_path):
    """Context parallelism holds whole parameters on each cp rank and ZeRO shards over
    dp x cp: four shards from dp 2 x cp 2 -> cp 4 (no dp, no ZeRO), equal to the
    uninterrupted run there. Without ZeRO only dp 0, cp 0 writes."""
    d, e = str(tmp_path / "ck"), str(tmp_path / "ck0")
    ok(mpirun(4, *F64, "--cp", "2", "--zero", "1", "--steps", "3", "--save", d))
    meta = json.load(open(os.path.join(d, "meta.json")))
    assert meta["layout"] == {"dp": 2, "cp": 2, "tp": 1, "pp": 1, "zero": 1}, meta["layout"]
    assert len(meta["optimizer"]["shards"]) == 4
    for target in (["--cp", "4"],):
        a, b = str(tmp_path / f"a{len(target)}.jsonl"), str(tmp_path / f"b{len(target)}.jsonl")
        ok(mpirun(4, *F64, *target, "--steps", "6", "--resume", d, "--log", b))
        ok(mpirun(4, *F64, *target, "--steps", "6", "--log", a))
        assert_resumed_equals_uninterrupted(b, a, 3, f"dp2 cp2 zero1 -> {' '.join(target)}")
    ok(mpirun(4, *F64, "--cp", "2", "--steps", "3", "--save", e))
    assert len(json.load(open(os.path.join(e, "meta.json")))["optimizer"]["shards"]) == 1


def test_fp16_dp2_zero1_resumes_on_one_process_with_the_loss_scaler(tmp_path):
    """fp16 from a scale of 2^18: step 0 overflows and halves it, then clean steps count
    towards the next growth. The ZeRO-1 checkpoint at step 4 holds the fp32 master weights
    (model.npz) and fp32 moments (two shards) and the scaler (scale, 3 clean steps). The
    same layout resumes bit for bit; one process resumes with the same scales and skips, to
    fp16 rounding of the losses (the first steps ran in another layout, with another
    rounding), and ends with the scaler of its uninterrupted run (7 clean steps)."""
    flags = ["--precision", "fp16", "--lr-schedule", "constant", "--warmup", "2"]
    first = ["--loss-scale", str(2.0 ** 18)]
    d, src, same, one, ref = (str(tmp_path / x) for x in ("ck", "src.jsonl", "same.jsonl", "one.jsonl", "ref.jsonl"))
    ok(mpirun(2, *flags, *first, "--zero", "1", "--steps", "4", "--save", d))
    meta = json.load(open(os.path.join(d, "meta.json")))
    assert meta["loss_scaler"]["scale"] == 2.0 ** 17 and meta["loss_scaler"]["good_steps"] == 3, meta["loss_scaler"]
    assert meta["optimizer"]["dtype"] == "float32" and len(meta["optimizer"]["shards"]) == 2, meta["optimizer"]
    ok(mpirun(2, *flags, *first, "--zero", "1", "--steps", "8", "--log", src))
    ok(mpirun(2, *flags, "--zero", "1", "--steps", "8", "--resume", d, "--log", same))
    rows_src, rows_same = read_log(src)[0][4:], read_log(same)[0]
    for key in ("loss", "grad_norm", "loss_scale", "skipped"):
        assert [r[key] for r in rows_same] == [r[key] for r in rows_src], f"fp16 dp2 zero1 resumed: {key}"

    tiny = TINY_MPI[TINY_MPI.index("--n-head"):]
    run_tiny(*tiny, *flags, "--steps", "8", "--resume", d, "--log", one, "--save", str(tmp_path / "one"))
    run_tiny(*tiny, *flags, *first, "--steps", "8", "--log", ref, "--save", str(tmp_path / "ref"))
    rows_one, rows_ref = read_log(one)[0], read_log(ref)[0][4:]
    assert [(r["loss_scale"], r["skipped"]) for r in rows_one] == \
        [(r["loss_scale"], r["skipped"]) for r in rows_ref] == [(2.0 ** 17, False)] * 4, rows_one
    np.testing.assert_allclose(losses(one), losses(ref)[4:], rtol=1e-5, err_msg="fp16 dp2 zero1 -> 1 process")
    print(f"fp16 dp2 zero1 -> 1 process: loss max relative difference {rel_diff(losses(one), losses(ref)[4:]):.2e}")
    scalers = [json.load(open(tmp_path / x / "meta.json"))["loss_scaler"] for x in ("one", "ref")]
    assert scalers[0] == scalers[1] and scalers[0]["good_steps"] == 7, scalers


# ---------------------------------------------------------------- the index, in-process

def scatter(shards):
    """Canonical flat m from shards, and how many times each element is covered."""
    m, count = np.full(P, np.nan), np.zeros(P, dtype=int)
    for s in shards:
        real = s["index"] >= 0
        m[s["index"][real]] = s["m"][real]
        np.add.at(count, s["index"][real], 1)
    return m, count


def canonical_flat(opt_state: dict) -> np.ndarray:
    return np.concatenate([opt_state[n].ravel() for n, _, _ in param_specs(CFG)])


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_optimizer_shard_index_points_at_the_canonical_elements(stage):
    """One process (ZeRO over a group of one: units flattened and padded to 1, in the order
    wte, blocks, the rest, not the canonical one): the index is a permutation of 0..P-1 and
    scattering m by it gives the canonical m."""
    model = GPT(CFG, seed=0, dtype=np.float64, parts=parts(gathers=stage3.Gathers() if stage == 3 else None))
    opt = AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(1)
    for m in opt.m:
        m[...] = rng.standard_normal(m.shape)
    full = dict(zip([n for n, _ in model.named_parameters()], [m.copy() for m in opt.m]))
    if stage:
        _, opt = zero.build(model, opt, comm.Group(MPI.COMM_SELF), stage)
    shard = checkpoint.optimizer_shard(model, opt)
    assert shard["index"].dtype == np.int64 and shard["m"].shape == shard["index"].shape == (P,)
    if stage:
        assert not np.array_equal(shard["index"], np.arange(P)), "ZeRO's unit order is not canonical"
    m, count = scatter([shard])
    assert (count == 1).all(), f"elements covered {set(count.tolist())} times"
    np.testing.assert_array_equal(m, canonical_flat(full))
