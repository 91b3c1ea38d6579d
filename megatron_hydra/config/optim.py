"""What ``optim=muon`` runs with (``parallel.muon``); the rest of ``optim`` is checked by ``ranges``."""

from __future__ import annotations

from megatron_hydra.config.schema import RunConfig
from megatron_hydra.errors import ConfigError


def check_optim(cfg: RunConfig) -> None:
    """Muon orthogonalises whole matrices: the layouts that hold only a slice of one on a rank
    (other than TP's, which it gathers, and the distributed optimizer's, whose ranks own whole
    matrices: ``parallel.muon_owned``) and Transformer Engine's fused gate+up are refused here."""
    o = cfg.optim
    if o.name != "muon":
        return
    if not 0 <= o.muon_momentum < 1:
        raise ConfigError(f"optim.muon_momentum={o.muon_momentum} must be in [0, 1): 0.95 is the usual value")
    if o.muon_ns_steps < 1:
        raise ConfigError(f"optim.muon_ns_steps={o.muon_ns_steps} must be >= 1: 5 is the published value")
    if o.muon_adam_lr is not None and o.muon_adam_lr <= 0:
        raise ConfigError(f"optim.muon_adam_lr={o.muon_adam_lr} must be > 0, or null for optim.lr")
    if cfg.parallel.data_parallel == "fsdp":
        raise ConfigError("optim=muon with parallel.data_parallel=fsdp is not supported: FSDP keeps only rows of "
                          "each matrix on a rank; set parallel.data_parallel=ddp")
    if cfg.model.transformer_impl != "local":
        raise ConfigError(f"optim=muon with model.transformer_impl={cfg.model.transformer_impl} is not supported "
                          "(its fused gate+up weight would be orthogonalised as one matrix): set "
                          "model.transformer_impl=local")
    if cfg.peft.name != "none":
        raise ConfigError(f"optim=muon with peft={cfg.peft.name} is not supported (low-rank adapters are not the "
                          "hidden matrices Muon is for): use optim=adamw")
