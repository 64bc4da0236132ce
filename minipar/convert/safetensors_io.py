"""Hugging Face's weight files, read and written with safetensors' NumPy API (no PyTorch).

A model directory holds its tensors in one file, or in shards listed by an index:

    model.safetensors                       every tensor
    model.safetensors.index.json            {"metadata": {"total_size": bytes},
                                             "weight_map": {tensor name: shard file}}
    model-00001-of-00003.safetensors, ...   the shards, each a safetensors file

A safetensors file is an 8-byte little-endian header length, a JSON header {name: {"dtype",
"shape", "data_offsets"}, "__metadata__": {...}}, then the bytes. The safetensors library
checks the header against the file (offsets inside it, in order, without gaps or overlaps, each
tensor's bytes the size its dtype and shape say) and its refusal is passed on naming the file.
Here: the index names only plain files that exist, and each of its tensors is in the file it
names; a tensor is in one file only; a file's dtypes are float64, float32, float16 or bfloat16
(NumPy has no bfloat16: ml_dtypes's, which safetensors uses); the metadata "format", when
there is one, is "pt" (PyTorch's layout; Flax's and TensorFlow's differ).

Written: one file, or shards of at most --max-shard-size bytes each (a bigger tensor alone in
its own) with the index, as save_pretrained writes them, with the metadata {"format": "pt"}
that from_pretrained requires.
"""
from __future__ import annotations

import json
import os
import re

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy

from minipar.convert.hf_names import ConvertError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"float64": np.dtype(np.float64), "float32": np.dtype(np.float32),
          "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_FILE_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
    """'5GB' (10^9 bytes, as transformers counts), '500MiB' (2^20), '1000' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m or float(m.group(1)) * _UNITS[(m.group(2) or "").upper()] < 1:
        raise ConvertError(f"--max-shard-size {text!r} is not a size: write e.g. 5GB, 500MB, 2GiB or a byte count")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def _regular_file(path: str, what: str):
    if not os.path.exists(path):
        raise ConvertError(f"{what} {path} is missing")
    if not os.path.isfile(path):
        raise ConvertError(f"{what} {path} is not a regular file")


def weight_files(hf_dir: str) -> dict:
    """{file path: [tensor names the index gives it] or None (a single file: all of them)}."""
    single, index = os.path.join(hf_dir, SINGLE), os.path.join(hf_dir, INDEX)
    if os.path.lexists(single) and os.path.lexists(index):
        raise ConvertError(f"{hf_dir} holds both {SINGLE} and {INDEX}: which are its weights? remove one")
    if os.path.lexists(single):
        _regular_file(single, "weight file")
        return {single: None}
    if not os.path.lexists(index):
        other_formats = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
        others = sorted(f for f in os.listdir(hf_dir) if f.endswith(other_formats))
        raise ConvertError(f"{hf_dir} holds neither {SINGLE} nor {INDEX}" + (
            f" (it holds {', '.join(others[:3])}: minipar reads safetensors only; transformers' "
            f"save_pretrained writes them)" if others else ""))
    _regular_file(index, "shard index")
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        ok = isinstance(weight_map, dict) and weight_map and all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConvertError(f"shard index {index} is not an index: {type(e).__name__}: {e}") from None
    if not ok:
        raise ConvertError(f"shard index {index} is not an index: its weight_map must map tensor names to file names")
    files = {}
    for name, file in weight_map.items():
        if file != os.path.basename(file) or file in (".", "..") or not file.endswith(".safetensors"):
            raise ConvertError(f"shard index {index} names {file!r} for {name}: a shard is a .safetensors file "
                               f"beside the index")
        files.setdefault(os.path.join(hf_dir, file), []).append(name)
    for path in files:
        if not os.path.isfile(path):
            raise ConvertError(f"shard index {index} names {os.path.basename(path)}, which "
                               f"{'is not a regular file' if os.path.exists(path) else 'is missing'}")
    return files


def read_file(path: str) -> dict:
    """{name: array} of one safetensors file, in its dtype, or ConvertError naming the file."""
    try:
        with safetensors.safe_open(path, framework="np") as f:
            fmt = (f.metadata() or {}).get("format")
            if fmt not in (None, "pt"):
                raise ConvertError(f"{path} was written by {fmt} (its metadata format): minipar reads "
                                   f"PyTorch's layout, format pt")
            kinds = {n: f.get_slice(n).get_dtype() for n in f.keys()}
            odd = {n: k for n, k in kinds.items() if k not in _FILE_DTYPES}
            if odd:
                n = next(iter(odd))
                raise ConvertError(f"{path}: tensor {n} is {odd[n]}: minipar reads F64, F32, F16 and BF16 tensors")
            return {n: np.array(f.get_tensor(n)) for n in f.keys()}
    except safetensors.SafetensorError as e:
        raise ConvertError(f"{path} is not a valid safetensors file: {e}") from None
    except OSError as e:
        raise ConvertError(f"{path} cannot be read: {e.strerror}") from None


def read(hf_dir: str, files: dict) -> dict:
    """Every tensor of a model directory, {name: array}, from its weight_files."""
    tensors, where = {}, {}
    for path, listed in files.items():
        got = read_file(path)
        if listed is not None:
            lost = [n for n in listed if n not in got]
            if lost:
                raise ConvertError(f"{INDEX} puts {lost[0]} in {os.path.basename(path)}, which does not hold it")
            unlisted = [n for n in got if n not in listed]
            if unlisted:
                raise ConvertError(f"{path} holds {unlisted[0]}, which {INDEX} does not put there")
        for n, a in got.items():
            if n in tensors:
                raise ConvertError(f"{hf_dir}: tensor {n} is in both {where[n]} and {os.path.basename(path)}")
            tensors[n], where[n] = a, os.path.basename(path)
    return tensors


def shards(tensors: dict, max_bytes: int) -> list[list[str]]:
    """The tensor names of each file: in order, a new file when the next tensor would take
    this one past max_bytes (a tensor bigger than max_bytes alone in its own)."""
    out, size = [[]], 0
    for n, a in tensors.items():
        if out[-1] and size + a.nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(n)
        size += a.nbytes
    return out


def write(hf_dir: str, tensors: dict, max_bytes: int) -> list[str]:
    """Write `tensors` into the (new, empty) folder hf_dir: model.safetensors, or shards and
    their index when they exceed max_bytes. -> the file names written."""
    groups = shards(tensors, max_bytes)
    if len(groups) == 1:
        names = [SINGLE]
    else:
        names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    for file, group in zip(names, groups):
        safetensors.numpy.save_file({n: tensors[n] for n in group}, os.path.join(hf_dir, file),
                                    metadata={"format": "pt"})
    if len(groups) > 1:
        index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
                 "weight_map": {n: file for file, group in zip(names, groups) for n in group}}
        with open(os.path.join(hf_dir, INDEX), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
        names.append(INDEX)
    return names
