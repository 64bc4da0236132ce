"""How a run ends before its last step (minipar/train/stop.py, docs/debugging.md): it diverged (exit
3), a rank left (4), an output failed (5), it was interrupted (130 SIGINT, 143 SIGTERM). Each
ends every rank with one line, no traceback, the log flushed, and nothing of the user's lost.

Faults come from the injector (MINIPAR_FAULT, minipar/train/faults.py) on 1, 2 and 4 ranks, with
ZeRO, tensor parallelism and a pipeline among the layouts; signals come from outside too, to
mpirun and to one process. The elapsed-time bounds detect ranks left waiting (the comm
timeout is 60 s here); they are not performance assertions.
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from minipar.train import checkpoint, faults, trainer as train

from trainer_runs import MPIRUN, REPO, TINY, TINY_MPI, read_log

HANG = 30.0
LAYOUTS = {                                   # ranks -> the layout flags, and a rank to fault
    1: ([], 0),
    2: (["--dp", "2", "--zero", "2"], 1),
    4: (["--dp", "2", "--pp", "2", "--zero", "1", "--n-layer", "2"], 3),
}
MORE = [(2, ["--tp", "2"], 0), (4, ["--dp", "4", "--zero", "3"], 2), (4, ["--dp", "2", "--tp", "2", "--sp"], 1)]


def launch(n, flags, fault=None, tmp=None, popen=False, comm_timeout=60):
    """mpirun -n N python -m minipar.train TINY_MPI flags (n=1: python alone, as a user runs
    one process), in `tmp`, with MINIPAR_FAULT=fault."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=REPO,
               MINIPAR_COMM_TIMEOUT=str(comm_timeout))
    env.pop("MINIPAR_FAULT", None)
    if fault:
        env["MINIPAR_FAULT"] = fault
    cmd = ([] if n == 1 else [MPIRUN, "-n", str(n)]) + [sys.executable, "-m", "minipar.train", *TINY_MPI,
                                                          "--log-every", "1000", *flags]
    if popen:
        return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=120)
    p.seconds = time.monotonic() - t0
    return p


def one_line(p, code, *needles):
    """Exit code `code`, the stop line exactly once (from rank 0), every needle in it, and
    no traceback."""
    assert p.returncode == code, (p.returncode, p.stdout[-2000:], p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("minipar.train: ")]
    assert len(lines) == 1, p.stderr
    for s in needles:
        assert s in lines[0], (s, lines[0])
    assert "Traceback" not in p.stderr, p.stderr
    return lines[0]


def final_weights(directory) -> dict:
    return checkpoint.load(str(directory))[0]


def assert_bit_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k


def rows_of(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------- divergence: exit 3

@pytest.mark.parametrize("n,flags,rank", [(n, f, r) for n, (f, r) in LAYOUTS.items()] + MORE,
                         ids=lambda v: " ".join(v) if isinstance(v, list) else str(v))
def test_a_nan_on_one_rank_stops_every_rank_and_keeps_the_last_good_checkpoint(tmp_path, n, flags, rank):
    p = launch(n, flags + ["--steps", "8", "--save", "ck", "--save-every", "1", "--log", "log.jsonl"],
               f"kind=nan,rank={rank},step=3", tmp_path)
    one_line(p, 3, "the run diverged", "at step 3: not finite", "the last finite loss",
             "at step 2", "the last good checkpoint is ck (step 3)")
    assert p.seconds < HANG
    model, _, meta = checkpoint.load(str(tmp_path / "ck"))          # finite, or load would refuse it
    assert meta["step"] == 3 and all(np.isfinite(a).all() for a in model.values())
    rows = rows_of(tmp_path / "log.jsonl")
    assert [r["step"] for r in rows[:-1]] == [0, 1, 2, 3] and rows[-1]["stopped"] and rows[-1]["exit_code"] == 3


def test_a_large_lr_diverges_and_never_overwrites_the_good_checkpoint(tmp_path, capsys, fixed_peak):
    """The issue's case: --resume ck --save ck with --lr 1e4 --grad-clip 0 stops at the first
    non-finite step; ck holds the last finite state (load refuses any NaN)."""
    ck = str(tmp_path / "ck")
    train.main(TINY + ["--steps", "2", "--save", ck])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--steps", "60", "--resume", ck, "--save", ck, "--save-every", "1",
                           "--lr", "1e4", "--grad-clip", "0", "--warmup", "1"])
    out, err = capsys.readouterr()
    assert e.value.code == 3, err
    assert err.count("\n") == 1 and "the run diverged" in err and "not finite" in err, err
    step = checkpoint.load(ck)[2]["step"]
    assert 2 <= step < 60 and f"the last good checkpoint is {ck} (step {step})" in err, err


@pytest.mark.parametrize("flags,needle", [
    (["--precision", "fp16"], "the fp16 loss scale fell to 0.5"),
    (["--precision", "fp16", "--min-loss-scale", "1024"], "below --min-loss-scale 1024"),
    (["--precision", "bf16", "--max-skipped-steps", "5"], "6 steps in a row skipped"),
    (["--precision", "fp16", "--loss-scale", "1024", "--max-skipped-steps", "3"], "4 steps in a row skipped"),
])
def test_mixed_precision_that_only_skips_stops(capsys, fixed_peak, flags, needle):
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--steps", "300", "--lr", "1e4", "--grad-clip", "0", "--warmup", "1"] + flags)
    err = capsys.readouterr().err
    assert e.value.code == 3 and err.count("\n") == 1 and needle in err, err


# ---------------------------------------------------------------- a rank that leaves: exit 4

@pytest.mark.parametrize("n,code", [(1, 0), (2, 0), (4, 7)])
def test_a_rank_that_exits_mid_run_ends_the_job_within_seconds(tmp_path, n, code):
    flags, rank = LAYOUTS[n]
    p = launch(n, flags + ["--steps", "8"], f"kind=exit,code={code},rank={rank},step=2", tmp_path)
    assert p.returncode == 4 and p.seconds < HANG, (p.returncode, p.seconds, p.stderr)
    assert f"minipar.train: rank {rank} left the run at step 2 (exit code {code}): ending every rank" in p.stderr
    assert "Traceback" not in p.stderr


def test_a_rank_killed_ends_the_job_within_seconds(tmp_path):
    """SIGKILL leaves the process no word to say: the launcher ends the job, naming the
    signal (docs/debugging.md: which PID its box names is not reliable)."""
    p = launch(4, LAYOUTS[4][0] + ["--steps", "8"], "kind=kill,rank=2,step=2", tmp_path)
    assert p.returncode == 9 and p.seconds < HANG, (p.returncode, p.seconds)
    assert "Killed (signal 9)" in p.stdout + p.stderr and "[rank 2] MINIPAR_FAULT: kill at step 2" in p.stderr


def test_an_exception_on_one_rank_ends_the_job_with_its_traceback(tmp_path):
    p = launch(4, ["--dp", "4", "--zero", "3", "--steps", "8"], "kind=raise,rank=1,step=2", tmp_path)
    assert p.returncode == 1 and p.seconds < HANG
    assert "[rank 1] RuntimeError: injected fault at step 2 on rank 1" in p.stderr


def test_a_rank_that_hangs_is_named_by_the_others_comm_timeout(tmp_path):
    p = launch(2, ["--dp", "2", "--steps", "8"], "kind=hang,rank=1,step=2", tmp_path, comm_timeout=3)
    assert p.returncode != 0 and p.seconds < HANG
    assert "gave up after" in p.stderr and "rank 1" in p.stderr, p.stderr


# ---------------------------------------------------------------- signals: exit 130 / 143

@pytest.mark.parametrize("n", [1, 2, 4])
def test_sigterm_on_one_rank_saves_and_resume_is_bit_identical(tmp_path, n):
    """What a preempting scheduler does: SIGTERM, then SIGKILL later. The step under way
    finishes, a checkpoint of it is written, every rank stops with exit 143; resuming from
    it to the end gives the uninterrupted run's weights and log rows, bit for bit."""
    flags, rank = LAYOUTS[n]
    base = flags + ["--steps", "7"]
    ref = launch(n, base + ["--save", "ref", "--log", "ref.jsonl"], None, tmp_path)
    assert ref.returncode == 0, ref.stderr
    p = launch(n, base + ["--save", "ck", "--log", "a.jsonl"], f"kind=sigterm,rank={rank},step=3", tmp_path)
    one_line(p, 143, "interrupted at step 4 (SIGTERM)", "steps 0..3 done",
             "checkpoint ck written: --resume ck continues at step 4")
    assert rows_of(tmp_path / "a.jsonl")[-1]["stopped"] is True
    q = launch(n, base + ["--resume", "ck", "--save", "ck", "--log", "b.jsonl"], None, tmp_path)
    assert q.returncode == 0, q.stderr
    assert_bit_identical(final_weights(tmp_path / "ck"), final_weights(tmp_path / "ref"))
    want, _ = read_log(tmp_path / "ref.jsonl")
    got = rows_of(tmp_path / "a.jsonl")[:-1] + read_log(tmp_path / "b.jsonl")[0]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in got] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in want]


def test_sigint_on_one_rank_stops_every_rank_with_one_line(tmp_path):
    p = launch(4, LAYOUTS[4][0] + ["--steps", "8", "--log", "log.jsonl"], "kind=sigint,rank=2,step=1", tmp_path)
    one_line(p, 130, "interrupted at step 2 (SIGINT)", "the log flushed")
    rows = rows_of(tmp_path / "log.jsonl")
    assert [r.get("step") for r in rows[:-1]] == [0, 1] and rows[-1]["exit_code"] == 130


def complete_rows(path) -> int:
    """Rows written whole so far: the trainer may be in the middle of writing the next one."""
    with open(path, encoding="utf-8") as f:
        return f.read().count("\n")


def wait_for_rows(path, k, proc, limit=60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit and proc.poll() is None:
        if os.path.exists(path) and complete_rows(path) >= k:
            return
        time.sleep(0.02)
    raise AssertionError(f"{path}: fewer than {k} rows after {limit} s (exit {proc.poll()})")


@pytest.mark.parametrize("n,sig,code", [(1, signal.SIGINT, 130), (2, signal.SIGINT, 130),
                                        (4, signal.SIGTERM, 143), (1, signal.SIGTERM, 143)])
def test_a_signal_to_mpirun_or_the_process_ends_the_job_cleanly(tmp_path, n, sig, code):
    """Ctrl-C (SIGINT to the launcher, which forwards it) or a scheduler's SIGTERM: one line,
    the exit code, the log ending with the stop; with SIGTERM a checkpoint of the step named."""
    flags, _ = LAYOUTS[n]
    proc = launch(n, flags + ["--steps", "100000", "--log", "log.jsonl", "--save", "ck"], None, tmp_path,
                  popen=True)
    try:
        wait_for_rows(tmp_path / "log.jsonl", 3, proc)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=HANG)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    line = one_line(p, code, "minipar.train: interrupted at step ", signal.Signals(sig).name)
    step = int(line.split("interrupted at step ")[1].split()[0])
    rows = rows_of(tmp_path / "log.jsonl")
    assert rows[-1]["stopped"] and rows[-2]["step"] == step - 1
    if sig == signal.SIGTERM:
        assert checkpoint.load(str(tmp_path / "ck"))[2]["step"] == step
    else:
        assert not os.path.exists(tmp_path / "ck")
    assert not os.path.exists(tmp_path / "ck.lock")


# ---------------------------------------------------------------- a full disk: exit 5

@pytest.fixture
def full_disk(tmp_path):
    """A 1 MiB tmpfs at tmp_path/disk (root only), unmounted however the test ends; fill()
    takes all of its space."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("a full disk needs a tmpfs mount: run as root (mount -t tmpfs)")

    def fill():
        fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        finally:
            os.close(fd)
    try:
        yield disk, fill
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_on_the_log_says_so_and_still_saves_the_checkpoint(tmp_path, full_disk, capsys, fixed_peak):
    disk, fill = full_disk
    fill()
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--steps", "6", "--log", str(disk / "log.jsonl"), "--save", str(tmp_path / "ck")])
    err = capsys.readouterr().err
    assert e.value.code == 5 and err.count("\n") == 1, err
    assert f"--log {disk}/log.jsonl: No space left on device" in err and "stopped after step 0" in err, err
    assert f"checkpoint {tmp_path}/ck written" in err
    assert checkpoint.load(str(tmp_path / "ck"))[2]["step"] == 1


def test_a_full_disk_on_the_trace_is_one_line(tmp_path, full_disk, capsys, fixed_peak):
    disk, fill = full_disk
    fill()
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--steps", "2", "--trace", str(disk / "t.json")])
    err = capsys.readouterr().err
    assert e.value.code == 5 and err.count("\n") == 1 and f"--trace {disk}/t.json: No space left" in err, err
    assert os.listdir(disk) == ["filler"]


def test_a_full_disk_on_the_checkpoint_keeps_the_last_good_one(tmp_path, full_disk, capsys, fixed_peak):
    disk, fill = full_disk
    ck = str(disk / "ck")
    train.main(TINY + ["--steps", "2", "--save", ck])
    fill()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(TINY + ["--steps", "4", "--resume", ck, "--save", ck])
    err = capsys.readouterr().err
    assert e.value.code == 5 and err.count("\n") == 1, err
    assert f"checkpoint {ck} not written" in err and "No space left on device" in err, err
    assert checkpoint.load(ck)[2]["step"] == 2
    assert sorted(os.listdir(disk)) == ["ck", "filler"]


def test_the_fault_injector_does_nothing_unset(monkeypatch):
    monkeypatch.delenv("MINIPAR_FAULT", raising=False)
    monkeypatch.setattr(faults, "_FAULTS", None)
    assert faults.load() == [] and faults.due(3, 0) == []
    monkeypatch.setattr(faults, "_FAULTS", faults.parse("kind=nan,rank=all,step=2; kind=exit,code=3,rank=1,step=4"))
    assert [f["kind"] for f in faults.due(2, 5)] == ["nan"] and faults.due(4, 1)[0]["code"] == 3
    assert faults.due(4, 0) == []



def test_the_signal_handlers_are_given_back(capsys, fixed_peak):
    """A test or a lab calls the trainer in its own process: after the run (however it ends)
    Ctrl-C is KeyboardInterrupt again, and SIGTERM what it was."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    train.main(TINY + ["--steps", "1"])
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    with pytest.raises(SystemExit):
        train.main(TINY + ["--lr", "nan"])
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_nan_loss_scale_is_below_every_floor():
    """`scale < floor` is False for NaN: the watch asks `not scale >= floor`."""
    from argparse import Namespace
    from minipar.train import stop
    w = stop.Watch(Namespace(max_skipped_steps=50, min_loss_scale=1.0))
    row = {"step": 4, "loss": 5.0, "grad_norm": float("nan"), "skipped": True}
    assert w.check(row, 2.0) is None
    assert "loss scale fell to nan" in w.check(dict(row, step=5), float("nan"))
