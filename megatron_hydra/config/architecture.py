"""The architecture keys of today's open models (docs/models.md): RoPE scaling, QKV-only bias,
QK-norm, sliding-window attention, soft-capping, Gemma's norms and embedding scale. Validated and
turned into what the model reads (``TransformerConfig``). Part of ``config.derive``: pure, one-line
``ConfigError`` per violation; every key's default keeps a model as it was."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from megatron_hydra.config.schema import RopeScalingConfig, RunConfig
from megatron_hydra.config.transformer_config import RopeScaling, by_name
from megatron_hydra.errors import ConfigError

# Keys only the GPT family's blocks read (BERT and T5 keep their own published architectures).
GPT_ONLY = ("rope_scaling", "local_rope_theta", "qk_norm", "query_pre_attn_scalar", "sliding_window",
            "attn_logit_softcapping", "final_logit_softcapping", "zero_centered_gamma", "post_sublayer_norm",
            "scale_embeddings")


def window_layers(pattern: Any, num_layers: int) -> Tuple[int, ...]:
    """The layers ``model.sliding_window_pattern`` windows: all but every n-th (n=1: all), or
    those marked 1 in a 0/1 list with one entry per layer."""
    if isinstance(pattern, int) and not isinstance(pattern, bool):
        if pattern < 1:
            raise ConfigError(f"model.sliding_window_pattern={pattern} must be >= 1 (every n-th layer global; "
                              "1: every layer windowed) or a 0/1 list")
        return tuple(range(num_layers)) if pattern == 1 else tuple(i for i in range(num_layers) if (i + 1) % pattern)
    flags = list(pattern)
    if len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise ConfigError(f"model.sliding_window_pattern={flags} must hold one 0 or 1 per layer (model.num_layers="
                          f"{num_layers}), or be an int n (every n-th layer global)")
    return tuple(i for i, f in enumerate(flags) if f)


def _rope_scaling(cfg: RunConfig) -> Optional[RopeScaling]:
    rs = cfg.model.rope_scaling
    if rs is None:
        return None
    if not rs.factor >= 1:
        raise ConfigError(f"model.rope_scaling.factor={rs.factor} must be >= 1 (1: no scaling)")
    if rs.original_max_position_embeddings < 1:
        raise ConfigError(f"model.rope_scaling.original_max_position_embeddings={rs.original_max_position_embeddings} "
                          "must be a positive integer")
    if rs.type == "llama3" and not 0 < rs.low_freq_factor < rs.high_freq_factor:
        raise ConfigError(f"model.rope_scaling.low_freq_factor={rs.low_freq_factor} and high_freq_factor="
                          f"{rs.high_freq_factor} need 0 < low_freq_factor < high_freq_factor")
    if rs.type == "yarn" and not 0 < rs.beta_slow < rs.beta_fast:
        raise ConfigError(f"model.rope_scaling.beta_slow={rs.beta_slow} and beta_fast={rs.beta_fast} need "
                          "0 < beta_slow < beta_fast")
    if rs.attention_factor is not None and not rs.attention_factor > 0:
        raise ConfigError(f"model.rope_scaling.attention_factor={rs.attention_factor} must be > 0, or null")
    return RopeScaling(**by_name(rs, RopeScalingConfig, RopeScaling))


# What the Transformer Engine blocks (models/te_layers.py) do not express: their fused
# LayerNormLinear carries one bias switch and a plain (1 * w) norm, DotProductAttention takes no
# score soft-capping, and the rest would need TE options nothing here has run on a GPU.
# RoPE scaling and scaled embeddings are computed outside TE's modules, so they run on either.
_NOT_ON_TE = ("qk_norm", "sliding_window", "attn_logit_softcapping", "zero_centered_gamma", "post_sublayer_norm",
              "local_rope_theta")


def _check_transformer_engine(m) -> None:
    used = [key for key in _NOT_ON_TE if getattr(m, key) not in (None, False)]
    if m.qkv_bias is not None and m.qkv_bias != m.add_bias_linear:
        used.append("qkv_bias")
    if used:
        raise ConfigError(f"model.{used[0]} is not supported by model.transformer_impl=transformer_engine: use "
                          "model.transformer_impl=local (checkpoints load under either)")


def resolve(cfg: RunConfig) -> Dict[str, Any]:
    """The TransformerConfig fields these keys set (resolved, checked)."""
    m = cfg.model
    if m.arch != "gpt":
        used = [key for key in GPT_ONLY if getattr(m, key) not in (None, False)]
        if used:
            raise ConfigError(f"model.{used[0]} is a GPT-family key; model.arch={m.arch} keeps its published "
                              f"architecture: set it to its default")
    if m.position_embedding != "rope" and (m.rope_scaling is not None or m.local_rope_theta is not None):
        raise ConfigError("model.rope_scaling and model.local_rope_theta act on rotary embeddings: set "
                          "model.position_embedding=rope, or leave them null")
    for key in ("local_rope_theta", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        value = getattr(m, key)
        if value is not None and not value > 0:
            raise ConfigError(f"model.{key}={value} must be > 0, or null (off)")
    window = m.sliding_window
    if window is not None and window < 1:
        raise ConfigError(f"model.sliding_window={window} must be a positive number of tokens, or null (no window)")
    layers = window_layers(m.sliding_window_pattern, m.num_layers) if window is not None else ()
    if m.local_rope_theta is not None and not layers:
        raise ConfigError("model.local_rope_theta is the windowed layers' RoPE base, but no layer is windowed: set "
                          "model.sliding_window, or leave local_rope_theta null")
    if m.transformer_impl == "transformer_engine":
        _check_transformer_engine(m)
    if m.qk_norm and m.normalization != "rmsnorm":
        raise ConfigError("model.qk_norm=true is an RMSNorm over each head: it needs model.normalization=rmsnorm")
    return dict(
        rope_scaling=_rope_scaling(cfg),
        window_layers=layers,
        softmax_scale=None if m.query_pre_attn_scalar is None else m.query_pre_attn_scalar ** -0.5,
    )
