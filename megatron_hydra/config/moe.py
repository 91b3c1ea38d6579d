"""``model.moe``, ``parallel.expert_parallel_size`` and ``expert_tensor_parallel_size``: validated and turned into what the model
reads (``TransformerConfig.moe`` and ``moe_layers``). Part of ``config.derive``: pure, one-line
``ConfigError`` per violation."""

from __future__ import annotations

from typing import Optional, Tuple

from megatron_hydra.config.schema import MoEConfig, RunConfig
from megatron_hydra.config.transformer_config import MoESpec, by_name
from megatron_hydra.errors import ConfigError

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "swiglu", "geglu")


def _layers(freq, num_layers: int) -> Tuple[int, ...]:
    """The MoE layers ``model.moe.layer_freq`` names: every n-th from 0, or a 0/1 per layer."""
    if isinstance(freq, int) and not isinstance(freq, bool):
        if freq < 1:
            raise ConfigError(f"model.moe.layer_freq={freq} must be >= 1 (every n-th layer) or a 0/1 list")
        return tuple(range(0, num_layers, freq))
    flags = list(freq)
    if len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise ConfigError(f"model.moe.layer_freq={flags} must hold one 0 or 1 per layer (model.num_layers="
                          f"{num_layers}), or be an int n (every n-th layer)")
    return tuple(i for i, f in enumerate(flags) if f)


def moe_spec(cfg: RunConfig, ffn: int, dp: int, tp: int, cp: int) -> Tuple[Optional[MoESpec], Tuple[int, ...]]:
    """The experts of every MoE layer and which layers have them; (None, ()) for a dense model."""
    moe, ep, par = cfg.model.moe, cfg.parallel.expert_parallel_size, cfg.parallel
    etp = par.expert_tensor_parallel_size
    if ep < 1:
        raise ConfigError(f"parallel.expert_parallel_size={ep} must be a positive integer")
    if etp is not None and etp not in (1, tp):
        raise ConfigError(f"parallel.expert_tensor_parallel_size={etp} must be 1 (whole experts) or "
                          f"parallel.tensor_parallel_size={tp} (experts split like the dense MLP), or null (the latter)")
    if moe is None:
        if ep > 1 or (etp is not None and etp != tp):
            raise ConfigError(f"parallel.expert_parallel_size={ep} and expert_tensor_parallel_size={etp} split the "
                              "experts of an MoE model, but model.moe is null: use an MoE model (model=moe_tiny) "
                              "or leave them at 1 and null")
        return None, ()
    whole = etp == 1 and tp > 1
    what = "model.moe"
    if cfg.model.arch != "gpt" or cfg.model.transformer_impl != "local":
        raise ConfigError(f"{what} runs the GPT family on model.transformer_impl=local; got model.arch="
                          f"{cfg.model.arch}, model.transformer_impl={cfg.model.transformer_impl}")
    if moe.num_experts < 1 or not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(f"model.moe.num_experts={moe.num_experts} and model.moe.top_k={moe.top_k} need "
                          "1 <= top_k <= num_experts")
    if cfg.model.activation not in ACTIVATIONS:
        raise ConfigError(f"model.activation={cfg.model.activation} has no expert MLP: use one of {', '.join(ACTIVATIONS)}")
    if min(moe.aux_loss_coeff, moe.z_loss_coeff, moe.expert_bias_rate) < 0:
        raise ConfigError("model.moe.aux_loss_coeff, z_loss_coeff and expert_bias_rate must be >= 0")
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        raise ConfigError(f"model.moe.capacity_factor={moe.capacity_factor} must be > 0, or null (dropless)")
    expert_ffn = moe.ffn_hidden_size or ffn
    for key, size in (("model.moe.ffn_hidden_size", expert_ffn), ("model.moe.shared_ffn_hidden_size",
                                                                  moe.shared_ffn_hidden_size)):
        if size < 0 or (size % tp and not (whole and key == "model.moe.ffn_hidden_size")):
            raise ConfigError(f"{key}={size} must be a multiple of parallel.tensor_parallel_size={tp}")
    span, over = (dp * tp, "data- x tensor-parallel") if whole else (dp, "data-parallel")
    if moe.num_experts % ep or span % ep:
        raise ConfigError(f"parallel.expert_parallel_size={ep} must divide model.moe.num_experts={moe.num_experts} "
                          f"and the {over} size {span} (experts are split over those ranks)")
    if whole and not par.sequence_parallel and (cfg.model.seq_length // cp) % tp:
        raise ConfigError(f"parallel.expert_tensor_parallel_size=1 splits each rank's {cfg.model.seq_length // cp} "
                          f"tokens over parallel.tensor_parallel_size={tp} ranks: use a model.seq_length that "
                          "divides evenly, or parallel.sequence_parallel=true")
    if par.data_parallel != "ddp":
        raise ConfigError(f"parallel.data_parallel={par.data_parallel} is not supported with model.moe: use "
                          "parallel.data_parallel=ddp (with optim.distributed_optimizer for sharded state)")
    if cp > 1 and par.sequence_parallel:
        raise ConfigError("model.moe with both parallel.context_parallel_size > 1 and parallel.sequence_parallel "
                          "is not supported (the router's losses would need a cp x tp group): turn one off")
    # Every model.moe key MoESpec names, as it is; the expert size resolved (layer_freq: the layers).
    spec = MoESpec(**{**by_name(moe, MoEConfig, MoESpec), "ffn_hidden_size": expert_ffn})
    return spec, _layers(moe.layer_freq, cfg.model.num_layers)
