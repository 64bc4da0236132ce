"""Lab 10: the planner's formulas, as plain functions of the model's shape.

Write the six functions below (labs/10_planner/README.md has the pictures and the hints).
They take numbers and return numbers: plain arithmetic, no NumPy or MPI needed. Write each
formula yourself: the grader compares them with minipar's own code (model.param_specs,
zero.formula, model.train_flops_per_token, flops.flop_components), with figures published
in papers and with the bytes a real trainer run on 2 ranks holds; calling minipar's
functions would grade minipar, not you.

Letters as in nanoGPT: V vocabulary, T context length (tokens of one sequence), L
transformer blocks, C channels (n_embd), H attention heads; P a parameter count, N the
ZeRO / data-parallel degree.

Check:  make lab L=10        (or: python -m labs.grade 10 --student this_file.py)
"""


def param_count(V, T, L, C, tied=True):
    """The exact number of parameters of minipar's GPT-2 (docs/design.md §2), an int.

    wte (V, C) and wpe (T, C); per block: ln_1 and ln_2 (a weight and a bias of C each),
    attn.c_attn (C, 3C) + bias 3C, attn.c_proj (C, C) + bias C, mlp.c_fc (C, 4C) + bias 4C,
    mlp.c_proj (4C, C) + bias C; ln_f (weight and bias, C each); and, only when not tied, a
    separate lm_head (V, C). tied=True: the logits use wte itself, which is counted once."""
    raise NotImplementedError("lab 10: param_count, see labs/10_planner/README.md")


def optimizer_bytes_per_param(mixed, itemsize):
    """K, the optimizer's bytes per parameter, an int. AdamW keeps m and v.

    mixed=False: the parameters (itemsize bytes each: 4 for float32, 8 for float64) are
    their own master weights, and m and v have their dtype.
    mixed=True (fp16 / bf16 storage, itemsize 2): the optimizer also keeps fp32 master
    weights, and m and v are fp32."""
    raise NotImplementedError("lab 10: optimizer_bytes_per_param, see labs/10_planner/README.md")


def model_state_bytes(P, itemsize, K, zero_stage, N):
    """Bytes of model states on one data-parallel rank: {"params": ..., "grads": ...,
    "optimizer": ...}, each an int.

    P parameters stored in `itemsize` bytes each, gradients of the same itemsize, K
    optimizer bytes per parameter; N data-parallel ranks. ZeRO stage 0 (plain data
    parallelism) keeps everything whole on every rank; stage 1 shards the optimizer state
    over the N ranks, stage 2 also the gradients, stage 3 also the parameters (a sharded
    state takes 1/N of its bytes). No padding: this lab's P is always divisible by N, so
    every division is exact (minipar pads each ZeRO unit to a multiple of N; not here)."""
    raise NotImplementedError("lab 10: model_state_bytes, see labs/10_planner/README.md")


def forward_flops(T, C, H, V, L):
    """FLOPs of one forward pass over one sequence of T tokens (Chinchilla's count,
    arXiv:2203.15556, appendix F), a dict of ints, whole model (all L layers):

        "embeddings"        2 T V C
        "kqv_projections"   L x 2 x 3 T C C
        "key_query_logits"  L x 2 T T C
        "softmax"           L x 3 H T T
        "softmax_value"     L x 2 T T C
        "final_linear"      L x 2 T C C
        "dense"             L x 2 T (C 4C + 4C C)
        "logits"            2 T C V
        "total"             the sum of the eight above"""
    raise NotImplementedError("lab 10: forward_flops, see labs/10_planner/README.md")


def mfu_flops_per_token(T, C, H, V, L):
    """The trainer's MFU numerator: FLOPs of one training token (forward + backward, the
    backward costing twice the forward), counting only what minipar computes as matmuls:
    every component of forward_flops except the embeddings (a row lookup in minipar) and
    the softmax (elementwise). Per token: divide the sequence's count by T. A number."""
    raise NotImplementedError("lab 10: mfu_flops_per_token, see labs/10_planner/README.md")


def six_nd(N, D):
    """The usual estimate of the training FLOPs of a model of N parameters on D tokens
    (forward 2 FLOPs per parameter per token, backward 4). A number."""
    raise NotImplementedError("lab 10: six_nd, see labs/10_planner/README.md")
