"""minipar.checkpoint (DESIGN 2.8): round trip, pickle-free loading, atomic save, clear errors.

A checkpoint is a directory DIR with model.npz, optim.npz and meta.json. A save writes
DIR.tmp, then renames DIR -> DIR.old and DIR.tmp -> DIR; the crash tests below break the
save at each point and check that `load` still returns the last complete checkpoint.
"""
import json
import os

import numpy as np
import pytest

from minipar import checkpoint
from minipar.checkpoint import CheckpointError

NAMES = ("wte.weight", "h.0.ln_1.bias", "h.0.attn.c_attn.weight")
SHAPES = ((8, 4), (4,), (4, 12))


def make_state(tag: float, dtype=np.float32):
    """A small, recognisable checkpoint: every array is filled from `tag`."""
    rng = np.random.default_rng(int(tag * 1000))
    model = {n: rng.standard_normal(s).astype(dtype) + tag for n, s in zip(NAMES, SHAPES)}
    optim = {"step": int(tag * 10),
             "m": {n: rng.standard_normal(s).astype(dtype) for n, s in zip(NAMES, SHAPES)},
             "v": {n: rng.random(s).astype(dtype) for n, s in zip(NAMES, SHAPES)}}
    meta = {"step": int(tag * 10), "config": {"n_layer": 1, "n_embd": 4}, "dtype": np.dtype(dtype).name,
            "seed": 7, "data": {"source": "builtin", "position": int(tag * 10)}}
    return model, optim, meta


def assert_loaded_equals(loaded, expected, what=""):
    (model, optim, meta), (em, eo, emeta) = loaded, expected
    assert sorted(model) == sorted(em), f"{what} model names {sorted(model)}"
    for n in em:
        assert model[n].dtype == em[n].dtype, f"{what} {n}: dtype {model[n].dtype} != {em[n].dtype}"
        np.testing.assert_array_equal(model[n], em[n], err_msg=f"{what} model {n}")
    assert optim["step"] == eo["step"], f"{what} optimizer step {optim['step']} != {eo['step']}"
    for key in ("m", "v"):
        assert sorted(optim[key]) == sorted(eo[key]), f"{what} optimizer {key} names {sorted(optim[key])}"
        for n in eo[key]:
            np.testing.assert_array_equal(optim[key][n], eo[key][n], err_msg=f"{what} optimizer {key}/{n}")
    for k, v in emeta.items():
        assert meta.get(k) == v, f"{what} meta[{k!r}] = {meta.get(k)!r}, expected {v!r}"


# ---------------------------------------------------------------- round trip

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_round_trip_model_optimizer_meta(tmp_path, dtype):
    d = str(tmp_path / "ckpt")
    state = make_state(1.5, dtype)
    checkpoint.save(d, *state)
    assert sorted(os.listdir(d)) == ["meta.json", "model.npz", "optim.npz"], os.listdir(d)
    assert_loaded_equals(checkpoint.load(d), state)
    assert not os.path.exists(d + ".tmp") and not os.path.exists(d + ".old"), \
        f"a finished save leaves {os.listdir(tmp_path)}"


def test_files_load_without_pickle(tmp_path):
    """Plain np.load(allow_pickle=False) and json.load read every file, with the documented keys."""
    d = tmp_path / "ckpt"
    model, optim, meta = make_state(2.0)
    checkpoint.save(str(d), model, optim, meta)
    with np.load(d / "model.npz", allow_pickle=False) as z:
        assert sorted(z.files) == sorted(NAMES)
        np.testing.assert_array_equal(z["wte.weight"], model["wte.weight"])
    with np.load(d / "optim.npz", allow_pickle=False) as z:
        expected = {"step"} | {f"m/{n}" for n in NAMES} | {f"v/{n}" for n in NAMES}
        assert set(z.files) == expected, f"optim.npz keys {sorted(z.files)}"
        assert int(z["step"]) == optim["step"]
        np.testing.assert_array_equal(z["v/h.0.ln_1.bias"], optim["v"]["h.0.ln_1.bias"])
    with open(d / "meta.json") as f:
        m = json.load(f)
    assert m["format"] == checkpoint.FORMAT_VERSION and m["step"] == meta["step"], m


UNPICKLED = []


def _record(tag):
    UNPICKLED.append(tag)
    return tag


class Payload:
    """Unpickling this calls _record: a stand-in for arbitrary code in a hostile file."""

    def __reduce__(self):
        return (_record, ("unpickled!",))


@pytest.mark.parametrize("victim", ["model.npz", "optim.npz"])
def test_object_array_is_refused_not_unpickled(tmp_path, victim):
    d = tmp_path / "ckpt"
    checkpoint.save(str(d), *make_state(1.0))
    hostile = {"wte.weight": np.array([Payload()], dtype=object)}
    if victim == "optim.npz":
        hostile = {"step": np.asarray(3), "m/wte.weight": np.array([Payload()], dtype=object)}
    np.savez(d / victim, **hostile)                      # np.savez pickles object arrays
    UNPICKLED.clear()
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(str(d))
    assert UNPICKLED == [], "the checkpoint loader ran pickle on an object array"
    assert str(d / victim) in str(e.value), f"the message does not name the file: {e.value}"


# ---------------------------------------------------------------- atomic save

def test_crash_while_writing_keeps_previous_checkpoint(tmp_path, monkeypatch):
    d = str(tmp_path / "ckpt")
    old = make_state(1.0)
    checkpoint.save(d, *old)

    real_write = checkpoint._write_npz

    def crash_on_optim(path, arrays):
        if path.endswith("optim.npz"):
            with open(path, "wb") as f:                  # half a file, then the crash
                f.write(b"PK\x03\x04 partial")
            raise OSError("simulated crash writing optim.npz")
        real_write(path, arrays)

    monkeypatch.setattr(checkpoint, "_write_npz", crash_on_optim)
    with pytest.raises(OSError, match="simulated"):
        checkpoint.save(d, *make_state(2.0))
    assert_loaded_equals(checkpoint.load(d), old, "after a crash mid-write:")

    monkeypatch.setattr(checkpoint, "_write_npz", real_write)
    new = make_state(3.0)
    checkpoint.save(d, *new)                             # the stale DIR.tmp is no obstacle
    assert_loaded_equals(checkpoint.load(d), new, "the save after the crash:")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], os.listdir(tmp_path)


def crash_rename_into(monkeypatch, directory):
    """Make os.rename(DIR.tmp -> DIR) fail: the crash between save's two renames."""
    real_rename = os.rename

    def rename(src, dst):
        if os.fspath(src).endswith(".tmp") and os.fspath(dst) == directory:
            raise OSError("simulated crash before DIR.tmp -> DIR")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    return real_rename


def test_crash_between_renames_falls_back_to_old(tmp_path, monkeypatch):
    d = str(tmp_path / "ckpt")
    old = make_state(1.0)
    checkpoint.save(d, *old)
    real_rename = crash_rename_into(monkeypatch, d)
    with pytest.raises(OSError, match="simulated"):
        checkpoint.save(d, *make_state(2.0))
    assert not os.path.exists(d) and os.path.isdir(d + ".old"), \
        f"expected DIR renamed away to DIR.old, found {sorted(os.listdir(tmp_path))}"
    assert_loaded_equals(checkpoint.load(d), old, "DIR.old fallback:")

    monkeypatch.setattr(os, "rename", real_rename)
    new = make_state(3.0)
    checkpoint.save(d, *new)
    assert_loaded_equals(checkpoint.load(d), new, "the save after the crash:")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], os.listdir(tmp_path)


def test_crash_on_first_rename_keeps_dir(tmp_path, monkeypatch):
    d = str(tmp_path / "ckpt")
    old = make_state(1.0)
    checkpoint.save(d, *old)
    real_rename = os.rename

    def rename(src, dst):
        if os.fspath(src) == d:
            raise OSError("simulated crash before DIR -> DIR.old")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="simulated"):
        checkpoint.save(d, *make_state(2.0))
    assert_loaded_equals(checkpoint.load(d), old, "crash before the first rename:")


def test_second_crash_while_only_old_exists_keeps_a_checkpoint(tmp_path, monkeypatch):
    """After a crash between the renames only DIR.old holds the last good checkpoint. The
    next save must not delete it before its own DIR.tmp has become DIR: a crash in that
    window would otherwise leave nothing that `load` can read."""
    d = str(tmp_path / "ckpt")
    old = make_state(1.0)
    checkpoint.save(d, *old)
    crash_rename_into(monkeypatch, d)
    with pytest.raises(OSError, match="simulated"):
        checkpoint.save(d, *make_state(2.0))              # now only DIR.old
    with pytest.raises(OSError, match="simulated"):
        checkpoint.save(d, *make_state(3.0))              # and crash at the same point again
    try:
        loaded = checkpoint.load(d)
    except CheckpointError as e:
        pytest.fail(f"two crashed saves left no loadable checkpoint ({e}); "
                    f"on disk: {sorted(os.listdir(tmp_path))}")
    assert_loaded_equals(loaded, old, "after two crashed saves:")


def test_stale_tmp_directory_is_replaced(tmp_path):
    d = str(tmp_path / "ckpt")
    os.makedirs(d + ".tmp")
    with open(os.path.join(d + ".tmp", "model.npz"), "wb") as f:
        f.write(b"truncated junk")
    with open(os.path.join(d + ".tmp", "stray.txt"), "w") as f:
        f.write("left by a crash")
    state = make_state(4.0)
    checkpoint.save(d, *state)
    assert sorted(os.listdir(d)) == ["meta.json", "model.npz", "optim.npz"], os.listdir(d)
    assert_loaded_equals(checkpoint.load(d), state)


# ---------------------------------------------------------------- corrupt and missing files

@pytest.fixture
def saved(tmp_path):
    d = tmp_path / "ckpt"
    checkpoint.save(str(d), *make_state(1.0))
    return d


def load_error(d) -> str:
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(str(d))
    return str(e.value)


@pytest.mark.parametrize("victim", ["model.npz", "optim.npz"])
def test_truncated_npz_names_the_file(saved, victim):
    path = saved / victim
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    msg = load_error(saved)
    assert str(path) in msg and "corrupt" in msg, msg


def test_flipped_byte_in_npz_is_detected(saved):
    path = saved / "model.npz"
    raw = bytearray(path.read_bytes())
    i = raw.find(b"\x93NUMPY") + 140                   # inside the first array's data
    raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert str(path) in load_error(saved)


@pytest.mark.parametrize("garbage", ["{not json", "", "\x00\x01\x02"])
def test_garbage_meta_names_the_file(saved, garbage):
    (saved / "meta.json").write_text(garbage)
    msg = load_error(saved)
    assert str(saved / "meta.json") in msg, msg


@pytest.mark.parametrize("content", ["null", "[1, 2]", '"a string"', '{"format": 1}'])
def test_meta_that_is_not_a_checkpoint_object_names_the_file(saved, content):
    """Valid JSON that is not an object with a step is as corrupt as invalid JSON. (The
    trainer treats meta None as 'no checkpoint' and restarts from step 0 without a word.)"""
    (saved / "meta.json").write_text(content)
    msg = load_error(saved)
    assert str(saved / "meta.json") in msg, msg


@pytest.mark.parametrize("victim", ["model.npz", "optim.npz", "meta.json"])
def test_missing_file_names_the_file(saved, victim):
    os.remove(saved / victim)
    msg = load_error(saved)
    assert str(saved / victim) in msg and "missing" in msg, msg


def test_missing_directory_names_it(tmp_path):
    msg = load_error(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in msg and "not found" in msg, msg


def test_optim_without_step_names_the_file(saved):
    with np.load(saved / "optim.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k != "step"}
    np.savez(saved / "optim.npz", **arrays)
    msg = load_error(saved)
    assert str(saved / "optim.npz") in msg and "step" in msg, msg
