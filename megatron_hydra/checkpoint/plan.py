"""What a run's checkpoints are, without Lightning: where they go, which one a run starts from,
and the metadata every checkpoint carries. The launcher uses it before any worker starts (a bad
checkpoint is a one-line error there); the training callback and whole-model saves write the same
metadata through ``meta``."""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional

from megatron_hydra.checkpoint import sharded, store
from megatron_hydra.config import Derived, RunConfig
from megatron_hydra.config.io import to_yaml
from megatron_hydra.errors import ConfigError
from megatron_hydra.parallel.state import ParallelState


def checkpoint_dir(cfg: RunConfig) -> str:
    return cfg.checkpoint.dir or os.path.join(cfg.run_dir, "checkpoints")


def logical_shapes(derived: Derived) -> Dict[str, List[int]]:
    """Every logical tensor of the whole model and its shape, from a model on the meta device
    (of the local implementation: the logical tensors are the same for every one)."""
    from megatron_hydra.models.archs import ARCHS

    tcfg = dataclasses.replace(derived.transformer, transformer_impl="local", fp8=None)
    model = ARCHS[tcfg.arch].build(tcfg, ParallelState.single(), device="meta")
    return sharded.logical_shapes(model, 1, derived.transformer.vocab_size)


def layout(derived: Derived) -> dict:
    """The layout a run's checkpoint records (random states are restored only into the same one)."""
    return {"world": derived.world_size, "tp": derived.tp, "pp": derived.pp, "dp": derived.dp, "cp": derived.cp,
            "vpp": derived.vpp}


def start_point(cfg: RunConfig, derived: Derived) -> Optional[dict]:
    """The checkpoint this run starts from (``resume=auto``: the newest complete one in the
    directory, else ``checkpoint.load``) with its metadata, after checking that it fits this
    model; ``None`` for a fresh start. Cheap (metadata only): the launcher calls it before any
    worker starts, so a bad checkpoint is a one-line error, and each worker calls it again.
    ``checkpoint.dir`` belongs to one run: a link there is refused (``store.check_no_links``), and
    so is ``resume=none`` into a directory that holds complete checkpoints (``fresh_start``)."""
    root = checkpoint_dir(cfg)
    store.check_no_links(root)
    if cfg.checkpoint.resume != "auto":
        fresh_start(root)
    path = store.resolve(root, cfg.checkpoint.resume, cfg.checkpoint.load)
    if path is None:
        return None
    found = store.validate(path)
    sharded.check_shapes(path, found["shapes"], logical_shapes(derived), found["has_optimizer"],
                         cfg.checkpoint.load_optimizer)
    return {"path": path, **found}


def fresh_start(root: str) -> None:
    """A one-line ``ConfigError`` when a run that does not continue the checkpoints in ``root``
    would write there: its steps would interleave with theirs, ``resume=auto`` would later take
    the newest of either run, and retention could not tell whose checkpoint it deletes."""
    newest = store.latest(root) or next(iter(store.unrenamed(root)[-1:]), None)
    if newest is not None:
        raise ConfigError(f"checkpoint.dir={root} already holds checkpoints (newest: {os.path.basename(newest)}) "
                          "and checkpoint.resume=none starts a new run there: continue them with "
                          "checkpoint.resume=auto, give this run another checkpoint.dir, or remove them")


def meta(cfg: RunConfig, derived: Derived, step: int, consumed_samples: int, saved_layout: Optional[dict] = None) -> dict:
    """The ``meta.json`` content of a checkpoint of this run at ``step`` (``sharded.save`` adds
    the checksums and whether the optimizer is in it)."""
    return {
        "step": step,
        "consumed_samples": consumed_samples,
        "layout": saved_layout or layout(derived),
        "dtype": str(derived.transformer.params_dtype),
        "shapes": logical_shapes(derived),
        "config": to_yaml(cfg),
    }
