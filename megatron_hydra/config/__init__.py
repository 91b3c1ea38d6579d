"""Config schema, derivation and validation."""

from megatron_hydra.config.derive import Derived, derive
from megatron_hydra.config.schema import RunConfig, register_configs

__all__ = ["Derived", "RunConfig", "derive", "register_configs"]
