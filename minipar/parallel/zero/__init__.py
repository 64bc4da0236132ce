"""ZeRO: optimizer state, gradients and parameters sharded over the data-parallel group.
Read in this order:

    formulas.py         the bytes a rank holds and sends at each stage
    units.py            the units a rank's parameters are cut into, and its shard of each
    stage1.py           stage 1, optimizer state sharded: the gradient synchroniser
    stage2.py           stage 2 adds: gradients sharded
    stage3.py           stage 3 adds: parameters sharded (gather, release, Regather; prefetch,
                        reshard after forward)
    hybrid.py           hybrid sharding: shard groups, and the replicas of each shard
    quantize.py         ZeRO++'s int8 block codes
    zpp.py              ZeRO++: qwZ, hpZ and qgZ, how stage 3's messages travel
    optimizer.py        the sharded AdamW, sharing the stage's units
    build.py            the one constructor: (synchroniser, optimizer) of a stage
    summary.py          the run summary's ZeRO figures and line
"""
