"""python -m minipar.convert from-hf HF_DIR CKPT_DIR: a Hugging Face model directory becomes a
minipar checkpoint that `python -m minipar.train --resume CKPT_DIR` trains from on any layout.

Everything is read and checked before anything is written: the output folder (output_dir.py),
config.json (hf_config.py), every tensor of the weight files (safetensors_io.py), each one's
name, shape and layout (hf_names.py), and that each holds finite numbers only (a NaN would be
refused by the trainer's loader anyway; here it is named). Then checkpoint.save writes the
checkpoint as a one-process run would have saved it at step 0:

    model.npz       the tensors in minipar's names and layouts, in --dtype: float32 (float16
                    and bfloat16 widen exactly), or float64 when the files hold float64
    optim/rank-00000.npz   Adam's state of a run that has not stepped: step 0, m = v = 0, every
                    element (index 0 .. P-1), in the same dtype; any layout takes its slice
    meta.json       the config, step 0 (the data position: the first batch is step 0's),
                    dtype, precision fp32, and "converted_from"; no seed and no data digest,
                    so the first --resume chooses them (--seed, default 0; --data, default
                    the built-in corpus), and its saves record them from then on
"""
from __future__ import annotations

import os

import numpy as np

from minipar.convert import hf_config, hf_names, output_dir, safetensors_io
from minipar.convert.hf_names import ConvertError
from minipar.model.gpt import param_specs
from minipar.train import checkpoint


def convert(hf_dir: str, ckpt_dir: str, dtype: str | None = None, block_size: int | None = None) -> dict:
    """Write the checkpoint; -> what was done, for the command's report. ConvertError (one
    line) before anything is written when anything is wrong."""
    output_dir.check(ckpt_dir, hf_dir)
    for p in (ckpt_dir.rstrip(os.sep) + ".tmp", ckpt_dir.rstrip(os.sep) + ".old"):   # checkpoint.save's
        if os.path.lexists(p):
            raise ConvertError(f"output {ckpt_dir}: {p} exists (a save's leftover, or not minipar's): remove it first")
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"input {hf_dir} is not a folder: a Hugging Face model directory is")
    path = os.path.join(hf_dir, "config.json")
    arch, cfg = hf_config.from_hf(hf_config.read(hf_dir), path, block_size)
    files = safetensors_io.weight_files(hf_dir)
    tensors = safetensors_io.read(hf_dir, files)
    kinds = sorted({a.dtype.name for a in tensors.values()})
    dtype = dtype or ("float64" if "float64" in kinds else "float32")
    specs = [(n, s) for n, s, _ in param_specs(cfg)]
    state = hf_names.from_hf(arch, tensors, specs, cfg.tie_embeddings, hf_dir)
    for name, a in state.items():
        if not np.isfinite(a).all():
            raise ConvertError(f"{hf_dir}: tensor {arch.hf_name(name)} holds NaN or inf: not converted")
        with np.errstate(over="ignore"):           # an overflow is refused here, in words
            state[name] = a.astype(dtype)
        if not np.isfinite(state[name]).all():
            raise ConvertError(f"{hf_dir}: tensor {arch.hf_name(name)} holds values beyond {dtype}'s range "
                               f"(|x| up to {np.abs(a).max():.3g}): convert with --dtype float64")
    zeros = {n: np.zeros_like(a) for n, a in state.items()}
    shard = checkpoint.full_shard(specs, {"step": 0, "m": zeros, "v": zeros})
    meta = {"config": cfg.to_dict(), "step": 0, "dtype": dtype, "precision": "fp32",
            "converted_from": {"directory": os.path.abspath(hf_dir), "architecture": arch.name,
                               "files": sorted(os.path.basename(f) for f in files), "dtypes": kinds}}
    try:
        checkpoint.save(ckpt_dir, state, shard, meta)
    except (checkpoint.CheckpointError, OSError) as e:
        raise ConvertError(f"checkpoint {ckpt_dir} not written: {checkpoint.describe_error(e)}") from None
    return {"arch": arch, "cfg": cfg, "files": len(files), "source_dtypes": kinds, "dtype": dtype,
            "parameters": sum(a.size for a in state.values())}
