"""A rank's model stage at a layout: built on the meta device, given storage shard by shard.

Training, generation and evaluation all build a rank's part of the model the same way, so they
hold the same logical tensors under the same names and load the same checkpoints.
"""

from __future__ import annotations

import torch

from megatron_hydra.config import Derived, RunConfig
from megatron_hydra.models.archs import ARCHS
from megatron_hydra.models.init import materialize
from megatron_hydra.models.lora import freeze_base
from megatron_hydra.parallel.pipeline import stage_indices, stage_layers
from megatron_hydra.parallel.state import ParallelState


def build_model(cfg: RunConfig, derived: Derived, ps: ParallelState, device, **stage) -> torch.nn.Module:
    """The model (or one pipeline chunk: ``stage`` holds layers, pre_process, post_process),
    built on the meta device and given its storage on ``device`` shard by shard, each parameter
    filled there from its logical name (``models.init``): no CPU copy, nothing drawn whole.
    With LoRA (``peft=lora``) everything but the adapters is frozen (``models.lora``)."""
    tcfg = derived.transformer
    model = ARCHS[tcfg.arch].build(tcfg, ps, device="meta", **stage)
    if tcfg.lora is not None:
        freeze_base(model)
    return materialize(model, tcfg, cfg.seed, ps.tp_rank, ps.tp_size, device)


def build_stage_chunks(cfg: RunConfig, derived: Derived, ps: ParallelState, device=None):
    """This pipeline rank's model chunks and their virtual stage indices, initialised from the
    logical parameter names (the same values as the whole model at pp=1)."""
    per_stage = derived.layers_per_stage
    stages = stage_indices(ps.pp_rank, ps.pp_size, derived.vpp, cfg.parallel.pipeline_schedule)
    chunks = [build_model(cfg, derived, ps, device, layers=stage_layers(per_stage, stage), pre_process=stage == 0,
                          post_process=stage == len(per_stage) - 1) for stage in stages]
    return chunks, stages
