"""Lab 12 answered by minipar's own code (python -m labs.grade 12 --solution): the tiled
forward and backward of minipar/autograd/tiled_attention.py behind the lab's signatures. The
functions are taken when this file is loaded, before drive.install() puts the student's in
their place."""
from minipar.autograd import tiled_attention

TILED = tiled_attention.tiled_forward, tiled_attention.tiled_backward


def forward(q, k, v, causal, block_q, block_k, scale=None):
    return TILED[0](q, k, v, causal, block_q, block_k, scale)


def backward(q, k, v, o, lse, do, causal, block_q, block_k, scale=None):
    return TILED[1](q, k, v, o, lse, do, causal, block_q, block_k, scale)
