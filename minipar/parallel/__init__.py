"""The parallel mechanisms: each takes the single-process model (minipar/model) or its
gradients apart over a group of ranks and puts the result back together. Read in this order:

    layout.py           the layout as one frozen record: the sizes and flags every part reads
    grid.py             the dp x cp x tp x pp process grid and its groups (docs/design.md §6)
    data_parallel.py    gradients summed over dp: naive, then bucketed during backward
    zero/               ZeRO stages 1, 2, 3: optimizer state, gradients, parameters sharded over dp
    tensor/             Megatron's tensor parallelism and sequence parallelism
    pipeline/           schedules as data, their deadlock check, a stage and its executor
    context/            context parallelism: ring attention over sequence shards
    expert/             expert parallelism: experts on ranks, tokens sent by all-to-all
    parallelize.py      a rank's model: the mechanisms above applied to the plain GPT, in order
"""
