"""What a run's checkpoints are, without Lightning: where they go, which one a run starts from,
and the metadata every checkpoint carries. The launcher uses it before any worker starts (a bad
checkpoint is a one-line error there); the training callback and whole-model saves write the same
metadata through ``meta``.

A LoRA run (``peft=lora``) saves its adapters alone (``saved_part``): the base never changes, so
rewriting it would only cost disk and time. It starts from two sources (``start_point``): the
base, ``checkpoint.load`` (model tensors only, never its optimizer state); then the adapters, from
the newest checkpoint in ``checkpoint.dir`` (``resume=auto``: optimizer state, step and random
states as any resume), else from ``peft.adapter`` (their weights only: a new run, at step 0, with
fresh optimizer state), else as initialised. Without ``checkpoint.load`` the base is the seeded
initial model.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Dict, List, Optional

from megatron_hydra.checkpoint import adapters, sharded, store
from megatron_hydra.checkpoint.selection import check_shapes
from megatron_hydra.config import Derived, RunConfig
from megatron_hydra.config.io import to_yaml
from megatron_hydra.errors import CheckpointError, ConfigError
from megatron_hydra.parallel.state import ParallelState


def checkpoint_dir(cfg: RunConfig) -> str:
    return cfg.checkpoint.dir or os.path.join(cfg.run_dir, "checkpoints")


def logical_shapes(derived: Derived, select: Optional[str] = None) -> Dict[str, List[int]]:
    """Every logical tensor of the whole model (of the part ``select`` names) and its shape, from a
    model on the meta device (of the local implementation: the logical tensors are the same for
    every one)."""
    from megatron_hydra.models.archs import ARCHS

    tcfg = dataclasses.replace(derived.transformer, transformer_impl="local", fp8=None)
    model = ARCHS[tcfg.arch].build(tcfg, ParallelState.single(), device="meta")
    return sharded.logical_shapes(model, 1, derived.transformer.vocab_size, select)


def saved_part(derived: Derived) -> Optional[str]:
    """What this run's checkpoints hold (a ``sharded`` selector): the adapters alone under LoRA."""
    return "adapters" if derived.transformer.lora is not None else None


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
    so is ``resume=none`` into a directory that holds complete checkpoints (``fresh_start``).
    Under LoRA the two sources are in the result: ``base`` (a path or None) and ``path`` (the
    adapters' or None), ``weights_only`` when they come from ``peft.adapter``."""
    root = checkpoint_dir(cfg)
    store.check_no_links(root)
    if cfg.checkpoint.resume != "auto":
        fresh_start(root)
    if derived.transformer.lora is not None:
        return _lora_start(cfg, derived, root)
    path = store.resolve(root, cfg.checkpoint.resume, cfg.checkpoint.load)
    if path is None:
        return None
    found = store.validate(path)
    if path != cfg.checkpoint.load and store.adapter_only(found):
        raise CheckpointError(f"checkpoint.dir={root} holds the adapter checkpoints of a peft=lora run (newest: "
                              f"{os.path.basename(path)}): continue it with peft=lora and its checkpoint.load, or "
                              "give this run another checkpoint.dir")
    adapters.refuse_adapter_only(path, "checkpoint.load", found)
    shapes = logical_shapes(derived)  # a model built on the meta device: once
    check_shapes(path, found["shapes"], shapes, found["has_optimizer"], cfg.checkpoint.load_optimizer)
    if cfg.objective.name == "dpo" and path != cfg.checkpoint.load:
        _check_reference(cfg, shapes, path, found)
    return {"path": path, **found}


def _check_reference(cfg: RunConfig, shapes: dict, resumed: str, found: dict) -> None:
    """A DPO run resumed from its own checkpoints keeps its reference, the starting model: the
    same ``checkpoint.load`` as the run it continues (its frozen copy is loaded from there)."""
    started = adapters.stored_config(resumed, found).checkpoint.load
    ours = cfg.checkpoint.load
    if (started and os.path.realpath(started)) != (ours and os.path.realpath(ours)):
        raise CheckpointError(f"checkpoint.dir={os.path.dirname(resumed)} continues a DPO run whose reference is "
                              f"checkpoint.load={started}, but this run has checkpoint.load={ours}: set "
                              f"checkpoint.load={started}, or give this run another checkpoint.dir")
    if ours:
        base = store.validate(ours)
        adapters.refuse_adapter_only(ours, "checkpoint.load", base)
        check_shapes(ours, base["shapes"], shapes, base["has_optimizer"], False)


def _lora_start(cfg: RunConfig, derived: Derived, root: str) -> Optional[dict]:
    """``start_point`` of a LoRA run: the base, checked, then the adapters' source, checked."""
    base, shapes = cfg.checkpoint.load, logical_shapes(derived)  # each check compares its part
    if base is not None:
        found = store.validate(base)
        adapters.refuse_adapter_only(base, "checkpoint.load", found)
        check_shapes(base, found["shapes"], shapes, True, False, select="base", key="checkpoint.load")
    resumed = store.latest(root) if cfg.checkpoint.resume == "auto" else None
    if resumed is not None:
        found = store.validate(resumed, "checkpoint.dir")
        if not store.adapter_only(found):
            raise CheckpointError(f"checkpoint.dir={root} holds full checkpoints (newest: "
                                  f"{os.path.basename(resumed)}), which a peft=lora run does not continue: give this "
                                  f"run another checkpoint.dir (to fine-tune that model: checkpoint.load={resumed})")
        _check_adapters(resumed, "checkpoint.dir", found, cfg, shapes, cfg.checkpoint.load_optimizer)
        if cfg.objective.name == "dpo" and cfg.peft.adapter is not None:  # the reference's adapters
            _given_adapters(cfg, shapes)
        return {"path": resumed, "base": base, "weights_only": False, **found}
    given = cfg.peft.adapter
    if given is not None:
        _given_adapters(cfg, shapes)
        # A new run from these weights: its own step count, data order and optimizer state.
        return {"path": given, "base": base, "weights_only": True, "step": 0, "consumed_samples": 0}
    if base is None:
        return None
    return {"path": None, "base": base, "weights_only": False, "step": 0, "consumed_samples": 0}


def _given_adapters(cfg: RunConfig, shapes: Dict[str, List[int]]) -> None:
    """``peft.adapter`` is an adapter checkpoint of this run's settings and shapes."""
    found = store.validate(cfg.peft.adapter, "peft.adapter")
    adapters.refuse_full(cfg.peft.adapter, "peft.adapter", found)
    _check_adapters(cfg.peft.adapter, "peft.adapter", found, cfg, shapes, False)


def _check_adapters(path: str, key: str, found: dict, cfg: RunConfig, shapes: Dict[str, List[int]],
                    load_optimizer: bool) -> None:
    """The adapters at ``path`` have this run's peft settings and the shapes of its adapters."""
    adapters.check_settings(path, key, found, cfg, adapters.adapter_targets(shapes))
    check_shapes(path, found["shapes"], shapes, found["has_optimizer"], load_optimizer, select="adapters", key=key)


def fresh_start(root: str) -> None:
    """A one-line ``ConfigError`` when a run that does not continue the checkpoints in ``root``
    would write there: its steps would interleave with theirs, ``resume=auto`` would later take
    the newest of either run, and retention could not tell whose checkpoint it deletes."""
    newest = store.latest(root) or next(iter(store.unrenamed(root)[-1:]), None)
    if newest is not None:
        raise ConfigError(f"checkpoint.dir={root} already holds checkpoints (newest: {os.path.basename(newest)}) "
                          "and checkpoint.resume=none starts a new run there: continue them with "
                          "checkpoint.resume=auto, give this run another checkpoint.dir, or remove them")


def meta(cfg: RunConfig, derived: Derived, step: int, consumed_samples: int, saved_layout: Optional[dict] = None,
         select: Optional[str] = None) -> dict:
    """The ``meta.json`` content of a checkpoint of this run at ``step`` holding the part of the
    model ``select`` names (``sharded.save`` adds the checksums and whether the optimizer is in
    it). One of the adapters alone says so (``adapter_only``): it is no model without its base."""
    out = {
        "step": step,
        "consumed_samples": consumed_samples,
        "layout": saved_layout or layout(derived),
        "dtype": str(derived.transformer.params_dtype),
        "shapes": logical_shapes(derived, select),
        "config": to_yaml(cfg),
    }
    if select == "adapters":
        out["adapter_only"] = True
    return out
