"""Fit the ``auto`` values of a composed config to the machine, before ``derive``.

The default presets (``trainer=auto``, ``precision=auto``, ``num_workers: auto`` in the data
presets) let one command run anywhere: ``python launch.py model=gpt_8b parallel=tp4_pp2`` trains
on every GPU of an 8-GPU node in bf16, and on a CPU machine takes the fewest ranks the layout
needs (where the memory check then says what is missing). ``resolve`` is the one place that turns
them into values; it is pure (the machine comes in as numbers), so ``derive`` stays a function of
the config and tests resolve for any machine. Every entry point that composes a config to run
calls it: ``launcher.run`` (with this machine's GPUs), ``config.bundled.compose`` and the tests'
``compose_config`` (as a CPU machine unless told otherwise).

A null ``data.global_batch_size`` is filled in here too (``derive.global_batch_size``), so the
config the workers get, and every checkpoint records, holds the batch the run trained with.

    key                     auto means
    trainer.accelerator     gpu when a CUDA device is visible, else cpu
    trainer.devices         the ranks an external launcher started on this node (torchrun, srun);
                            else every visible GPU (accelerator gpu); else tp x pp x cp
    precision.params_dtype  bfloat16 on gpu (fp32 main weights and grads), float32 on cpu
    data.num_workers        2 on gpu (batches read and pinned while the GPU computes), 0 on cpu

and, for fine-tuning (``data=sft``) with a null ``data.tokenizer.path`` and a ``checkpoint.load``,
the tokenizer is the ``tokenizer.json`` of that directory (an import by ``megatron_hydra.convert``).

Explicit values always win, and resolving twice changes nothing.
"""

from __future__ import annotations

import copy
import os
from typing import Optional

from megatron_hydra.config.derive import global_batch_size
from megatron_hydra.config.schema import PACKED_DOCUMENT_DATA, RunConfig
from megatron_hydra.errors import ConfigError

AUTO = "auto"
GPU_LOADER_WORKERS = 2


def resolve(cfg: RunConfig, visible_gpus: int, local_ranks: Optional[int] = None) -> RunConfig:
    """A copy of ``cfg`` with every ``auto`` chosen for a machine with ``visible_gpus`` CUDA
    devices; ``local_ranks``: the ranks an external launcher started on this node, if any."""
    cfg = copy.deepcopy(cfg)
    trainer, par = cfg.trainer, cfg.parallel
    if trainer.accelerator == AUTO:
        trainer.accelerator = "gpu" if visible_gpus > 0 else "cpu"
    gpu = trainer.accelerator == "gpu"
    if trainer.devices == AUTO:
        if local_ranks is not None:
            trainer.devices = local_ranks
        elif gpu and visible_gpus > 0:
            trainer.devices = visible_gpus
        else:
            trainer.devices = max(1, par.tensor_parallel_size * par.pipeline_parallel_size * par.context_parallel_size)
    if cfg.precision.params_dtype == AUTO:
        cfg.precision.params_dtype = "bfloat16" if gpu else "float32"
    if cfg.data.num_workers == AUTO:
        cfg.data.num_workers = GPU_LOADER_WORKERS if gpu else 0
    tok = cfg.data.tokenizer
    if cfg.data.name in PACKED_DOCUMENT_DATA and tok.type == "hf" and not tok.path and cfg.checkpoint.load:
        tok.path = os.path.join(cfg.checkpoint.load, "tokenizer.json")
    if cfg.data.global_batch_size is None and cfg.mode != "plan_layouts":  # the planner varies dp itself
        try:
            cfg.data.global_batch_size = global_batch_size(cfg)
        except ConfigError:  # a layout that does not divide the ranks: derive names the key
            pass
    return cfg
