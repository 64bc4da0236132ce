"""Megatron tensor parallelism and sequence parallelism.

    tensor_parallel.py  column/row-parallel layers, the vocabulary-parallel embedding and loss
    sequence_parallel.py  LayerNorms and dropout on sequence shards: all-gather and reduce-scatter
"""
