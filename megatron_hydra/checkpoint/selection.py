"""Which part of a model a checkpoint holds, and whether it fits the model that loads it.

A model with LoRA adapters (``peft=lora``) is two parts kept in different checkpoints: the frozen
base (a full checkpoint) and the adapters (a run's own small checkpoints). A selector names the
part a save, a load or a check handles: ``None`` all of it, ``"adapters"`` the adapter tensors,
``"base"`` the rest. In a checkpoint the parts are told apart by logical name alone (every
adapter tensor's holds ``.lora.``, no other's does), so the launcher checks them from
``meta.json`` before any model exists.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from megatron_hydra.errors import CheckpointError

SELECTS = (None, "adapters", "base")
ADAPTER_MARK = ".lora."  # in the logical name of every adapter tensor (models.lora) and of no other


def check_select(select: Optional[str]) -> None:
    """A programming error, not a user's: every caller passes one of ``SELECTS``."""
    if select not in SELECTS:
        raise ValueError(f"select={select!r}: one of {SELECTS}")


def is_adapter_name(name: str) -> bool:
    """Whether the logical tensor ``name`` is a LoRA adapter's (what a checkpoint's names say)."""
    return ADAPTER_MARK in name


def selected_name(name: str, select: Optional[str]) -> bool:
    """Whether the logical tensor ``name`` belongs to the part ``select`` names."""
    return select is None or (select == "adapters") == is_adapter_name(name)


def select_names(shapes: Dict[str, List[int]], select: Optional[str]) -> Dict[str, List[int]]:
    """The entries of ``shapes`` (logical name -> shape) in the part ``select`` names."""
    check_select(select)
    return {name: shape for name, shape in shapes.items() if selected_name(name, select)}


def _layers(names) -> int:
    return len({name.split(".")[1] for name in names if name.startswith("layers.")})


def _named(path: str, key: Optional[str]) -> str:
    """How a message names the checkpoint: by the key that gave it, when there is one."""
    return f"{key}={path}" if key else f"checkpoint {path}"


def _fix(select: Optional[str]) -> str:
    if select == "adapters":
        return ("its adapters were trained on another base model or with other peft settings: use the base "
                "(checkpoint.load) and peft.rank / peft.target_modules they were trained with")
    return "it was saved from another model; load it with the model config it was saved with"


def extra_tensors(path: str, extra: List[str], saved, expected, key: Optional[str] = None,
                  select: Optional[str] = None) -> CheckpointError:
    counts = (f" ({_layers(saved)} layers there, {_layers(expected)} in this model)"
              if _layers(saved) != _layers(expected) else "")
    more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
    return CheckpointError(f"{_named(path, key)} has tensor {extra[0]}{more} that this model lacks{counts}: "
                           f"{_fix(select)}")


def check_shapes(path: str, saved: Dict[str, List[int]], expected: Dict[str, List[int]], has_optimizer: bool,
                 load_optimizer: bool, whole: bool = True, select: Optional[str] = None,
                 key: Optional[str] = None) -> None:
    """A one-line ``CheckpointError`` for the first tensor the checkpoint lacks or has another
    shape, and (``whole``: ``expected`` is the whole model, not one rank's part) for saved tensors
    this model lacks: a checkpoint with more layers never loads into a smaller model. Only the
    part ``select`` names is compared, of both; ``key`` names the setting that gave ``path``."""
    saved, expected = select_names(saved, select), select_names(expected, select)
    for name, shape in expected.items():
        if name not in saved:
            fix = _fix(select) if select == "adapters" else ("it was saved from another model; load a checkpoint "
                                                             "of this model config")
            raise CheckpointError(f"{_named(path, key)} has no tensor {name}: {fix}")
        if list(saved[name]) != list(shape):
            fix = _fix(select) if select == "adapters" else "use the model config it was saved with"
            raise CheckpointError(f"{_named(path, key)}: tensor {name} has shape {list(saved[name])} there but "
                                  f"{list(shape)} in this model: {fix}")
    extra = sorted(set(saved) - set(expected)) if whole else []
    if extra:
        raise extra_tensors(path, extra, saved, expected, key, select)
    if load_optimizer and not has_optimizer:
        raise CheckpointError(f"{_named(path, key)} has no optimizer state: set checkpoint.load_optimizer=false to "
                              "load the model only")
