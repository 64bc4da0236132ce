"""Hugging Face checkpoints, both ways (`python -m minipar.convert`, docs/checkpoints.md).
Read in this order:

    hf_names.py         the table of architectures (GPT2LMHeadModel, LlamaForCausalLM,
                        MixtralForCausalLM): each name's prefix, which weights are stored
                        transposed, which tensors are buffers; ConvertError
    hf_config.py        config.json <-> GPTConfig, and every setting minipar refuses
    safetensors_io.py   the weight files: one, or shards with their index, read and written
                        with safetensors' NumPy API (bfloat16 through ml_dtypes)
    output_dir.py       the output folder checked first, and written whole or not at all
    from_hf.py          a Hugging Face directory -> a checkpoint at step 0 that any layout resumes
    to_hf.py            a checkpoint of any layout -> a directory from_pretrained loads
    cli.py              the command: from-hf and to-hf, each refusal one line, exit 2
"""
