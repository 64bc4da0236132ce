"""python -m minipar.convert: the two directions as commands, each refusal one line, exit 2.

    python -m minipar.convert from-hf HF_DIR CKPT_DIR [--dtype float32|float64] [--block-size T]
    python -m minipar.convert to-hf CKPT_DIR HF_DIR [--dtype bfloat16|float16|float32|float64]
                                                    [--max-shard-size 5GB]
"""
from __future__ import annotations

import argparse
import sys

from minipar.convert import from_hf, safetensors_io, to_hf
from minipar.convert.hf_names import ConvertError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minipar.convert", allow_abbrev=False,
                                description="Hugging Face checkpoints, both ways (docs/checkpoints.md)")
    sub = p.add_subparsers(dest="direction", required=True, metavar="{from-hf,to-hf}")
    a = sub.add_parser("from-hf", allow_abbrev=False,
                       help="a GPT2LMHeadModel or LlamaForCausalLM directory -> a minipar checkpoint at step 0")
    a.add_argument("source", metavar="HF_DIR", help="config.json and model.safetensors (or its shards and index)")
    a.add_argument("output", metavar="CKPT_DIR", help="a new or empty folder")
    a.add_argument("--dtype", choices=("float32", "float64"), default=None,
                   help="model.npz's dtype [float32; float64 when the files hold float64]")
    a.add_argument("--block-size", type=int, default=None, metavar="T",
                   help="Llama: the context minipar trains with [max_position_embeddings]")
    b = sub.add_parser("to-hf", allow_abbrev=False,
                       help="a minipar checkpoint (any layout's) -> a directory transformers' from_pretrained loads")
    b.add_argument("source", metavar="CKPT_DIR", help="a checkpoint of python -m minipar.train --save")
    b.add_argument("output", metavar="HF_DIR", help="a new or empty folder")
    b.add_argument("--dtype", choices=tuple(safetensors_io.DTYPES), default=None,
                   help="the weight files' dtype [the checkpoint's]")
    b.add_argument("--max-shard-size", default=to_hf.DEFAULT_MAX_SHARD, metavar="SIZE",
                   help="larger weights go into shards with an index: 5GB (10^9 bytes), 500MiB, ... [%(default)s]")
    return p


def run(args) -> list[str]:
    """Convert; -> the report's lines."""
    if args.direction == "from-hf":
        if args.block_size is not None and args.block_size < 1:
            raise ConvertError(f"--block-size {args.block_size} must be >= 1")
        r = from_hf.convert(args.source, args.output, args.dtype, args.block_size)
        cfg = r["cfg"]
        lines = [f"minipar.convert: {args.source} ({r['arch'].name}, {r['files']} weight file(s), "
                 f"{'/'.join(r['source_dtypes'])}) -> checkpoint {args.output} ({r['dtype']}, step 0, "
                 f"Adam's moments zero)",
                 f"  {cfg.family.describe(cfg)} V={cfg.vocab_size} T={cfg.block_size} "
                 f"{'tied' if cfg.tie_embeddings else 'untied'}: {r['parameters']:,} parameters",
                 f"  train it on any layout: python -m minipar.train --resume {args.output}"
                 + (" --dtype float64" if r["dtype"] == "float64" else "")]
        if cfg.vocab_size < 256:
            lines.append(f"  (its vocabulary of {cfg.vocab_size} holds fewer than the trainer's 256 byte tokens: "
                         f"the trainer will refuse it)")
        return lines
    r = to_hf.convert(args.source, args.output, args.dtype, args.max_shard_size)
    files = r["files"]
    if len(files) > 3:                              # config.json, the shards, the index
        files = [files[0], f"{len(files) - 2} shards {files[1]} .. {files[-2]}", files[-1]]
    return [f"minipar.convert: checkpoint {r['loaded_from']} (step {r['step']}, {r['source_dtype']}) -> "
            f"{args.output} ({r['arch'].name}, {r['dtype']}, {r['bytes']:,} bytes of weights)",
            f"  wrote {', '.join(files)}"]


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        lines = run(args)
    except ConvertError as e:
        print(f"minipar.convert: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    print("\n".join(lines), flush=True)
