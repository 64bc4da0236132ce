"""The autograd: arrays with a graph, the ops on them, and the two ways of taking backward
apart. Nothing here knows of ranks or messages. Read in this order:

    tensor.py           Tensor and Function: the graph, backward in reverse creation order
    dtypes.py           storage and compute dtypes: fp16/bf16 widened to fp32 for the arithmetic
    ops.py              every op the models use, each a Function with its backward beside
                        the plain NumPy it computes (the reference ops)
    attention.py        causal self-attention, multi-head and grouped-query
    tiled_attention.py  FlashAttention-2's tiled forward and backward: no T x T scores held
    llama_ops.py        the Llama family's RMSNorm, rotary embedding and SwiGLU
    backward_split.py   a backward split into B (input gradients) and W (weight gradients),
                        for the zero-bubble pipeline schedules
    recompute.py        activation recomputation: a block's forward re-run in backward

`minipar.tensor` and `minipar.ops` are kept as names for tensor.py and ops.py.
"""
