"""The planner: every figure a layout implies, by formula, before anything runs
(`python -m minipar.plan`, docs/planner.md). Read in this order:

    table.py            memory, FLOPs and bytes per device for a layout, and the table
    activations.py      the activation memory of each schedule and recomputation
    hosts.py            a layout on hosts: bytes inside and across hosts, time under the link model
    peak.py             the machine: a matmul's peak FLOP/s, freed memory, human-readable bytes
"""
from minipar.plan.table import build_parser, main

__all__ = ["build_parser", "main"]
