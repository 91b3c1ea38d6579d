"""``model=from_checkpoint``: a run's model is the one a checkpoint holds.

A fine-tune of an imported model, or of another run's checkpoint, needs that model's exact shape.
It is read from the checkpoint's ``meta.json`` (the config the checkpoint was saved with) as data:
bounded, without YAML aliases or tags, without Hydra keys, interpolations kept as text
(``config.io.config_data``), and typed against the model schema. A checkpoint never becomes a
Hydra config search path: nothing in it can name a callback, a ``_target_`` or a ``defaults`` list.
The user's own ``model.*`` overrides (``model.seq_length=4096``) apply on top, as they would to any
``model=`` preset.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_hydra.checkpoint import store
from megatron_hydra.config.io import config_data
from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.errors import CheckpointError, ConfigError, one_line

FROM_CHECKPOINT = "from_checkpoint"  # the model preset (conf/model/from_checkpoint.yaml) and its name


def stored_model(path: str) -> dict:
    """The ``model`` section of the config stored in the checkpoint at ``path``, as plain data."""
    meta = store.validate(path)
    text = meta.get("config")
    if not isinstance(text, str):
        raise CheckpointError(f"{path}/{store.META} holds no config, so it cannot say which model it holds: "
                              "give the model as model=<preset> instead of model=from_checkpoint")
    model = config_data(text, f"{path}/{store.META}").get("model")
    if not isinstance(model, dict):
        raise CheckpointError(f"{path}/{store.META}: its config has no model section: the checkpoint is damaged "
                              "or not from megatron-hydra")
    return model


def model_config(load: Optional[str], overrides: Sequence[Tuple[str, Any]] = ()) -> DictConfig:
    """The model of the checkpoint ``load`` (``checkpoint.load``) with ``overrides`` (pairs of a key
    below ``model.`` and its value) applied, typed as ``ModelConfig``. A ``DictConfig``, in which a
    stored ``${...}`` stays escaped text (a dataclass would turn it back into an interpolation)."""
    if not load:
        raise ConfigError(f"model={FROM_CHECKPOINT} takes the model from checkpoint.load, which is not set: add "
                          "checkpoint.load=<checkpoint directory>, or choose a model preset (model=gpt_tiny, ...)")
    node = OmegaConf.create(stored_model(load))
    source = f"{load}/{store.META}"
    try:
        typed = OmegaConf.merge(OmegaConf.structured(ModelConfig), node)
    except OmegaConfBaseException as e:
        raise CheckpointError(f"{source}: its model config does not fit this version's schema "
                              f"({one_line(e)})") from None
    if typed.name == FROM_CHECKPOINT:
        raise CheckpointError(f"{source}: its model is named {FROM_CHECKPOINT}, which no saved model is: refused")
    for key, value in overrides:
        try:
            OmegaConf.update(typed, key, value, merge=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"model.{key}={value!r}: {one_line(e)}") from None
    OmegaConf.to_object(typed)  # every value of the right type now, not when a worker reads it
    return typed
