"""Every way a run can end early, run for real: the exit code, the seconds it took and the one
line it printed, as a Markdown table (docs/debugging.md's table is this script's output).

    python scripts/failure_table.py              # about a minute on 2 cores
    python scripts/failure_table.py --match SIG  # the cases whose name holds SIG

Each case runs in a fresh folder of its own (a user's folder with a corpus and a thesis in
it), as a user would run it: `python -m minipar.train` for one process, `mpirun -n N` for
more, faults from MINIPAR_FAULT, signals sent from outside. After each case the user's
files are compared with what they were: the `user's files` column says whether all are
intact. The full-disk cases need root (a tmpfs); without it they are left out, saying so.
Exits 1 if a case did not end with the exit code the docs give.
"""
import argparse
import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "16", "--batch-size", "8",
        "--sample", "0", "--log-every", "1000"]
FOUR = ["--dp", "2", "--pp", "2", "--zero", "1"]
FULL = "disk"                                   # a 1 MiB tmpfs mounted there, then filled

# (name, ranks, flags, MINIPAR_FAULT, what to do first, signal to mpirun after 3 rows, exit code)
CASES = [
    ("--save over a folder of the user's", 1, ["--save", "thesis"], None, None, None, 2),
    ("--save the working directory", 1, ["--save", "."], None, None, None, 2),
    ("--log over --data", 1, ["--data", "corpus.txt", "--log", "corpus.txt"], None, None, None, 2),
    ("--log inside --resume", 1, ["--resume", "ck", "--log", "ck/meta.json"], None, "ck", None, 2),
    ("--log inside --save", 1, ["--save", "out", "--log", "out/log.jsonl"], None, None, None, 2),
    ("--trace a device", 1, ["--trace", "/dev/null"], None, None, None, 2),
    ("--data a FIFO", 1, ["--data", "pipe"], None, None, None, 2),
    ("--lr nan", 4, FOUR + ["--lr", "nan"], None, None, None, 2),
    ("--bucket-mb inf", 4, ["--dp", "4", "--bucket-mb", "inf"], None, None, None, 2),
    ("a layout larger than the machine", 1, ["--n-embd", "200000"], None, None, None, 2),
    ("the same, --dry-run", 1, ["--batch-size", "1000000000000", "--dry-run"], None, None, None, 2),
    ("two runs, one --save", 1, ["--save", "ck"], None, "lock", None, 2),
    ("--resume a checkpoint holding NaN", 1, ["--resume", "ck"], None, "nan-ck", None, 2),
    ("a bad MINIPAR_FAULT", 1, [], "kind=melt,rank=0,step=1", None, None, 2),
    ("diverged: --lr 1e4 --grad-clip 0", 1, ["--lr", "1e4", "--grad-clip", "0", "--warmup", "1",
                                             "--steps", "100"], None, None, None, 3),
    ("diverged: NaN on rank 3 at step 3", 4, FOUR + ["--save", "ck", "--save-every", "1"],
     "kind=nan,rank=3,step=3", None, None, 3),
    ("diverged: fp16 scale below --min-loss-scale", 1, ["--precision", "fp16", "--lr", "1e4", "--grad-clip",
                                                        "0", "--warmup", "1", "--steps", "300"], None, None, None, 3),
    ("diverged: bf16 skipping", 2, ["--dp", "2", "--zero", "2", "--precision", "bf16", "--lr", "1e4",
                                    "--grad-clip", "0", "--warmup", "1", "--steps", "300"], None, None, None, 3),
    ("rank 2 calls sys.exit(0) at step 2", 4, FOUR, "kind=exit,code=0,rank=2,step=2", None, None, 4),
    ("rank 1 killed (SIGKILL) at step 2", 4, FOUR, "kind=kill,rank=1,step=2", None, None, 9),
    ("rank 1 raises at step 2", 4, FOUR, "kind=raise,rank=1,step=2", None, None, 1),
    ("rank 1 hangs at step 2 (MINIPAR_COMM_TIMEOUT=5)", 2, ["--dp", "2"], "kind=hang,rank=1,step=2", "timeout5",
     None, 1),
    ("SIGTERM to rank 3, with --save", 4, FOUR + ["--save", "ck"], "kind=sigterm,rank=3,step=3", None, None, 143),
    ("SIGINT (Ctrl-C) to mpirun", 4, FOUR + ["--steps", "100000"], None, None, signal.SIGINT, 130),
    ("SIGTERM to mpirun, with --save", 2, ["--dp", "2", "--steps", "100000", "--save", "ck"], None, None,
     signal.SIGTERM, 143),
    ("SIGINT to one process", 1, ["--steps", "100000"], None, None, signal.SIGINT, 130),
    ("--log on a full disk", 1, ["--log", f"{FULL}/log.jsonl", "--save", "ck"], None, "full", None, 5),
    ("--trace on a full disk", 1, ["--trace", f"{FULL}/t.json"], None, "full", None, 5),
    ("--save on a full disk", 1, ["--save", f"{FULL}/ck", "--resume", f"{FULL}/ck"], None, "full-ck", None, 5),
    ("resuming when a save was cut between its renames", 1, ["--resume", "ck"], None, "old", None, 0),
]


def snapshot(root) -> dict:
    seen = {}
    for folder, dirs, files in os.walk(root):
        for name in sorted(files):
            p = os.path.join(folder, name)
            if os.path.isfile(p) and not os.path.islink(p):
                with open(p, "rb") as f:
                    seen[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return seen


def command(n, flags):
    train = [sys.executable, "-m", "minipar.train", *TINY, *flags]
    return train if n == 1 else [os.path.join(BIN, "mpirun"), "-n", str(n), *train]


def env_for(fault, first):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONPATH=REPO)
    env.pop("MINIPAR_FAULT", None)
    if fault:
        env["MINIPAR_FAULT"] = fault
    if first == "timeout5":
        env["MINIPAR_COMM_TIMEOUT"] = "5"
    return env


def prepare(d, first, holder):
    """The user's folder, and what the case needs before it runs; -> mounted tmpfs or None."""
    with open(os.path.join(d, "corpus.txt"), "w") as f:
        f.write("the user's corpus, the only copy. " * 200)
    os.makedirs(os.path.join(d, "thesis"))
    with open(os.path.join(d, "thesis", "chapter1.tex"), "w") as f:
        f.write("three years of work")
    os.mkfifo(os.path.join(d, "pipe"))
    env = env_for(None, None)
    if first in ("ck", "nan-ck", "old", "lock"):
        subprocess.run(command(1, ["--steps", "2", "--save", "ck"]), cwd=d, env=env, capture_output=True, check=True)
    if first == "nan-ck":
        import numpy as np
        path = os.path.join(d, "ck", "model.npz")
        with np.load(path, allow_pickle=False) as z:
            arrays = dict(z)
        arrays[sorted(arrays)[0]].flat[0] = np.nan
        np.savez(path, **arrays)
    if first == "old":
        os.rename(os.path.join(d, "ck"), os.path.join(d, "ck.old"))
    if first == "lock":
        from minipar.config.outputs import SaveLock
        holder.append(SaveLock(os.path.join(d, "ck")))
    if first and first.startswith("full"):
        disk = os.path.join(d, FULL)
        os.makedirs(disk)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", disk], check=True)
        if first == "full-ck":
            subprocess.run(command(1, ["--steps", "2", "--save", f"{FULL}/ck"]), cwd=d, env=env, check=True,
                           capture_output=True)
        fd = os.open(os.path.join(disk, "filler"), os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:
            pass
        os.close(fd)
        return disk
    return None


def run_case(case, d):
    name, n, flags, fault, first, sig, _ = case
    holder = []
    mounted = prepare(d, first, holder)
    before = snapshot(d)
    t0 = time.monotonic()
    try:
        log = os.path.join(d, "log.jsonl")
        proc = subprocess.Popen(command(n, flags + (["--log", log] if sig else [])), cwd=d,
                                env=env_for(fault, first), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        if sig is not None:                         # after 3 steps are logged: the user's Ctrl-C
            while proc.poll() is None and time.monotonic() - t0 < 60 and rows(log) < 3:
                time.sleep(0.02)
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        for h in holder:
            h.release()
        if mounted:
            subprocess.run(["umount", "-l", mounted], check=False)
    seconds = time.monotonic() - t0
    after = snapshot(d)
    kept = all(after.get(k) == v for k, v in before.items() if not k.startswith(("ck", FULL)))
    return proc.returncode, seconds, the_line(out, err).replace(d + "/", "").replace(d, "."), kept


def rows(path) -> int:
    try:
        with open(path) as f:
            return f.read().count("\n")
    except OSError:
        return 0


def the_line(out, err) -> str:
    """The line that says why: minipar's own, or else the launcher's or the traceback's last."""
    for text in (err, out):
        for ln in text.splitlines():
            if ln.startswith(("minipar.train: ", "checkpoint: ")):
                return ln
    for ln in reversed((err + out).splitlines()):
        if "EXIT STRING" in ln or "CommTimeout" in ln or "Error" in ln:
            return ln.strip()
    return (err or out).strip().splitlines()[-1] if (err or out).strip() else ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--match", default="", help="only the cases whose name holds this text")
    a = ap.parse_args()
    root_ok = os.geteuid() == 0
    print("| case | ranks | exit code | seconds | user's files | the line |\n|---|---|---|---|---|---|")
    wrong = []
    for case in CASES:
        name, n, *_, code = case
        if a.match not in name:
            continue
        if case[4] and case[4].startswith("full") and not root_ok:
            print(f"| {name} | {n} | (left out: a tmpfs needs root) | | | |")
            continue
        with tempfile.TemporaryDirectory() as d:
            rc, seconds, line, kept = run_case(case, d)
        rc = -rc if rc < 0 else rc
        print(f"| {name} | {n} | {rc} | {seconds:.1f} | {'intact' if kept else 'CHANGED'} | "
              f"`{line}` |", flush=True)
        if rc != code or not kept:
            wrong.append(f"{name}: exit {rc}, want {code}" + ("" if kept else "; the user's files changed"))
    for w in wrong:
        print("WRONG:", w)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
