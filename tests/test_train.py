"""minipar.train (docs/design.md §7 to §9): exact resume, gradient accumulation, the JSONL log,
one-line errors for bad flags, learning on the built-in corpus, and the progress output.

Runs call the trainer in-process on a tiny model; only the few tests that check what a
user sees from `python -m minipar.train` (exit code, stderr, no traceback) use a subprocess.
The matmul peak that MFU divides by is replaced by a constant in-process: measuring it costs
a quarter of a second per run and no test here depends on its value.
"""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from minipar.train import checkpoint, trainer as train

from trainer_runs import REPO, TINY, assert_main_exits_2, read_log, run_tiny as run  # noqa: F401

TINY_CFG = dict(L=1, H=2, C=16, T=16, V=256)
pytestmark = pytest.mark.usefixtures("fixed_peak")


def read_meta(directory) -> dict:
    with open(os.path.join(directory, "meta.json")) as f:
        return json.load(f)


def read_npz(path) -> dict:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def param_count(L, C, T, V, tied=True, **_):
    """P from the shapes of docs/design.md §2, independently of minipar.model."""
    per_block = (C + C            # ln_1 weight, bias
                 + C * 3 * C + 3 * C  # attn.c_attn
                 + C * C + C      # attn.c_proj
                 + C + C          # ln_2
                 + C * 4 * C + 4 * C  # mlp.c_fc
                 + 4 * C * C + C)  # mlp.c_proj
    return V * C + T * C + L * per_block + 2 * C + (0 if tied else V * C)


# ---------------------------------------------------------------- exact resume

class Interrupted(Exception):
    """The process dying right after a --save-every checkpoint."""


def run_until_killed(monkeypatch, at: int, *flags):
    """Run with --save-every `at` and die just after that checkpoint is written."""
    real = checkpoint.save_run

    def save_then_die(path, s, next_step):
        real(path, s, next_step)
        if next_step == at:
            raise Interrupted

    monkeypatch.setattr(checkpoint, "save_run", save_then_die)
    with pytest.raises(Interrupted):
        run(*flags, "--save-every", str(at))
    monkeypatch.setattr(checkpoint, "save_run", real)


RESUME_CASES = [  # (dtype, extra flags, how the first part ends)
    ("float32", ["--lr-schedule", "cosine"], "killed"),
    ("float64", ["--lr-schedule", "cosine"], "killed"),
    ("float32", ["--lr-schedule", "cosine", "--micro-batches", "2"], "killed"),
    ("float64", ["--lr-schedule", "constant", "--micro-batches", "2"], "killed"),
    ("float32", ["--lr-schedule", "constant"], "stopped"),
    ("float64", ["--lr-schedule", "constant", "--micro-batches", "2"], "stopped"),
]


@pytest.mark.parametrize("dtype,extra,how", RESUME_CASES,
                         ids=[f"{d}-{'-'.join(e).replace('--', '')}-{h}" for d, e, h in RESUME_CASES])
def test_resume_is_bit_exact(tmp_path, monkeypatch, dtype, extra, how):
    """Steps 0..7 in one run == steps 0..3, a checkpoint, then --resume to 8: every logged
    loss, grad_norm and lr of steps 4..7 and the final model and optimizer, bit for bit.
    "killed": a --steps 8 run dies after its --save-every 4 checkpoint (the cosine horizon
    is the same); "stopped": a --steps 4 run ends normally (constant lr only, since a
    cosine schedule's horizon is --steps)."""
    flags = ["--dtype", dtype, "--warmup", "2", "--seed", "1", *extra]
    a_dir, d = str(tmp_path / "A"), str(tmp_path / "D")
    run(*flags, "--steps", "8", "--log", str(tmp_path / "A.jsonl"), "--save", a_dir)
    if how == "killed":
        run_until_killed(monkeypatch, 4, *flags, "--steps", "8", "--save", d)
    else:
        run(*flags, "--steps", "4", "--save", d)
    assert read_meta(d)["step"] == 4
    run(*flags, "--steps", "8", "--resume", d, "--save", d, "--log", str(tmp_path / "B.jsonl"))

    rows_a, _ = read_log(tmp_path / "A.jsonl")
    rows_b, _ = read_log(tmp_path / "B.jsonl")
    assert [r["step"] for r in rows_a] == list(range(8)), [r["step"] for r in rows_a]
    assert [r["step"] for r in rows_b] == [4, 5, 6, 7], [r["step"] for r in rows_b]
    for ra, rb in zip(rows_a[4:], rows_b):
        for key in ("loss", "grad_norm", "lr"):
            assert ra[key] == rb[key], (f"{dtype} {extra} step {ra['step']} {key}: "
                                        f"uninterrupted {ra[key]!r} != resumed {rb[key]!r}")
    for name in ("model.npz", "optim/rank-00000.npz"):         # one process: one optimizer shard
        a, b = read_npz(os.path.join(a_dir, name)), read_npz(os.path.join(d, name))
        assert sorted(a) == sorted(b), f"{name}: keys differ"
        for k in a:
            assert a[k].dtype == np.dtype(dtype) or k in ("step", "index"), f"{name} {k}: dtype {a[k].dtype}"
            np.testing.assert_array_equal(b[k], a[k], err_msg=f"{name} {k} after resume ({dtype} {extra})")
    assert read_meta(d)["step"] == 8


def make_text(path, n_bytes=4000):
    words = "ring all reduce shards the gradient across every rank while the pipeline waits".split()
    rng = np.random.default_rng(5)
    text = " ".join(rng.choice(words, size=n_bytes // 5))
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("flag", ["seed", "data"])
def test_resume_without_repeating_a_flag_continues_the_checkpoint_run(tmp_path, flag, capsys):
    """A run trained with --seed 3 (or --data FILE) and resumed without repeating the flag
    must either continue exactly as if uninterrupted (take the value from meta.json, as
    the model flags do) or refuse with a one-line error; never silently switch to seed 0
    or to the built-in corpus. meta.json records both the seed and the data's sha256."""
    first = ["--seed", "3"] if flag == "seed" else ["--data", make_text(tmp_path / "t.txt")]
    flags = ["--warmup", "2", "--lr-schedule", "constant"]
    run(*flags, *first, "--steps", "6", "--log", str(tmp_path / "A.jsonl"))
    d = str(tmp_path / "D")
    run(*flags, *first, "--steps", "3", "--save", d)
    capsys.readouterr()
    try:
        train.main(TINY + flags + ["--steps", "6", "--resume", d, "--log", str(tmp_path / "B.jsonl")])
    except SystemExit as e:
        err = capsys.readouterr().err
        assert e.code == 2 and err.startswith("minipar.train: error: ") and err.count("\n") == 1, err
        return
    rows_a, _ = read_log(tmp_path / "A.jsonl")
    rows_b, _ = read_log(tmp_path / "B.jsonl")
    losses_a, losses_b = [r["loss"] for r in rows_a[3:]], [r["loss"] for r in rows_b]
    assert losses_a == losses_b, (f"resumed without --{flag}: losses of steps 3..5 {losses_b} "
                                  f"!= uninterrupted {losses_a} (the run silently changed {flag})")


# ---------------------------------------------------------------- micro-batches

def test_micro_batches_equal_the_full_batch(tmp_path):
    """Gradient accumulation over 4 micro-batches of 1 sequence == one batch of 4 (float64)."""
    logs = {}
    for m in (1, 4):
        logs[m] = str(tmp_path / f"m{m}.jsonl")
        run("--dtype", "float64", "--steps", "3", "--warmup", "1", "--micro-batches", str(m),
            "--log", logs[m], "--save", str(tmp_path / f"m{m}"))
    r1, _ = read_log(logs[1])
    r4, _ = read_log(logs[4])
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in r4], [r[key] for r in r1], rtol=1e-12, atol=0,
                                   err_msg=f"{key}: --micro-batches 4 vs 1")
    assert r1[0]["loss"] != r1[2]["loss"], "the loss did not change: the comparison is vacuous"
    a, b = read_npz(tmp_path / "m1" / "model.npz"), read_npz(tmp_path / "m4" / "model.npz")
    for k in a:
        np.testing.assert_allclose(b[k], a[k], rtol=1e-9, atol=1e-12, err_msg=f"parameter {k} after 3 steps")


# ---------------------------------------------------------------- the JSONL log

@pytest.mark.parametrize("dtype,tied", [("float32", True), ("float64", True), ("float32", False)])
def test_jsonl_log_rows_and_summary(tmp_path, dtype, tied):
    log = tmp_path / "run.jsonl"
    steps, warmup, lr = 5, 4, 2e-3
    run("--dtype", dtype, "--steps", str(steps), "--warmup", str(warmup), "--lr", str(lr),
        "--log", str(log), *([] if tied else ["--untied"]))
    rows, summary = read_log(log)
    assert len(rows) == steps, f"{len(rows)} step rows for --steps {steps}"
    for i, r in enumerate(rows):
        missing = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "comm_bytes"} - set(r)
        assert not missing, f"row {i} lacks {missing}"
        assert r["step"] == i
        assert math.isfinite(r["loss"]) and 4.0 < r["loss"] < 7.0, r   # ~ln 256 = 5.55 at init
        assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0, r
        assert r["comm_bytes"] == 0, f"one process sends nothing, row {i} says {r['comm_bytes']}"
        want_lr = lr * (i + 1) / warmup if i < warmup else None
        if want_lr is not None:
            assert r["lr"] == pytest.approx(want_lr, rel=1e-12), f"step {i}: lr {r['lr']} != {want_lr}"

    P = param_count(**TINY_CFG, tied=tied)
    s = np.dtype(dtype).itemsize
    assert summary["params_count"] == P, f"params_count {summary['params_count']} != {P} from docs/design.md §2"
    mem = summary["memory"]
    got = {k: mem[k] for k in ("params", "grads", "optimizer")}
    assert got == {"params": s * P, "grads": s * P, "optimizer": 2 * s * P}, \
        f"{dtype}: memory {got}, expected {s}P, {s}P, {2 * s}P with P = {P}"


# ---------------------------------------------------------------- bad flags

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny float32 checkpoint at step 4 (n_embd 16)."""
    d = str(tmp_path_factory.mktemp("ckpt") / "D")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train, "matmul_peak_flops", lambda dtype, seconds=0.1: 1e11)
        run("--save", d)
    return d


def broken_ckpt(src, dst, name, content):
    """A copy of checkpoint `src` with file `name` cut in half (content None) or replaced."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, name)
    if content is None:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    else:
        with open(path, "w") as f:
            f.write(content)
    return path


def bad_flag_case(case, tmp_path, ckpt):
    """-> (argv after TINY, substrings the one error line must contain)."""
    if case == "n-embd-n-head":
        return ["--n-embd", "10", "--n-head", "4"], ["--n-embd 10", "--n-head 4"]
    if case == "n-layer-0":
        return ["--n-layer", "0"], ["--n-layer", "0"]
    if case == "micro-batches":
        return ["--batch-size", "6", "--micro-batches", "4"], ["--batch-size 6", "--micro-batches 4"]
    if case == "missing-data":
        return ["--data", "/nonexistent.txt"], ["/nonexistent.txt", "not found"]
    if case == "empty-data":
        p = tmp_path / "empty.txt"
        p.write_bytes(b"")
        return ["--data", str(p)], [str(p), "empty", "18"]
    if case == "short-data":
        p = tmp_path / "short.txt"
        p.write_bytes(b"0123456789")
        return ["--data", str(p)], [str(p), "10 bytes", "--block-size 16", "18"]
    if case == "missing-resume":
        return ["--resume", str(tmp_path / "nope")], [str(tmp_path / "nope"), "not found"]
    if case == "resume-n-embd":
        return ["--resume", ckpt, "--n-embd", "32", "--steps", "8"], ["--n-embd 32", "n_embd = 16", ckpt]
    if case == "resume-steps":
        return ["--resume", ckpt, "--steps", "4"], ["--steps 4", "step 4"]
    if case == "resume-dtype":
        return ["--resume", ckpt, "--dtype", "float64", "--steps", "8"], ["float64", "float32", ckpt]
    if case == "resume-truncated-model":
        p = broken_ckpt(ckpt, str(tmp_path / "T"), "model.npz", None)
        return ["--resume", str(tmp_path / "T"), "--steps", "8"], [p]
    if case == "resume-garbage-meta":
        p = broken_ckpt(ckpt, str(tmp_path / "G"), "meta.json", "{oops")
        return ["--resume", str(tmp_path / "G"), "--steps", "8"], [p]
    if case == "resume-meta-without-step":
        p = broken_ckpt(ckpt, str(tmp_path / "S"), "meta.json", '{"format": 2}')
        return ["--resume", str(tmp_path / "S"), "--steps", "8"], [p]
    if case == "resume-meta-null":
        p = broken_ckpt(ckpt, str(tmp_path / "N"), "meta.json", "null")
        return ["--resume", str(tmp_path / "N"), "--steps", "8"], [p]
    if case == "negative-seed":
        return ["--seed", "-1"], ["--seed", "-1"]
    if case == "negative-grad-clip":
        return ["--grad-clip", "-1"], ["--grad-clip", "-1"]
    if case == "log-in-missing-dir":
        p = str(tmp_path / "no" / "such" / "dir" / "run.jsonl")
        return ["--log", p], [p]
    raise AssertionError(case)


BAD_FLAGS = ["n-embd-n-head", "n-layer-0", "micro-batches", "missing-data", "empty-data",
             "short-data", "missing-resume", "resume-n-embd", "resume-steps", "resume-dtype",
             "resume-truncated-model", "resume-garbage-meta", "resume-meta-without-step",
             "resume-meta-null", "negative-seed", "negative-grad-clip", "log-in-missing-dir"]


@pytest.mark.parametrize("case", BAD_FLAGS)
def test_bad_flags_one_line_exit_2(tmp_path, ckpt, capsys, case):
    argv, needles = bad_flag_case(case, tmp_path, ckpt)
    assert_main_exits_2(TINY + argv, needles, capsys, case)


@pytest.mark.parametrize("case", ["n-embd-n-head", "missing-data", "resume-steps"])
def test_bad_flags_as_a_user_sees_them(tmp_path, ckpt, case):
    argv, needles = bad_flag_case(case, tmp_path, ckpt)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "minipar.train", *TINY, *argv], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, f"{case}: exit code {p.returncode}, stderr {p.stderr!r}"
    assert "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("minipar.train: error: ") and p.stderr.count("\n") == 1, p.stderr
    assert all(s in p.stderr for s in needles), f"{case}: {needles} not all in {p.stderr!r}"
    assert p.stdout == "", p.stdout


# ---------------------------------------------------------------- it learns

def test_default_model_learns_the_builtin_corpus(tmp_path):
    """60 steps of the default config: from ~ln 256 = 5.55 to below the unigram entropy
    (3.06 nats: the best loss without context), so the model uses context."""
    t0 = time.perf_counter()
    s = train.run(train.build_parser().parse_args(
        ["--steps", "60", "--sample", "0", "--log", str(tmp_path / "run.jsonl")]))
    seconds = time.perf_counter() - t0
    rows, _ = read_log(tmp_path / "run.jsonl")
    tail = float(np.mean([r["loss"] for r in rows[-5:]]))
    msg = (f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f} (last 5 mean {tail:.3f}, "
           f"val {s['val_loss']:.3f}), unigram entropy {s['unigram_entropy']:.3f}, {seconds:.1f} s")
    assert s["first_loss"] == pytest.approx(math.log(256), abs=0.15), msg
    assert s["unigram_entropy"] == pytest.approx(3.06, abs=0.01), msg
    assert s["final_loss"] < 3.0 and tail < 3.0, msg
    assert s["final_loss"] < s["unigram_entropy"] and s["val_loss"] < s["unigram_entropy"], msg


# ---------------------------------------------------------------- progress output

STEP_LINE = re.compile(r"^step\s+(\d+) \| loss (\d+\.\d{4}) \| lr \S+ \| norm\s+\S+ \|\s+\d+ tok/s \| "
                       r"MFU\s+\d+\.\d%", re.M)


def test_progress_lines_summary_and_sample(tmp_path, capsys):
    log = tmp_path / "run.jsonl"
    run("--steps", "4", "--sample", "40", "--log", str(log))
    out = capsys.readouterr().out
    rows, _ = read_log(log)
    printed = {int(m[0]): m[1] for m in STEP_LINE.findall(out)}
    assert sorted(printed) == [0, 1, 2, 3], f"step lines for {sorted(printed)} in:\n{out}"
    for r in rows:
        assert printed[r["step"]] == f"{r['loss']:.4f}", f"step {r['step']}: printed {printed[r['step']]}, log {r['loss']}"
    assert re.search(r"^summary: 4 steps in .* tok/s, MFU", out, re.M), out
    assert "sample:\n  The pipeline" in out, out
    sample = out.split("sample:\n", 1)[1]
    assert len(sample.strip()) >= len("The pipeline") + 10, f"sample too short: {sample!r}"

    run("--steps", "2", "--sample", "0")
    out = capsys.readouterr().out
    assert "summary:" in out and "sample:" not in out, out
