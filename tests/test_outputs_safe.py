"""Nothing a run writes destroys what it did not create (minipar/config/outputs.py), and every flag
is checked before anything runs (docs/debugging.md has the table of messages and exit codes).

Each refused case runs train.main in process on a folder of the user's files and checks the
one line, exit code 2, and that every file of the user's is still there, byte for byte.
"""
import hashlib
import json
import math
import os

import numpy as np
import pytest

from minipar.train import checkpoint, faults, setup, trainer as train
from minipar.config import outputs
from minipar.plan import memory
from minipar.plot import curves as plot

from trainer_runs import TINY, assert_main_exits_2, read_log


def snapshot(root) -> dict:
    """{relative path: sha256 or the kind of thing it is}: everything under root."""
    seen = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(folder, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                seen[rel] = "link -> " + os.readlink(p)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    seen[rel] = hashlib.sha256(f.read()).hexdigest()
            else:
                seen[rel] = "folder" if os.path.isdir(p) else "special"
    return seen


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A user's folder, the working directory: a corpus, a thesis folder, a FIFO, and a
    checkpoint minipar wrote (ck/)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text("the user's corpus, the only copy. " * 200)
    (tmp_path / "thesis").mkdir()
    (tmp_path / "thesis" / "chapter1.tex").write_text("three years of work")
    (tmp_path / "results").mkdir()
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "notes.txt").write_text("keep me")
    train.run(train.build_parser().parse_args(TINY + ["--steps", "2", "--save", "ck", "--data", "corpus.txt"]))
    return tmp_path


# (flags, what the one line must name)
REFUSED = [
    (["--save", "thesis"], ["--save folder thesis", "not a checkpoint minipar wrote", "chapter1.tex"]),
    (["--save", "."], ["--save .", "the working directory", "corpus.txt"]),
    (["--save", os.path.join("thesis", "..")], ["the working directory"]),
    (["--save", "results", "--data", "results/c.txt"], ["--data results/c.txt", "holds"]),
    (["--save", "notes.txt"], ["--save notes.txt exists and is not a directory"]),
    (["--data", "corpus.txt", "--log", "corpus.txt"], ["--log corpus.txt is --data corpus.txt"]),
    (["--data", "corpus.txt", "--trace", "corpus.txt"], ["--trace corpus.txt is --data corpus.txt"]),
    (["--resume", "ck", "--log", "ck/meta.json"], ["--log ck/meta.json is inside --resume ck"]),
    (["--resume", "ck", "--save", "ck2", "--trace", "ck/optim"], ["--trace ck/optim is inside --resume ck"]),
    (["--save", "out", "--log", "out/log.jsonl"], ["--save out holds --log out/log.jsonl", "two outputs"]),
    (["--log", "a.jsonl", "--trace", "a.jsonl"], ["--log a.jsonl is --trace a.jsonl", "two outputs"]),
    (["--trace", "/dev/null"], ["--trace /dev/null is a device"]),
    (["--log", "pipe"], ["--log pipe is a FIFO"]),
    (["--trace", "thesis"], ["--trace thesis is a folder"]),
    (["--data", "corpus.txt", "--log", "hardlink.txt"], ["--log hardlink.txt is --data corpus.txt"]),
    (["--save", "out", "--log", "out.lock"], ["--save's lock out.lock is --log out.lock", "a save would remove it"]),
    (["--save", "out", "--trace", "out.tmp/t.json"], ["--save's temporary out.tmp holds --trace out.tmp/t.json"]),
    (["--resume", "ck.old", "--save", "ck"], ["--save's previous ck.old is --resume ck.old"]),
    (["--data", "pipe"], ["data file 'pipe' is not a regular file"]),
    (["--data", "thesis"], ["data file 'thesis' is a directory"]),
]


@pytest.mark.parametrize("flags,needles", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_an_output_that_would_destroy_something_is_refused(home, capsys, fixed_peak, flags, needles):
    if "hardlink.txt" in flags:
        os.link(home / "corpus.txt", home / "hardlink.txt")
    if "ck.old" in flags:
        os.rename(home / "ck", home / "ck.old")
    if "results/c.txt" in flags:
        (home / "results" / "c.txt").write_text("a corpus inside the folder to save to " * 50)
    before = snapshot(home)
    assert_main_exits_2(TINY + flags, needles, capsys, " ".join(flags))
    assert snapshot(home) == before, "a refused run changed the user's files"


@pytest.mark.parametrize("beside", [".tmp", ".old", ".lock"])
def test_the_paths_beside_save_are_checked_too(home, capsys, fixed_peak, beside):
    """A save writes DIR.tmp, renames DIR to DIR.old and locks DIR.lock: a user's file or
    folder of that name is refused, not removed."""
    (home / ("out" + beside)).mkdir() if beside != ".lock" else None
    target = home / ("out" + beside) / "mine.txt" if beside != ".lock" else home / "out.lock"
    target.write_text("the user's")
    before = snapshot(home)
    assert_main_exits_2(TINY + ["--save", "out"], [f"out{beside}"], capsys, beside)
    assert snapshot(home) == before


def test_a_link_to_a_users_folder_is_not_a_checkpoint(home, capsys, fixed_peak):
    os.symlink("thesis", home / "link")
    before = snapshot(home)
    assert_main_exits_2(TINY + ["--save", "link"], ["--save path link is a link (to thesis)"], capsys, "link")
    assert snapshot(home) == before


def test_save_replaces_its_own_checkpoint_and_may_continue_the_resumed_one(home, fixed_peak):
    """A folder minipar wrote (its marker) is replaced; --save equal to --resume continues it;
    a checkpoint from before the marker (meta.json with a "format") is minipar's too."""
    assert outputs.is_minipar_checkpoint(str(home / "ck"))
    train.run(train.build_parser().parse_args(TINY + ["--steps", "3", "--resume", "ck", "--save", "ck",
                                                      "--data", "corpus.txt"]))
    assert checkpoint.load(str(home / "ck"))[2]["step"] == 3
    os.remove(home / "ck" / outputs.MARKER)
    assert outputs.is_minipar_checkpoint(str(home / "ck"))
    train.run(train.build_parser().parse_args(TINY + ["--steps", "2", "--save", "ck", "--data", "corpus.txt"]))
    assert (home / "ck" / outputs.MARKER).is_file() and not os.path.exists(home / "ck.lock")


def float_flags():
    return sorted(a.option_strings[0] for a in train.build_parser()._actions if a.type is float)


def test_there_are_float_flags_to_check():
    assert {"--lr", "--min-lr", "--weight-decay", "--grad-clip", "--bucket-mb"} <= set(float_flags())


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_every_float_flag_refuses_nan_and_infinity(capsys, fixed_peak, value):
    """NaN passes every `<= 0` check and inf every upper bound: both are refused by name,
    whatever the flag (each flag of the parser that takes a float)."""
    for flag in float_flags():
        assert_main_exits_2(TINY + [f"{flag}={value}"], [flag, "must be a finite number"], capsys, f"{flag} {value}")


@pytest.mark.parametrize("flags,needles", [
    (["--max-memory", "64KiB"], ["per rank by the planner's count", "more than the 64.00 KiB a rank may use (--max-memory 64KiB;"]),
    (["--n-embd", "200000", "--n-head", "2"], ["per rank by the planner's count", "MemTotal"]),
    (["--batch-size", "1000000000000"], ["per rank by the planner's count", "MemTotal"]),
    (["--max-memory", "lots"], ["--max-memory wants a size", "'lots'"]),
    (["--max-memory", "0.5"], ["--max-memory wants a size of at least a byte", "'0.5'"]),
    (["--moe-experts", "100000"], ["--moe-experts 100000 is more than 1024"]),
    (["--max-skipped-steps", "0"], ["--max-skipped-steps must be >= 1, got 0"]),
    (["--min-loss-scale", "0"], ["--min-loss-scale must be > 0, got 0.0"]),
    (["--precision", "fp16", "--loss-scale", "1", "--min-loss-scale", "2"], ["--loss-scale 1 is below --min-loss-scale 2"]),
])
@pytest.mark.parametrize("dry", [False, True])
def test_a_layout_too_large_is_refused_by_the_run_and_the_dry_run(capsys, fixed_peak, flags,
                                                                   needles, dry):
    assert_main_exits_2(TINY + flags + (["--dry-run"] if dry else []), needles, capsys, " ".join(flags))


def test_the_memory_figure_is_the_planners(capsys, fixed_peak):
    """The refusal quotes memory.peak_memory of this layout: a limit one byte above it passes."""
    from minipar.comm.ledger import human_bytes
    args = train.build_parser().parse_args(TINY)
    spec = setup.prepare(args, 1)
    need = memory.peak_memory(spec.cfg, spec.layout)
    assert_main_exits_2(TINY + ["--max-memory", str(need - 1)], [human_bytes(need)], capsys, "below")
    train.main(TINY + ["--max-memory", str(need), "--steps", "1"])


@pytest.mark.parametrize("spec,needle", [
    ("kind=melt,rank=0,step=1", "kind must be one of"),
    ("kind=nan,rank=0", "needs step=N"),
    ("kind=exit,rank=x,step=1", "needs step=N"),
])
def test_a_bad_fault_spec_is_one_line(capsys, fixed_peak, monkeypatch, spec, needle):
    monkeypatch.setenv("MINIPAR_FAULT", spec)
    monkeypatch.setattr(faults, "_FAULTS", None)
    assert_main_exits_2(TINY, ["MINIPAR_FAULT", needle], capsys, spec)


def test_plot_checks_its_figures_against_its_inputs(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    train.run(train.build_parser().parse_args(TINY + ["--steps", "2", "--log", str(log)]))
    os.replace(log, tmp_path / "loss.png")
    assert plot.main([str(tmp_path / "loss.png"), "--format", "png"]) == 2
    assert "is the log" in capsys.readouterr().err
    os.replace(tmp_path / "loss.png", log)
    os.mkfifo(tmp_path / "comm.svg")
    assert plot.main([str(log), "--format", "svg"]) == 2
    assert "comm.svg is a FIFO" in capsys.readouterr().err
    rows, _ = read_log(log)
    assert len(rows) == 2


# ---------------------------------------------------------------- the save lock

def test_a_second_run_saving_to_the_same_folder_stops_naming_the_first(tmp_path, capsys, fixed_peak):
    held = outputs.SaveLock(str(tmp_path / "ck"))          # another run's lock: a flock held
    try:
        assert_main_exits_2(TINY + ["--save", str(tmp_path / "ck")],
                            ["is being written by another run", f"pid {os.getpid()}"], capsys, "lock")
    finally:
        held.release()
    assert not os.path.exists(tmp_path / "ck")


def test_a_stale_lock_of_a_dead_run_is_taken_over(tmp_path, fixed_peak):
    (tmp_path / "ck.lock").write_text("minipar save lock: pid 999999 on nowhere, since 2020-01-01T00:00:00\n")
    train.run(train.build_parser().parse_args(TINY + ["--steps", "1", "--save", str(tmp_path / "ck")]))
    assert checkpoint.load(str(tmp_path / "ck"))[2]["step"] == 1
    assert not os.path.exists(tmp_path / "ck.lock")


# ---------------------------------------------------------------- checkpoints with NaN

def test_resume_refuses_a_checkpoint_holding_nan_naming_the_tensors(tmp_path, capsys, fixed_peak):
    ck = tmp_path / "ck"
    train.run(train.build_parser().parse_args(TINY + ["--steps", "1", "--save", str(ck)]))
    with np.load(ck / "model.npz", allow_pickle=False) as z:
        arrays = dict(z)
    name = sorted(arrays)[0]
    arrays[name].flat[0] = np.nan
    np.savez(ck / "model.npz", **arrays)
    capsys.readouterr()
    assert_main_exits_2(TINY + ["--resume", str(ck)], ["NaN or inf in 1 tensor", name, "not loaded"],
                        capsys, "nan checkpoint")


def test_a_state_holding_nan_is_never_saved(tmp_path):
    with pytest.raises(checkpoint.NotFinite, match="w2"):
        checkpoint.save(str(tmp_path / "ck"), {"w1": np.ones(2), "w2": np.array([1.0, math.inf])}, None,
                        {"step": 1})
    assert not os.path.exists(tmp_path / "ck")


def test_a_fallback_to_dir_old_is_announced(tmp_path, capsys, fixed_peak):
    """A save cut off between its two renames leaves DIR.old only: resuming says so."""
    ck = tmp_path / "ck"
    train.run(train.build_parser().parse_args(TINY + ["--steps", "2", "--save", str(ck)]))
    os.rename(ck, str(ck) + ".old")
    capsys.readouterr()
    train.main(TINY + ["--steps", "3", "--resume", str(ck)])
    out = capsys.readouterr().out
    assert f"checkpoint: {ck} is missing" in out and f"resuming from the one before it, {ck}.old" in out, out


def test_a_folder_without_files_holds_nothing_to_lose(tmp_path, fixed_peak):
    """An empty folder made for --save, and a DIR.tmp cut off before its marker (a SIGKILL
    between its mkdir and its first file) are replaced."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out.tmp" / "optim").mkdir(parents=True)
    train.run(train.build_parser().parse_args(TINY + ["--steps", "1", "--save", str(tmp_path / "out")]))
    assert checkpoint.load(str(tmp_path / "out"))[2]["step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_resume_refuses_a_loss_scaler_that_is_not_one(tmp_path, capsys, fixed_peak):
    """A NaN scale in meta.json would skip every step and never stop: refused, naming it."""
    ck = tmp_path / "ck"
    train.run(train.build_parser().parse_args(TINY + ["--steps", "1", "--precision", "fp16", "--save", str(ck)]))
    meta = json.loads((ck / "meta.json").read_text())
    meta["loss_scaler"]["scale"] = float("nan")
    (ck / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert_main_exits_2(TINY + ["--steps", "2", "--precision", "fp16", "--resume", str(ck)],
                        ["meta.json's loss_scaler", "'scale': nan", "is not a loss scaler's state"], capsys, "nan scale")
