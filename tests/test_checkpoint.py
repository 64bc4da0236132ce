"""minipar.train.checkpoint (docs/design.md §9): round trip, pickle-free loading, resharding from any set
of shards, atomic save, clear errors.

A checkpoint is a directory DIR with meta.json, model.npz and optim/rank-NNNNN.npz (one
optimizer shard per writing rank: index, m, v, step). A save writes DIR.tmp, then renames
DIR -> DIR.old and DIR.tmp -> DIR; the crash tests below break the save at each point and
check that `load` still returns the last complete checkpoint. The multi-rank save (every
rank writes, all agree, rank 0 commits) is tested under mpirun in test_failing_cleanly.py
and test_checkpoint_layouts.py.
"""
import json
import os
import shutil

import numpy as np
import pytest

from minipar.train import checkpoint
from minipar.train.checkpoint import CheckpointError

PARAMS = [("wte.weight", (8, 4)), ("h.0.ln_1.bias", (4,)), ("h.0.attn.c_attn.weight", (4, 12))]
NAMES = [n for n, _ in PARAMS]
P = 8 * 4 + 4 + 4 * 12
SHARD = "optim/rank-00000.npz"


def make_state(tag: float, dtype=np.float32):
    """A small, recognisable checkpoint: every array is filled from `tag`."""
    rng = np.random.default_rng(int(tag * 1000))
    model = {n: rng.standard_normal(s).astype(dtype) + tag for n, s in PARAMS}
    optim = {"step": int(tag * 10),
             "m": {n: rng.standard_normal(s).astype(dtype) for n, s in PARAMS},
             "v": {n: rng.random(s).astype(dtype) for n, s in PARAMS}}
    meta = {"step": int(tag * 10), "config": {"n_layer": 1, "n_embd": 4}, "dtype": np.dtype(dtype).name,
            "seed": 7, "data": {"source": "builtin", "position": int(tag * 10)}}
    return model, optim, meta


def save(d, state):
    """One process: the whole optimizer state in one shard (index 0..P-1)."""
    model, optim, meta = state
    checkpoint.save(str(d), model, checkpoint.full_shard(PARAMS, optim), meta)


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
            assert optim[key][n].dtype == eo[key][n].dtype, f"{what} {key}/{n} dtype {optim[key][n].dtype}"
            np.testing.assert_array_equal(optim[key][n], eo[key][n], err_msg=f"{what} optimizer {key}/{n}")
    for k, v in emeta.items():
        assert meta.get(k) == v, f"{what} meta[{k!r}] = {meta.get(k)!r}, expected {v!r}"


def write_shards(d, optim, indices, pad_value=999.0):
    """Replace checkpoint d's optimizer shards by one file per index array (-1: padding,
    filled with pad_value), as some layout would have written them; update meta.json."""
    flat_m = np.concatenate([optim["m"][n].ravel() for n in NAMES])
    flat_v = np.concatenate([optim["v"][n].ravel() for n in NAMES])
    shutil.rmtree(d / "optim")
    os.makedirs(d / "optim")
    listed = {}
    for r, index in enumerate(indices):
        index = np.asarray(index, dtype=np.int64)
        m = np.where(index >= 0, flat_m[index], pad_value).astype(flat_m.dtype)
        v = np.where(index >= 0, flat_v[index], pad_value).astype(flat_v.dtype)
        np.savez(d / checkpoint.shard_name(r), index=index, m=m, v=v, step=np.asarray(optim["step"]))
        listed[checkpoint.shard_name(r)] = int(index.size)
    edit_meta(d, lambda meta: meta["optimizer"].update(shards=listed))


def edit_meta(d, change):
    meta = json.loads((d / "meta.json").read_text())
    change(meta)
    (d / "meta.json").write_text(json.dumps(meta))


# ---------------------------------------------------------------- round trip

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_round_trip_model_optimizer_meta(tmp_path, dtype):
    d = tmp_path / "ckpt"
    state = make_state(1.5, dtype)
    save(d, state)
    assert sorted(os.listdir(d)) == ["MINIPAR-CHECKPOINT", "meta.json", "model.npz", "optim"], os.listdir(d)
    assert os.listdir(d / "optim") == ["rank-00000.npz"], os.listdir(d / "optim")
    assert_loaded_equals(checkpoint.load(str(d)), state)
    assert not os.path.exists(str(d) + ".tmp") and not os.path.exists(str(d) + ".old"), \
        f"a finished save leaves {os.listdir(tmp_path)}"


def test_files_load_without_pickle(tmp_path):
    """Plain np.load(allow_pickle=False) and json.load read every file, with the documented keys."""
    d = tmp_path / "ckpt"
    model, optim, meta = make_state(2.0)
    save(d, (model, optim, meta))
    with np.load(d / "model.npz", allow_pickle=False) as z:
        assert list(z.files) == NAMES, z.files                  # canonical order kept
        np.testing.assert_array_equal(z["wte.weight"], model["wte.weight"])
    with np.load(d / SHARD, allow_pickle=False) as z:
        assert sorted(z.files) == ["index", "m", "step", "v"], f"shard keys {sorted(z.files)}"
        np.testing.assert_array_equal(z["index"], np.arange(P))
        assert z["index"].dtype == np.int64 and int(z["step"]) == optim["step"]
        np.testing.assert_array_equal(z["v"][8 * 4:8 * 4 + 4], optim["v"]["h.0.ln_1.bias"])
    with open(d / "meta.json") as f:
        m = json.load(f)
    assert m["format"] == checkpoint.FORMAT_VERSION == 2 and m["step"] == meta["step"], m
    assert m["optimizer"] == {"step": optim["step"], "dtype": "float32", "elements": P,
                              "params": [[n, list(s)] for n, s in PARAMS], "shards": {SHARD: P}}, m["optimizer"]


UNPICKLED = []


def _record(tag):
    UNPICKLED.append(tag)
    return tag


class Payload:
    """Unpickling this calls _record: a stand-in for arbitrary code in a hostile file."""

    def __reduce__(self):
        return (_record, ("unpickled!",))


@pytest.mark.parametrize("victim", ["model.npz", SHARD])
def test_object_array_is_refused_not_unpickled(tmp_path, victim):
    d = tmp_path / "ckpt"
    save(d, make_state(1.0))
    hostile = {"wte.weight": np.array([Payload()], dtype=object)}
    if victim == SHARD:
        hostile = {"step": np.asarray(10), "index": np.arange(1), "m": np.array([Payload()], dtype=object),
                   "v": np.zeros(1)}
    np.savez(d / victim, **hostile)                      # np.savez pickles object arrays
    UNPICKLED.clear()
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(str(d))
    assert UNPICKLED == [], "the checkpoint loader ran pickle on an object array"
    assert str(d / victim) in str(e.value), f"the message does not name the file: {e.value}"


# ---------------------------------------------------------------- any set of shards

LAYOUTS = {
    # two ranks, each half of the flat vector
    "halves": lambda: [np.arange(0, P // 2), np.arange(P // 2, P)],
    # three ranks, strided, with padding (-1) and every element of h.0.ln_1.bias held twice
    # (a tensor-parallel replicated parameter), in no particular order
    "strided-padded-replicated": lambda: [
        np.concatenate([np.arange(r, P, 3)[::-1], np.arange(32, 36), [-1] * r]) for r in range(3)],
    # one shard per element, shuffled
    "one-element-each": lambda: list(np.random.default_rng(0).permutation(P).reshape(P, 1)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_any_set_of_shards_is_scattered_back_to_the_canonical_state(tmp_path, layout):
    d = tmp_path / "ckpt"
    state = make_state(1.0, np.float64)
    save(d, state)
    write_shards(d, state[1], LAYOUTS[layout]())
    assert_loaded_equals(checkpoint.load(str(d)), state, f"{layout}:")


def load_error(d) -> str:
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(str(d))
    return str(e.value)


@pytest.fixture
def saved(tmp_path):
    d = tmp_path / "ckpt"
    save(d, make_state(1.0))
    return d


def test_incomplete_coverage_names_the_first_missing_element(saved):
    optim = make_state(1.0)[1]
    write_shards(saved, optim, [np.arange(0, 40), np.arange(41, P), [-1, -1]])   # element 40 lost
    msg = load_error(saved)
    # element 40 = h.0.attn.c_attn.weight (starts at 36), flat 4 -> [0, 4]
    assert "incomplete" in msg and f"cover {P - 1:,} of {P:,} elements" in msg, msg
    assert "h.0.attn.c_attn.weight[0, 4]" in msg and str(saved) in msg, msg


@pytest.mark.parametrize("what", ["index-vs-m", "meta-vs-shard"])
def test_sizes_that_disagree_name_the_file(saved, what):
    path = saved / SHARD
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    if what == "index-vs-m":
        arrays["m"] = arrays["m"][:-3]
    else:
        arrays = {k: (a if k == "step" else a[:-3]) for k, a in arrays.items()}
    np.savez(path, **arrays)
    msg = load_error(saved)
    assert str(path) in msg and f"meta.json lists {P}" in msg, msg
    assert (f"index has {P} elements, m {P - 3}" if what == "index-vs-m" else f"index has {P - 3}") in msg, msg


@pytest.mark.parametrize("bad,needle", [([P], f"outside -1 .. {P - 1}"), ([-2], "from -2")])
def test_index_out_of_range_names_the_file(saved, bad, needle):
    optim = make_state(1.0)[1]
    write_shards(saved, optim, [np.arange(P)])
    with np.load(saved / SHARD) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["index"][5] = bad[0]
    np.savez(saved / SHARD, **arrays)
    msg = load_error(saved)
    assert str(saved / SHARD) in msg and needle in msg, msg


def test_shard_from_another_save_is_refused(saved):
    with np.load(saved / SHARD) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["step"] = np.asarray(3)
    np.savez(saved / SHARD, **arrays)
    msg = load_error(saved)
    assert str(saved / SHARD) in msg and "Adam step 3, meta.json says 10" in msg, msg


def test_shards_of_different_dtypes_are_refused(saved):
    optim = make_state(1.0)[1]
    write_shards(saved, optim, [np.arange(0, 40), np.arange(40, P)])
    second = saved / checkpoint.shard_name(1)
    with np.load(second) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["m"] = arrays["m"].astype(np.float64)
    np.savez(second, **arrays)
    msg = load_error(saved)
    assert str(second) in msg and "float64" in msg and "float32" in msg, msg


def test_shard_without_an_array_names_the_file(saved):
    with np.load(saved / SHARD) as z:
        arrays = {k: z[k] for k in z.files if k != "v"}
    np.savez(saved / SHARD, **arrays)
    msg = load_error(saved)
    assert str(saved / SHARD) in msg and "no 'v' array" in msg, msg


@pytest.mark.parametrize("change", [
    lambda m: m.pop("optimizer"),
    lambda m: m["optimizer"].update(shards={}),
    lambda m: m["optimizer"].update(shards={"../../etc/passwd": 3}),
    lambda m: m["optimizer"].update(params="wte.weight"),
], ids=["no-optimizer", "no-shards", "shard-outside-the-checkpoint", "params-not-a-list"])
def test_bad_optimizer_entry_names_meta_json(saved, change):
    edit_meta(saved, change)
    msg = load_error(saved)
    assert str(saved / "meta.json") in msg and "'optimizer' entry" in msg, msg


def test_model_npz_that_does_not_match_the_parameter_list_names_both_shapes(saved):
    model = make_state(1.0)[0]
    model["h.0.ln_1.bias"] = np.zeros(5, np.float32)
    np.savez(saved / "model.npz", **model)
    msg = load_error(saved)
    assert str(saved / "model.npz") in msg and "h.0.ln_1.bias has shape (5,), the model's is (4,)" in msg, msg


def test_other_formats_are_refused(tmp_path):
    """A meta.json of another format than this minipar writes: a one-line error naming it."""
    d = tmp_path / "old"
    model, optim, meta = make_state(2.5)
    save(d, (model, optim, meta))
    for fmt in (1, 3):
        (d / "meta.json").write_text(json.dumps({**json.loads((d / "meta.json").read_text()), "format": fmt}))
        msg = load_error(d)
        assert f"format {fmt}" in msg and "reads formats 2" in msg and str(d / "meta.json") in msg, msg


# ---------------------------------------------------------------- atomic save

def test_crash_while_writing_keeps_previous_checkpoint(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    old = make_state(1.0)
    save(d, old)

    real_write = checkpoint._write_npz

    def crash_on_shard(path, arrays):
        if path.endswith(SHARD):
            with open(path, "wb") as f:                  # half a file, then the crash
                f.write(b"PK\x03\x04 partial")
            raise OSError("simulated crash writing the optimizer shard")
        real_write(path, arrays)

    monkeypatch.setattr(checkpoint, "_write_npz", crash_on_shard)
    with pytest.raises(OSError, match="simulated"):
        save(d, make_state(2.0))
    assert_loaded_equals(checkpoint.load(str(d)), old, "after a crash mid-write:")

    monkeypatch.setattr(checkpoint, "_write_npz", real_write)
    new = make_state(3.0)
    save(d, new)                                         # the stale DIR.tmp is no obstacle
    assert_loaded_equals(checkpoint.load(str(d)), new, "the save after the crash:")
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
    save(d, old)
    real_rename = crash_rename_into(monkeypatch, d)
    with pytest.raises(OSError, match="simulated"):
        save(d, make_state(2.0))
    assert not os.path.exists(d) and os.path.isdir(d + ".old"), \
        f"expected DIR renamed away to DIR.old, found {sorted(os.listdir(tmp_path))}"
    assert_loaded_equals(checkpoint.load(d), old, "DIR.old fallback:")

    monkeypatch.setattr(os, "rename", real_rename)
    new = make_state(3.0)
    save(d, new)
    assert_loaded_equals(checkpoint.load(d), new, "the save after the crash:")
    assert sorted(os.listdir(tmp_path)) == ["ckpt"], os.listdir(tmp_path)


def test_crash_on_first_rename_keeps_dir(tmp_path, monkeypatch):
    d = str(tmp_path / "ckpt")
    old = make_state(1.0)
    save(d, old)
    real_rename = os.rename

    def rename(src, dst):
        if os.fspath(src) == d:
            raise OSError("simulated crash before DIR -> DIR.old")
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="simulated"):
        save(d, make_state(2.0))
    assert_loaded_equals(checkpoint.load(d), old, "crash before the first rename:")


def test_second_crash_while_only_old_exists_keeps_a_checkpoint(tmp_path, monkeypatch):
    """After a crash between the renames only DIR.old holds the last good checkpoint. The
    next save must not delete it before its own DIR.tmp has become DIR: a crash in that
    window would otherwise leave nothing that `load` can read."""
    d = str(tmp_path / "ckpt")
    old = make_state(1.0)
    save(d, old)
    crash_rename_into(monkeypatch, d)
    with pytest.raises(OSError, match="simulated"):
        save(d, make_state(2.0))                          # now only DIR.old
    with pytest.raises(OSError, match="simulated"):
        save(d, make_state(3.0))                          # and crash at the same point again
    try:
        loaded = checkpoint.load(d)
    except CheckpointError as e:
        pytest.fail(f"two crashed saves left no loadable checkpoint ({e}); "
                    f"on disk: {sorted(os.listdir(tmp_path))}")
    assert_loaded_equals(loaded, old, "after two crashed saves:")


def test_stale_tmp_directory_is_replaced(tmp_path):
    """A crashed save's DIR.tmp (its marker written first) is replaced; a DIR.tmp, DIR.old or
    DIR that minipar did not write is refused and left as it was."""
    d = str(tmp_path / "ckpt")
    for other in (d + ".tmp", d + ".old", d):
        os.makedirs(other)
        with open(os.path.join(other, "thesis.tex"), "w") as f:
            f.write("not minipar's")
        with pytest.raises(checkpoint.CheckpointError, match="not a checkpoint minipar wrote"):
            save(d, make_state(4.0))
        assert os.listdir(other) == ["thesis.tex"]
        shutil.rmtree(other)
    os.makedirs(os.path.join(d + ".tmp", "optim"))
    open(os.path.join(d + ".tmp", "MINIPAR-CHECKPOINT"), "w").close()
    with open(os.path.join(d + ".tmp", "model.npz"), "wb") as f:
        f.write(b"truncated junk")
    with open(os.path.join(d + ".tmp", "optim", "rank-00007.npz"), "w") as f:
        f.write("a shard of a crashed save on more ranks")
    state = make_state(4.0)
    save(d, state)
    assert sorted(os.listdir(d)) == ["MINIPAR-CHECKPOINT", "meta.json", "model.npz", "optim"], os.listdir(d)
    assert os.listdir(os.path.join(d, "optim")) == ["rank-00000.npz"]
    assert_loaded_equals(checkpoint.load(d), state)


# ---------------------------------------------------------------- corrupt and missing files

@pytest.mark.parametrize("victim", ["model.npz", SHARD])
def test_truncated_npz_names_the_file(saved, victim):
    path = saved / victim
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    msg = load_error(saved)
    assert str(path) in msg and "corrupt" in msg, msg


@pytest.mark.parametrize("victim", ["model.npz", SHARD])
def test_garbage_npz_names_the_file(saved, victim):
    (saved / victim).write_text("not a zip file at all")
    msg = load_error(saved)
    assert str(saved / victim) in msg and "corrupt" in msg, msg


@pytest.mark.parametrize("victim", ["model.npz", SHARD])
def test_flipped_byte_in_npz_is_detected(saved, victim):
    path = saved / victim
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


@pytest.mark.parametrize("content", ["null", "[1, 2]", '"a string"', '{"format": 2}'])
def test_meta_that_is_not_a_checkpoint_object_names_the_file(saved, content):
    """Valid JSON that is not an object with a step is as corrupt as invalid JSON. (The
    trainer treats meta None as 'no checkpoint' and restarts from step 0 without a word.)"""
    (saved / "meta.json").write_text(content)
    msg = load_error(saved)
    assert str(saved / "meta.json") in msg, msg


@pytest.mark.parametrize("victim", ["model.npz", SHARD, "meta.json"])
def test_missing_file_names_the_file(saved, victim):
    os.remove(saved / victim)
    msg = load_error(saved)
    assert str(saved / victim) in msg and "missing" in msg, msg


def test_missing_directory_names_it(tmp_path):
    msg = load_error(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in msg and "not found" in msg, msg
