"""The parallel mechanisms, one per file, each readable top to bottom:

    grid.py             the dp x tp x pp process grid and its communicators (docs/design.md §6)
    data_parallel.py    gradients summed over dp: naive, then bucketed during backward
    tensor_parallel.py  Megatron's column/row-parallel layers and the vocabulary-parallel embedding
    schedules.py        pipeline schedules as data (naive, GPipe, 1F1B) and their deadlock check
    pipeline.py         a pipeline stage of the model and the executor that walks a schedule
    zero.py             ZeRO stages 1, 2, 3: optimizer state, gradients, parameters sharded over dp
"""
