"""The planner: every figure a layout implies, by formula, before anything runs
(`python -m minipar.plan`, docs/planner.md). Read in this order:

    table.py            plan(): every figure of a layout in one dict, and the command line
    layout.py           what a layout (parallel/layout.py) puts on a device of each stage
    memory.py           model states and activations per device, the memory check, the longest T that fits
    activations.py      the activation memory of each schedule and recomputation
    flops.py            FLOPs per device, component by component
    comm_bytes.py       bytes a device sends per step, axis by axis, as minipar.comm sends them
    hosts.py            a layout on hosts: bytes inside and across hosts, time under the link model
    context.py          the four ways a cp group attends, side by side, the cheapest marked
    shards.py           ZeRO's shard groups (--shard-group): "host" resolved, every candidate S side by side
    render.py           the table: plan()'s dict, human-readable
    peak.py             the machine: a matmul's peak FLOP/s, freed memory, human-readable bytes
"""
from minipar.plan.table import build_parser, main

__all__ = ["build_parser", "main"]
