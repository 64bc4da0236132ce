"""Nothing lost, proven: a run saving every step is killed (SIGKILL, no warning) at a random
moment, 20 times over; each time the newest complete checkpoint loads, and the run resumed
from it logs the same loss and gradient norm, bit for bit, as a run never interrupted, at every
step it runs. The killed runs go on from each other (--resume ck --save ck), so the kills land
in training, in a save, between a save's two renames (then DIR.old is the checkpoint, and
resuming says so), and with a stale lock and DIR.tmp left behind. After every fourth kill, the
last, and every kill that left DIR.old as the checkpoint, a run resumed from it goes on to the
end and its weights must be bit-identical to the uninterrupted run's (the other checkpoints
are resumed by the next killed run, whose steps are checked as they go).

MINIPAR_KILL_SEED picks other kill times (the seed is in the test's output). The seed fixes
when each kill is aimed (after 1 or 2 logged steps, then 0-15 ms); where it lands also
depends on the machine's timing, so the test prints how many kills fell inside a save.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

from minipar.train import checkpoint

from trainer_runs import REPO, TINY_MPI

KILLS = 20
STEPS = 60


def start(tmp, *flags):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("MINIPAR_FAULT", None)
    return subprocess.Popen([sys.executable, "-m", "minipar.train", *TINY_MPI, "--steps", str(STEPS),
                             "--log-every", "1000", *flags], cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, (proc.returncode, out[-2000:], err)
    return out


def rows(path) -> list:
    """The log's complete step rows (a killed run's last line may be cut short)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")[:-1]                     # the last, unterminated, is cut
    objs = [json.loads(line) for line in lines if line.strip()]
    return [o for o in objs if "step" in o and "loss" in o]


def test_twenty_kills_lose_nothing(tmp_path):
    seed = int(os.environ.get("MINIPAR_KILL_SEED", "2026"))
    print(f"MINIPAR_KILL_SEED={seed}")
    rng = np.random.default_rng(seed)
    finish(start(tmp_path, "--save", "ref", "--log", "ref.jsonl"))
    ref_model = checkpoint.load(str(tmp_path / "ref"))[0]
    ref_rows = {r["step"]: (r["loss"], r["grad_norm"]) for r in rows(tmp_path / "ref.jsonl")}
    fallbacks, in_a_save, steps_seen, to_the_end = 0, 0, [], 0
    for kill in range(KILLS):
        resume = ["--resume", "ck"] if os.path.exists(tmp_path / "ck") or os.path.exists(tmp_path / "ck.old") else []
        log = tmp_path / f"run{kill}.jsonl"
        proc = start(tmp_path, *resume, "--save", "ck", "--save-every", "1", "--log", log.name)
        try:
            want = int(rng.integers(1, 3))                    # 1 or 2 steps logged, then a moment
            t0 = time.monotonic()
            while len(rows(log)) < want and proc.poll() is None and time.monotonic() - t0 < 60:
                time.sleep(0.002)
            time.sleep(float(rng.uniform(0.0, 0.015)))
            assert proc.poll() is None, f"kill {kill}: the run ended before it was killed: {proc.stderr.read()}"
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        for r in rows(log):                                   # what it trained, as the reference did
            assert (r["loss"], r["grad_norm"]) == ref_rows[r["step"]], (kill, r["step"])
        in_a_save += any(os.path.exists(tmp_path / d) for d in ("ck.tmp", "ck.old"))   # killed in a save
        _, _, meta = checkpoint.load(str(tmp_path / "ck"))    # the newest complete one loads
        fallbacks += meta["loaded_from"].endswith(".old")
        steps_seen.append(meta["step"])
        if not (kill % 4 == 3 or kill == KILLS - 1 or meta["loaded_from"].endswith(".old")):
            continue                                          # the next killed run resumes it
        to_the_end += 1
        out = finish(start(tmp_path, "--resume", "ck", "--save", "end", "--log", "end.jsonl"))
        if meta["loaded_from"].endswith(".old"):
            assert "resuming from the one before it" in out, out
        end_model = checkpoint.load(str(tmp_path / "end"))[0]
        for name, a in ref_model.items():
            assert np.array_equal(end_model[name], a), (kill, meta["step"], name)
        got = rows(tmp_path / "end.jsonl")
        assert [r["step"] for r in got] == list(range(meta["step"], STEPS))
        for r in got:
            assert (r["loss"], r["grad_norm"]) == ref_rows[r["step"]], (kill, r["step"])
        shutil.rmtree(tmp_path / "end")
    assert steps_seen == sorted(steps_seen) and steps_seen[-1] < STEPS, steps_seen
    assert to_the_end >= KILLS // 4, to_the_end
    print(f"{KILLS} kills at checkpoint steps {steps_seen}; {in_a_save} in a save (ck.tmp or ck.old left), "
          f"{fallbacks} between its renames (ck.old); {to_the_end} resumed to the end")
