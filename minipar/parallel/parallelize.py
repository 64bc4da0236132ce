"""A rank's model: the single-process GPT with every mechanism of the layout applied to it,
in one place and in order (docs/design.md §6). The model itself knows nothing of how it is
split; each mechanism gives it one of its Parts (model/contract.py) or builds its layers:

    1. recomputation      how each block runs (--recompute full: again in backward) and how
                          attention keeps its scores (selective: not at all; --attention
                          tiled: in blocks, never whole, kept as o and its log-sum-exp)
    2. context            the ring over the cp group as attention, and this rank's positions
    3. experts            the routing settings with this rank's experts placed, and only
                          their parameters held
    4. pipeline           only the stage's parameters held
    5. ZeRO-3             the gathers around each piece of the forward (bound to the units
                          when ZeRO is built, after the optimizer: parallel/zero/build.py)
    6. tensor (sequence)  the layers split over the tp group: TensorParallelGPT, or
                          SequenceParallelGPT with --sp; else the plain GPT
    7. pipeline           the stage's forward around the model: PipelineStage

Nothing is set on the model after it is built; everything it is given is in its Parts.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from minipar.autograd import recompute
from minipar.autograd.tiled_attention import tiled_attention
from minipar.model.contract import (Model, Parts, Resident, every_parameter, recomputed_attention, whole_attention,
                                    whole_positions)
from minipar.model.gpt import GPT, GPTConfig
from minipar.parallel.context.context_parallel import ContextSplit
from minipar.parallel.expert.expert_parallel import ExpertPlacement
from minipar.parallel.pipeline import schedules
from minipar.parallel.pipeline.stage import PipelineStage
from minipar.parallel.tensor.sequence_parallel import SequenceParallelGPT
from minipar.parallel.tensor.tensor_parallel import TensorParallelGPT
from minipar.parallel.zero import stage3


def parts(recompute_mode: str = "none", context: ContextSplit | None = None, moe=None,
          holds=None, gathers=None, attn_block: int | None = None) -> Parts:
    """The Parts of a layout: steps 1 to 5 above, for a model on one rank or many. attn_block:
    --attention tiled's block size (None: plain attention)."""
    attention = (context.attention if context is not None
                 else functools.partial(tiled_attention, block=attn_block) if attn_block is not None
                 else recomputed_attention if recompute_mode == "selective"
                 else whole_attention)
    positions = context.global_positions if context is not None else whole_positions
    return Parts(attention=attention, positions=positions, run_block=recompute.runner(recompute_mode),
                 moe=moe, holds=holds or every_parameter, gathers=gathers or Resident())


def parallelize(cfg: GPTConfig, grid, seed: int, dtype, recompute_mode: str = "none", sp: bool = False,
                context: ContextSplit | None = None, moe=None, virtual_stages: int = 1,
                zero_stage: int = 0, attn_block: int | None = None) -> Model:
    """This rank's model on `grid` (a ProcessGrid, or None: one process, never sharded).
    context: this rank's ContextSplit (--cp), moe: the routing settings of a MoE model (else
    None), zero_stage: --zero, attn_block: --attention tiled's block (None: plain attention)."""
    holds = []
    if grid is not None and grid.ep_size > 1:                                   # 3. experts
        placement = ExpertPlacement(grid.ep_group, cfg.moe_experts)
        moe = dataclasses.replace(moe, placement=placement)
        holds.append(placement.owns)
    if grid is not None and grid.pp_size > 1:                                   # 4. pipeline
        holds.append(frozenset(schedules.stage_param_names(cfg, grid.pp_rank, grid.pp_size,
                                                           virtual_stages)).__contains__)
    gathers = stage3.Gathers() if grid is not None and zero_stage == 3 else None   # 5. ZeRO-3
    p = parts(recompute_mode, context, moe, (lambda name: all(h(name) for h in holds)) if holds else None,
              gathers, attn_block)
    if grid is not None and grid.tp_size > 1:                                   # 6. tensor
        layers = SequenceParallelGPT if sp else TensorParallelGPT
        model = layers(cfg, grid.tp_group, seed=seed, dtype=np.dtype(dtype), parts=p)
    else:
        model = GPT(cfg, seed=seed, dtype=dtype, parts=p)
    if grid is not None and grid.pp_size > 1:                                   # 7. pipeline
        model = PipelineStage(model, grid.pp_rank, grid.pp_size, grid.pp_group, virtual_stages)
    return model
