"""python -m minipar.explain: each mechanism drawn from a real run's trace, checked against
the formulas. One file per picture: its run, what it reads from the trace, its drawing. Read
in this order:

    cli.py              the command line: the WHATs, the launch under mpirun, a trace drawn
    common.py           what the pictures share: the table of pictures, the errors, the palette
    collectives.py      the collectives (ring, recursive doubling, the trees); every WHAT's worker
    megatron.py         Megatron's MLP on tp ranks
    pipeline.py         the 1F1B pipeline, the trainer's own trace
    ring_attention.py   ring attention (context parallelism)
    moe.py              one MoE layer's all-to-alls (expert parallelism)
    gqa_tp.py           a Llama block's query and key/value heads over tp ranks, and the
                        sums of a shared key/value head's gradients
    ulysses.py          Ulysses attention (context parallelism): its four all-to-alls, the
                        sequence shards turned into head shards and back, a copied KV head's
                        gradient parts summed
    fsdp.py             ZeRO-3 (FSDP) in the trainer: its all-gathers and reduce-scatters with
                        and without prefetch and resharding, checked against ZeRO's formulas
    hsdp.py             hybrid sharding (--shard-group): the shard and replica groups each
                        collective ran on, and each rank's bytes in each
"""
from minipar.explain.cli import build_parser, main, settle

__all__ = ["build_parser", "main", "settle"]
