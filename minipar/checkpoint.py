"""Checkpoints (DESIGN 2.8): a directory with

    model.npz      consolidated canonical parameters {name: array}, in the run's dtype
    optim.npz      AdamW state by canonical name: "m/<name>", "v/<name>", and "step"
    meta.json      config, layout, step to resume at, data position, seeds

Everything is loaded with allow_pickle=False. A save is atomic: the files are written
into DIR.tmp, fsync'ed, then DIR.tmp replaces DIR by two renames (DIR -> DIR.old,
DIR.tmp -> DIR). A crash at any point leaves either DIR or, between the two renames,
DIR.old as the last good checkpoint; `load` falls back to DIR.old in that window.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not match the run."""


def _write_npz(path: str, arrays: dict):
    with open(path, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: str, model_state: dict, optim_state: dict, meta: dict):
    """Write a checkpoint atomically. optim_state: {"step": int, "m": {name: arr}, "v": {...}}."""
    directory = os.path.abspath(directory)
    tmp, old = directory + ".tmp", directory + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    _write_npz(os.path.join(tmp, "model.npz"), model_state)
    opt = {"step": np.asarray(optim_state["step"], dtype=np.int64)}
    opt.update({f"m/{n}": a for n, a in optim_state["m"].items()})
    opt.update({f"v/{n}": a for n, a in optim_state["v"].items()})
    _write_npz(os.path.join(tmp, "optim.npz"), opt)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"format": FORMAT_VERSION, **meta}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if os.path.exists(directory):                   # only now may an older DIR.old go
        shutil.rmtree(old, ignore_errors=True)
        os.rename(directory, old)
    os.rename(tmp, directory)
    _fsync_dir(os.path.dirname(directory))
    shutil.rmtree(old, ignore_errors=True)


def _read_npz(path: str) -> dict:
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        with open(path, "rb") as f, np.load(f, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except Exception as e:  # zipfile.BadZipFile, ValueError, OSError ...
        raise CheckpointError(f"checkpoint file {path} is corrupt: {type(e).__name__}: {e}") from None


def load(directory: str):
    """-> (model_state, optim_state, meta). Raises CheckpointError naming the file."""
    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        if os.path.isdir(directory + ".old"):        # crashed between the two renames of save()
            directory += ".old"
        else:
            raise CheckpointError(f"checkpoint directory {directory} not found")
    meta_path = os.path.join(directory, "meta.json")
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"checkpoint file {meta_path} is missing")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {meta_path} is corrupt: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or "config" not in meta:
        raise CheckpointError(f"checkpoint file {meta_path} is corrupt: not a minipar checkpoint "
                              f"(needs an object with 'step' and 'config')")
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint file {meta_path} has format {meta.get('format')!r}, "
                              f"this minipar reads format {FORMAT_VERSION}")
    model_state = _read_npz(os.path.join(directory, "model.npz"))
    opt = _read_npz(os.path.join(directory, "optim.npz"))
    if "step" not in opt:
        raise CheckpointError(f"checkpoint file {os.path.join(directory, 'optim.npz')} has no 'step'")
    optim_state = {
        "step": int(opt["step"]),
        "m": {k[2:]: a for k, a in opt.items() if k.startswith("m/")},
        "v": {k[2:]: a for k, a in opt.items() if k.startswith("v/")},
    }
    return model_state, optim_state, meta
