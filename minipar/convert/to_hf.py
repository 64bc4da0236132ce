"""python -m minipar.convert to-hf CKPT_DIR HF_DIR: a minipar checkpoint, written by any layout,
becomes a Hugging Face model directory that transformers' from_pretrained loads.

The checkpoint is read by the trainer's own loader (checkpoint.load: every file checked, the
optimizer shards included, a NaN refused); only model.npz's tensors and the config go out, the
optimizer state stays behind. Written, into a new or empty folder, whole or not at all
(output_dir.py):

    config.json                   GPT2LMHeadModel or LlamaForCausalLM (hf_config.to_hf)
    model.safetensors             every tensor in Hugging Face's names and layouts (hf_names.to_hf),
                                  a tied head once, as the embedding
    or model-00001-of-0000N.safetensors ... and model.safetensors.index.json, when the tensors
                                  exceed --max-shard-size (safetensors_io.write)

in the checkpoint's dtype (float32 or float64), or --dtype bfloat16, float16, float32 or
float64: rounded to nearest even (ml_dtypes's casts, as torch's `.to`), and refused when a
value falls beyond the new dtype's range (float16's 65504) rather than written as inf.
"""
from __future__ import annotations

import json
import os

import numpy as np

from minipar.convert import hf_config, hf_names, output_dir, safetensors_io
from minipar.convert.hf_names import ConvertError
from minipar.model.config import GPTConfig
from minipar.model.gpt import param_specs
from minipar.train import checkpoint

DEFAULT_MAX_SHARD = "5GB"


def read_checkpoint(ckpt_dir: str) -> tuple[GPTConfig, dict, dict]:
    """-> (config, model state {name: array}, meta.json) of a minipar checkpoint, or ConvertError."""
    try:
        state, _, meta = checkpoint.load(ckpt_dir)
        cfg = GPTConfig(**{"arch": "gpt2", **meta["config"]}).validate()   # before the families: GPT-2
        checkpoint.check_model(meta["loaded_from"], state, [(n, s) for n, s, _ in param_specs(cfg)])
    except checkpoint.CheckpointError as e:
        raise ConvertError(str(e)) from None
    except (TypeError, ValueError) as e:
        raise ConvertError(f"checkpoint {ckpt_dir}: meta.json's config is not a model minipar builds: {e}") from None
    return cfg, state, meta


def convert(ckpt_dir: str, hf_dir: str, dtype: str | None = None, max_shard_size: str = DEFAULT_MAX_SHARD) -> dict:
    """Write the Hugging Face directory; -> what was done, for the command's report.
    ConvertError (one line) before anything is written when anything is wrong."""
    max_bytes = safetensors_io.parse_size(max_shard_size)
    output_dir.check(hf_dir, ckpt_dir)
    cfg, state, meta = read_checkpoint(ckpt_dir)
    kinds = sorted({a.dtype.name for a in state.values()})
    if len(kinds) != 1 or kinds[0] not in ("float32", "float64"):
        raise ConvertError(f"checkpoint {ckpt_dir}: model.npz holds {'/'.join(kinds)} arrays; minipar writes "
                           f"float32 or float64")
    dtype = dtype or kinds[0]
    config = hf_config.to_hf(cfg, dtype)
    arch = hf_names.ARCHITECTURES[config["architectures"][0]]
    tensors = {}
    for name, a in hf_names.to_hf(arch, state, cfg.tie_embeddings).items():
        with np.errstate(over="ignore"):           # an overflow is refused here, in words
            tensors[name] = a.astype(safetensors_io.DTYPES[dtype])
        if not np.isfinite(tensors[name]).all():
            raise ConvertError(f"checkpoint {ckpt_dir}: {name} holds values beyond {dtype}'s range "
                               f"(|x| up to {np.abs(a).max():.3g}): choose another --dtype")
    with output_dir.written_whole(hf_dir) as tmp:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        files = safetensors_io.write(tmp, tensors, max_bytes)
    return {"arch": arch, "cfg": cfg, "step": meta["step"], "loaded_from": meta["loaded_from"],
            "files": ["config.json"] + files, "dtype": dtype, "source_dtype": kinds[0],
            "bytes": sum(a.nbytes for a in tensors.values())}
