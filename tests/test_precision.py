"""Mixed precision (minipar/optim/mixed_precision.py, --precision fp16|bf16), on one process.

- Every op on 2-byte inputs is exactly the float32 op on the widened inputs, rounded: its
  outputs and input gradients are in the storage dtype, bit for bit store(fp32 result).
- The loss scaler follows GradScaler's rule; MixedPrecisionAdamW keeps 12 bytes per
  parameter and updates fp32 master weights exactly as AdamW would.
- The trainer: memory = 2P + 2P + 12P, skipped steps change nothing, resume is exact,
  bad flag combinations are one-line errors.
"""
import json
import math
import os

import ml_dtypes
import numpy as np
import pytest

from minipar.autograd import ops
from minipar.optim import mixed_precision
from minipar.train import trainer as train
from minipar.model.gpt import GPT, GPTConfig
from minipar.optim.adamw import AdamW
from minipar.optim.mixed_precision import LossScaler, MixedPrecisionAdamW
from minipar.autograd.dtypes import compute, store
from minipar.autograd.tensor import Tensor

BF16 = np.dtype(ml_dtypes.bfloat16)
LOW = [np.dtype(np.float16), BF16]
from trainer_runs import TINY, read_log, run_tiny as run  # noqa: F401

pytestmark = pytest.mark.usefixtures("fixed_peak")


# ---------------------------------------------------------------- the casting helpers

def test_compute_passes_float32_and_float64_through_and_widens_2_byte_arrays():
    a32, a64 = np.ones(3, np.float32), np.ones(3, np.float64)
    assert compute(a32) is a32 and compute(a64) is a64            # fp32 runs: the same objects
    x, y = compute(np.ones(3, np.float16), np.ones(3, BF16))
    assert x.dtype == np.float32 and y.dtype == np.float32
    assert store(a32, np.float32) is a32
    with np.errstate(over="ignore"):
        r = store(np.array([1 + 2 ** -12, 65520.0], np.float32), np.float16)   # nearest even; inf
    assert r.dtype == np.float16 and r[0] == 1.0 and np.isinf(r[1]), r


# ---------------------------------------------------------------- every op: fp32 compute, rounded

def _op_cases(rng):
    B, T, C, H = 2, 5, 8, 2
    x = rng.standard_normal((B, T, C))
    return {
        "linear": (lambda x, w, b: ops.linear(x, w, b), [x, rng.standard_normal((C, 3 * C)) * 0.3,
                                                          rng.standard_normal(3 * C)]),
        "matmul": (lambda a, b: ops.matmul(a, ops.transpose(b)), [x, rng.standard_normal((7, C))]),
        "layer_norm": (lambda x, w, b: ops.layer_norm(x, w, b), [x, 1 + 0.1 * rng.standard_normal(C),
                                                                 0.1 * rng.standard_normal(C)]),
        "gelu": (ops.gelu, [x]),
        "softmax": (ops.softmax, [x]),
        "attention": (lambda q: ops.causal_self_attention(q, H), [rng.standard_normal((B, T, 3 * C))]),
        "add_broadcast": (lambda a, b: a + b, [x, rng.standard_normal((1, T, C))]),
        "sum": (lambda a: ops.sum(a, axis=1), [x]),
        "embedding": (lambda w: ops.embedding(np.array([[1, 3, 3, 0]]), w), [rng.standard_normal((5, C))]),
    }


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", list(_op_cases(np.random.default_rng(0))))
def test_op_in_2_bytes_is_the_float32_op_rounded(name, dtype):
    """Forward and backward of every op on fp16/bf16 inputs give exactly store(the float32
    op on the widened inputs), in the storage dtype (elementwise add stays in 2 bytes, which
    rounds its float32 sum once: also exact)."""
    rng = np.random.default_rng(1)
    f, arrays = _op_cases(rng)[name]
    low = [a.astype(dtype) for a in arrays]                     # the stored inputs
    wide = [a.astype(np.float32) for a in low]                  # the same values in float32
    outs = []
    for inputs in (low, wide):
        ts = [Tensor(a, requires_grad=True) for a in inputs]
        y = f(*ts)
        g = np.random.default_rng(2).standard_normal(y.shape).astype(dtype)   # the same for both
        y.backward(g.astype(y.dtype))
        outs.append((y.data, [t.grad for t in ts]))
    (y_low, g_low), (y32, g32) = outs
    assert y_low.dtype == dtype, f"{name}: output {y_low.dtype}"
    np.testing.assert_array_equal(y_low.astype(np.float32), store(y32, dtype).astype(np.float32),
                                  err_msg=f"{name} forward")
    for i, (gl, gw) in enumerate(zip(g_low, g32)):
        assert gl.dtype == dtype, f"{name}: grad {i} is {gl.dtype}"
        np.testing.assert_array_equal(gl.astype(np.float32), store(gw, dtype).astype(np.float32),
                                      err_msg=f"{name} grad {i}")


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_cross_entropy_loss_stays_float32_and_its_gradient_is_stored(dtype):
    rng = np.random.default_rng(2)
    logits = (3 * rng.standard_normal((2, 5, 11))).astype(dtype)
    t = rng.integers(0, 11, (2, 5))
    a, b = Tensor(logits, requires_grad=True), Tensor(logits.astype(np.float32), requires_grad=True)
    la, lb = ops.cross_entropy(a, t, 40), ops.cross_entropy(b, t, 40)
    assert la.dtype == np.float32 and la.item() == lb.item()
    la.backward(np.float32(1024))
    lb.backward(np.float32(1024))
    assert a.grad.dtype == dtype
    np.testing.assert_array_equal(a.grad.astype(np.float32), store(b.grad, dtype).astype(np.float32))


# ---------------------------------------------------------------- the loss scaler

def test_loss_scaler_grows_after_the_interval_and_backs_off_on_inf():
    s = LossScaler(scale=8.0, growth_interval=3)
    scales = []
    for found in [False, False, False, False, True, False, False, False]:
        s.update(found)
        scales.append(s.scale)
    assert scales == [8, 8, 16, 16, 8, 8, 8, 16], scales            # the counter restarts after a skip
    assert mixed_precision.make_scaler("fp16").state_dict() == {"scale": 65536.0, "good_steps": 0,
                                                          "growth_interval": 2000, "dynamic": True}
    bf = mixed_precision.make_scaler("bf16")
    for found in (True, False):
        bf.update(found)
    assert bf.scale == 1.0 and not bf.dynamic
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert t == s


# ---------------------------------------------------------------- master weights

@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_master_weights_step_like_adamw_and_hold_12_bytes_per_parameter(dtype):
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8)
    ref, low = GPT(cfg, seed=3, dtype=np.float32), GPT(cfg, seed=3, dtype=np.float32)
    init = {n: p.data.copy() for n, p in ref.named_parameters()}
    opt_ref = AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    opt = MixedPrecisionAdamW(low.parameters(), dtype, lr=1e-2, weight_decay=0.1)
    P = low.num_params()
    assert opt.state_bytes() == 12 * P
    assert sum(p.data.nbytes for p in low.parameters()) == 2 * P
    for (n, p), w in zip(low.named_parameters(), opt.master):
        assert p.data.dtype == dtype and w.dtype == np.float32
        np.testing.assert_array_equal(w, init[n], err_msg=f"{n}: master = the float32 init")
        np.testing.assert_array_equal(p.data, init[n].astype(dtype), err_msg=f"{n}: parameter = its rounding")
    rng = np.random.default_rng(4)
    for _ in range(2):
        for p, q in zip(ref.parameters(), low.parameters()):
            g = rng.standard_normal(p.shape).astype(dtype)
            p.grad, q.grad = g.astype(np.float32) * np.float32(0.25), g * np.asarray(8, dtype)
        opt_ref.step()
        opt.step(grad_scale=0.25 / 8)                   # unscale by 8, clip by 0.25, in fp32
    for (n, p), q, w in zip(ref.named_parameters(), low.parameters(), opt.master):
        np.testing.assert_allclose(w, p.data, rtol=1e-6, atol=1e-7, err_msg=n)
        np.testing.assert_array_equal(q.data, w.astype(dtype), err_msg=f"{n}: rounded master")
    with pytest.raises(ValueError, match="float32"):
        MixedPrecisionAdamW(low.parameters(), dtype)                 # already 2-byte


# ---------------------------------------------------------------- the trainer

@pytest.mark.parametrize("mode", ["fp16", "bf16"])
def test_memory_is_2P_2P_12P_and_rows_carry_the_scale(tmp_path, mode):
    log = tmp_path / "run.jsonl"
    s = run("--precision", mode, "--log", str(log))
    rows, summary = read_log(log)
    P = summary["params_count"]
    mem = summary["memory"]
    assert {k: mem[k] for k in ("params", "grads", "optimizer")} == {"params": 2 * P, "grads": 2 * P,
                                                                     "optimizer": 12 * P}, mem
    assert mem["formula"]["text"] == "2P + 2P + 12P" and mem["formula"]["optimizer"] == 12 * P
    scale = 65536.0 if mode == "fp16" else 1.0
    assert all(r["loss_scale"] == scale and r["skipped"] is False for r in rows), rows
    assert s["precision"]["mode"] == mode and s["precision"]["skipped_steps"] == 0
    assert summary["precision"]["storage_dtype"] == {"fp16": "float16", "bf16": "bfloat16"}[mode]


def test_fp32_rows_carry_scale_1_and_never_skip(tmp_path):
    log = tmp_path / "run.jsonl"
    run("--log", str(log))
    rows, summary = read_log(log)
    assert all(r["loss_scale"] == 1.0 and r["skipped"] is False for r in rows)
    assert "precision" not in summary


def snapshot(model, opt):
    return ([p.data.copy() for p in model.parameters()], [w.copy() for w in opt.master],
            [m.copy() for m in opt.m], [v.copy() for v in opt.v], opt.step_count)


def test_huge_loss_scale_skips_untouched_steps_then_backs_off_to_clean_ones():
    """2^26 overflows fp16 gradients: each such step is skipped (parameters, master weights,
    m, v and the step count unchanged) and halves the scale, until the gradients fit."""
    args = train.build_parser().parse_args(TINY + ["--precision", "fp16", "--loss-scale", str(2.0 ** 26),
                                                   "--steps", "16"])
    plan = train.prepare(args, 1)
    model, opt = train.init_model(plan, args)
    sampler = train.data.Sampler(plan.tokens, plan.cfg.block_size, args.batch_size, args.seed)
    rows = []
    for step in range(16):
        before = snapshot(model, opt)
        with train.quiet_overflow():
            row = train.train_step(train.Session(args, model, opt, sampler), step)
        rows.append(row)
        after = snapshot(model, opt)
        same = all(np.array_equal(a, b) for xs, ys in zip(before[:4], after[:4]) for a, b in zip(xs, ys))
        if row["skipped"]:
            assert same and after[4] == before[4], f"step {step} was skipped but the state changed"
            assert not math.isfinite(row["grad_norm"])
        else:
            assert not same and after[4] == before[4] + 1, f"step {step} was not skipped but nothing moved"
    skipped = [r["skipped"] for r in rows]
    k = skipped.index(False)
    assert k >= 2 and not any(skipped[k:]), skipped                 # skips first, then only clean steps
    assert [r["loss_scale"] for r in rows[:k + 1]] == [2.0 ** (26 - i) for i in range(k + 1)]
    assert opt.scaler.scale == 2.0 ** (26 - k) and opt.step_count == 16 - k


def test_bf16_skips_a_non_finite_gradient_without_scaling(monkeypatch):
    args = train.build_parser().parse_args(TINY + ["--precision", "bf16"])
    plan = train.prepare(args, 1)
    model, opt = train.init_model(plan, args)
    sampler = train.data.Sampler(plan.tokens, plan.cfg.block_size, args.batch_size, args.seed)
    w = model.params["h.0.mlp.c_fc.weight"]
    w.register_grad_hook(lambda p: p.grad.flat.__setitem__(0, np.nan) if state["poison"] else None)
    state = {"poison": True}
    before = snapshot(model, opt)
    row = train.train_step(train.Session(args, model, opt, sampler, rows=(0, 4)), 0)
    assert row["skipped"] and row["loss_scale"] == 1.0 and opt.step_count == 0
    assert all(np.array_equal(a, b) for xs, ys in zip(before[:4], snapshot(model, opt)[:4]) for a, b in zip(xs, ys))
    state["poison"] = False
    row = train.train_step(train.Session(args, model, opt, sampler, rows=(0, 4)), 1)
    assert not row["skipped"] and opt.scaler.scale == 1.0 and opt.step_count == 1


@pytest.mark.parametrize("mode,extra", [("fp16", ["--loss-scale", str(2.0 ** 22)]), ("bf16", [])])
def test_resume_is_bit_exact_with_the_loss_scaler(tmp_path, mode, extra):
    """Steps 0..7 == steps 0..3, a checkpoint, --resume to 8: losses, norms, scales and skips
    bit for bit; model.npz holds the float32 master weights. fp16 starts at 2^22, so the
    scale is still backing off when the checkpoint is written."""
    flags = ["--precision", mode, "--lr-schedule", "constant", "--warmup", "2", *extra]
    a_dir, d = str(tmp_path / "A"), str(tmp_path / "D")
    run(*flags, "--steps", "8", "--log", str(tmp_path / "A.jsonl"), "--save", a_dir)
    run(*flags, "--steps", "4", "--save", d)
    run(*[f for f in flags if f not in extra], "--steps", "8", "--resume", d, "--save", d,
        "--log", str(tmp_path / "B.jsonl"))
    rows_a, _ = read_log(tmp_path / "A.jsonl")
    rows_b, _ = read_log(tmp_path / "B.jsonl")
    if mode == "fp16":
        assert rows_a[3]["skipped"] and rows_a[4]["skipped"], [r["skipped"] for r in rows_a]
    for ra, rb in zip(rows_a[4:], rows_b):
        for key in ("loss", "grad_norm", "lr", "loss_scale", "skipped"):
            assert ra[key] == rb[key], f"{mode} step {ra['step']} {key}: {ra[key]!r} != resumed {rb[key]!r}"
    meta = json.load(open(os.path.join(d, "meta.json")))
    assert meta["precision"] == mode and meta["loss_scaler"]["scale"] == rows_a[-1]["loss_scale"] * (
        0.5 if rows_a[-1]["skipped"] else 1.0)
    for name in ("model.npz", "optim/rank-00000.npz"):         # one process: one optimizer shard
        with np.load(os.path.join(a_dir, name)) as za, np.load(os.path.join(d, name)) as zb:
            for k in za.files:
                assert za[k].dtype == np.float32 or k in ("step", "index"), f"{name} {k}: {za[k].dtype}"
                np.testing.assert_array_equal(zb[k], za[k], err_msg=f"{name} {k} after resume ({mode})")


@pytest.mark.parametrize("flags,needles", [
    (["--precision", "fp16", "--dtype", "float64"], ["--precision fp16 needs --dtype float32", "float64"]),
    (["--precision", "bf16", "--loss-scale", "8"], ["--loss-scale is for --precision fp16", "bf16"]),
    (["--loss-scale", "8"], ["--loss-scale is for --precision fp16"]),
    (["--precision", "fp16", "--loss-scale", "0"], ["--loss-scale must be a finite number > 0"]),
    (["--precision", "fp16", "--loss-scale", "inf"], ["--loss-scale must be a finite number, got inf"]),
])
def test_bad_precision_flags_one_line_exit_2(capsys, flags, needles):
    with pytest.raises(SystemExit) as e:
        train.main(TINY + flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert all(n in err for n in needles), err


def test_resume_with_another_precision_or_a_new_loss_scale_is_refused(tmp_path, capsys):
    d = str(tmp_path / "D")
    run("--precision", "fp16", "--save", d)
    for flags, needle in ((["--precision", "bf16"], "--precision bf16 does not match the checkpoint"),
                          ([], "--precision fp32 does not match the checkpoint"),
                          (["--precision", "fp16", "--loss-scale", "8"], "--loss-scale sets a new run's")):
        with pytest.raises(SystemExit) as e:
            train.main(TINY + ["--steps", "6", "--resume", d] + flags)
        assert e.value.code == 2 and needle in capsys.readouterr().err, flags


def test_storage_dtype_of_each_precision():
    """fp32 stores nothing in 2 bytes; fp16 and bf16 their dtypes (bf16's ml_dtypes imported
    only here, when asked for); an unknown name is a ValueError naming the choices."""
    assert mixed_precision.storage_dtype("fp32") is None
    assert mixed_precision.storage_dtype("fp16") == np.dtype(np.float16)
    assert mixed_precision.storage_dtype("bf16") == np.dtype(ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="fp32, fp16, bf16"):
        mixed_precision.storage_dtype("fp8")
