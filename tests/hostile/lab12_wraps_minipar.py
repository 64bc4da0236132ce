# hostile: lab 12's functions defined in the file, each handing the call to minipar's own tiled attention
# lab: 12
# scan: import from minipar.autograd.tiled_attention
# sandbox: minipar's own minipar.autograd.tiled_attention.tiled_forward
from minipar.autograd.tiled_attention import tiled_backward, tiled_forward


def forward(q, k, v, causal, block_q, block_k, scale=None):
    return tiled_forward(q, k, v, causal, block_q, block_k, scale)


def backward(q, k, v, o, lse, do, causal, block_q, block_k, scale=None):
    return tiled_backward(q, k, v, o, lse, do, causal, block_q, block_k, scale)
