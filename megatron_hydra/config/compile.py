"""What ``trainer.compile`` (``models.compile``: each transformer block through ``torch.compile``)
can compile, checked before any worker starts: what dynamo cannot trace, or would recompile at every
step, is refused in one line rather than found at the first step of every rank."""

from __future__ import annotations

from megatron_hydra.config.schema import RunConfig
from megatron_hydra.errors import ConfigError


def check_compile(cfg: RunConfig) -> None:
    """The local GPT blocks, dense (no MoE), with full recompute or none."""
    if not cfg.trainer.compile:
        return
    if cfg.model.arch != "gpt":
        raise ConfigError(f"trainer.compile=true compiles GPT-family blocks, not model.arch={cfg.model.arch}: "
                          "set trainer.compile=false")
    if cfg.model.transformer_impl != "local":
        raise ConfigError("trainer.compile=true compiles the local layers only: set model.transformer_impl=local "
                          "(Transformer Engine brings its own fused kernels) or trainer.compile=false")
    if cfg.recompute.granularity == "selective":
        raise ConfigError("trainer.compile=true does not trace selective recompute (its checkpoint restores the "
                          "tensor-parallel random stream): use recompute.granularity=full or null, "
                          "or trainer.compile=false")
    if cfg.model.moe is not None:
        raise ConfigError("trainer.compile=true with model.moe: the routed experts' data-dependent shapes would "
                          "recompile every step; set trainer.compile=false")
