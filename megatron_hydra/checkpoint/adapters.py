"""Adapter checkpoints (``peft=lora``): which checkpoint may be a base and which adapters, and
whether adapters fit the run that loads them.

A LoRA run reads two checkpoints: the base (``checkpoint.load``, a full checkpoint; only its
model tensors) and its adapters (``meta.json`` says ``adapter_only``: the run's own newest
checkpoint, or ``peft.adapter``). The two are easily swapped or mixed up, and adapters of another
base or of other peft settings would load into a model that computes something else, so each is
checked from ``meta.json`` alone, before any worker starts; every problem is one line naming the
setting and the file. What an adapter computes is fixed by its rank and targets (visible in its
tensors' shapes and names) and its scale (``peft.alpha``, ``peft.rslora``: only in its stored
config), so all four must be this run's. Everything here is file metadata: no torch.distributed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

from megatron_hydra.checkpoint import store
from megatron_hydra.checkpoint.selection import ADAPTER_MARK, is_adapter_name
from megatron_hydra.config import RunConfig
from megatron_hydra.config.io import from_yaml
from megatron_hydra.config.transformer_config import LORA_TARGETS
from megatron_hydra.config.schema import PeftConfig
from megatron_hydra.errors import CheckpointError
from megatron_hydra.parallel.lora import is_down_projection

log = logging.getLogger("megatron_hydra")


def trained_base(path: str, meta: dict) -> Optional[str]:
    """The base (``checkpoint.load``) the adapters in ``path`` were trained on, from their config."""
    return stored_config(path, meta).checkpoint.load


def stored_config(path: str, meta: dict) -> RunConfig:
    """The run config a checkpoint was saved with (its ``meta.json``), typed by the schema."""
    if not isinstance(meta.get("config"), str):
        raise CheckpointError(f"{path}/{store.META} holds no config, so it cannot say which peft settings its "
                              "adapters have: it was not written by megatron-hydra")
    return from_yaml(meta["config"], f"{path}/{store.META}")


def adapter_targets(names) -> Tuple[str, ...]:
    """The target layers (``qkv``, ``proj``, ...) whose adapters ``names`` (logical tensor names) hold."""
    found = {name.split(ADAPTER_MARK)[0].rpartition(".")[2] for name in names if is_adapter_name(name)}
    return tuple(t for t in LORA_TARGETS if t in found) + tuple(sorted(found - set(LORA_TARGETS)))


def adapter_rank(shapes: Dict[str, List[int]]) -> Optional[int]:
    """The rank of the adapters in ``shapes``: the rows of every A (``...lora.a``, ``...lora.a_q``)."""
    ranks = {shape[0] for name, shape in shapes.items()
             if is_adapter_name(name) and is_down_projection(name) and shape}
    return ranks.pop() if len(ranks) == 1 else None


def stored_peft(path: str, meta: dict) -> PeftConfig:
    """The peft settings of the adapters in ``path``: rank and targets as their tensors hold them,
    scale (alpha, rslora) and dropout as their config records; ``adapter`` is ``path``."""
    peft = stored_config(path, meta).peft
    shapes = meta["shapes"]
    rank = adapter_rank(shapes)
    if rank is None or not adapter_targets(shapes):
        raise CheckpointError(f"{path}/{store.META}: its shapes hold no adapters of one rank: the checkpoint is "
                              "damaged or crafted; refused")
    return PeftConfig(name="lora", rank=rank, alpha=float(peft.alpha), dropout=float(peft.dropout),
                      target_modules=list(adapter_targets(shapes)), rslora=bool(peft.rslora), adapter=path)


def refuse_adapter_only(path: str, key: str, meta: dict) -> None:
    """A full checkpoint is expected at ``key`` (a base, or a peft=none run's start)."""
    if not store.adapter_only(meta):
        return
    base, lora = _base_hint(path, meta), " (with peft=lora)" if key == "checkpoint.load" else ""
    raise CheckpointError(f"{key}={path} holds LoRA adapters alone, not a model: give the full checkpoint of their "
                          f"base as {key} and this one as peft.adapter={path}{lora}{base}")


def refuse_full(path: str, key: str, meta: dict) -> None:
    """Adapters are expected at ``key``."""
    if store.adapter_only(meta):
        return
    raise CheckpointError(f"{key}={path} is a full checkpoint, not a LoRA run's adapters: give it as "
                          "checkpoint.load (the base) and an adapter checkpoint (a peft=lora run's) as peft.adapter")


def _base_hint(path: str, meta: dict) -> str:
    try:
        base = trained_base(path, meta)
    except Exception:  # noqa: BLE001 - only a hint: a config that does not parse gives none
        return ""
    return f"; they were trained on checkpoint.load={base}" if base else ""


def check_settings(path: str, key: str, meta: dict, cfg: RunConfig, targets: Tuple[str, ...]) -> None:
    """The adapters in ``path`` (given by ``key``) have this run's peft settings (``targets``: the
    layers this run adapts) and, when they were trained on a base, this run has one too."""
    theirs = stored_peft(path, meta)
    ours = cfg.peft
    for name, mine, saved in (("rank", ours.rank, theirs.rank), ("alpha", float(ours.alpha), theirs.alpha),
                              ("rslora", ours.rslora, theirs.rslora)):
        if mine != saved:
            raise CheckpointError(f"{key}={path} holds adapters trained with peft.{name}={saved}, but this run has "
                                  f"peft.{name}={mine}: set peft.{name}={saved}")
    targets = tuple(t for t in LORA_TARGETS if t in targets)
    if tuple(theirs.target_modules) != targets:
        listed = ",".join(theirs.target_modules)
        raise CheckpointError(f"{key}={path} holds adapters of peft.target_modules=[{listed}], but this run adapts "
                              f"[{','.join(targets)}]: set peft.target_modules=[{listed}]")
    base = trained_base(path, meta)
    if base and not cfg.checkpoint.load:
        raise CheckpointError(f"{key}={path} holds adapters trained on the base checkpoint.load={base}, but this run "
                              f"has no checkpoint.load (its base would be the seeded initial model): add "
                              f"checkpoint.load={base}")
    if base and os.path.realpath(base) != os.path.realpath(cfg.checkpoint.load):
        log.warning("%s=%s holds adapters trained on checkpoint.load=%s, and this run's base is %s: the shapes fit, "
                    "make sure it is the same model (a moved copy of it is)", key, path, base, cfg.checkpoint.load)


def adopt(cfg: RunConfig, path: str) -> RunConfig:
    """``cfg`` with the peft settings of the adapter checkpoint ``path`` (``peft.adapter``): a run
    of a checkpoint (generate, evaluate) takes them from the adapters rather than the user."""
    path = os.path.abspath(os.path.expanduser(path))
    meta = store.validate(path, "peft.adapter")
    refuse_full(path, "peft.adapter", meta)
    return replace(cfg, peft=stored_peft(path, meta))
