"""The architecture keys of today's open models (``config.architecture``), as an export sees them.

Each Hugging Face family module lists in ``EXPRESSES`` the keys its architecture expresses; a
model that uses any other one has no counterpart in that family (``families.why_not`` checks it
for every family). Keeping the keys in one table means a key added later is refused by every
family that does not name it, rather than exported silently as a model that computes something
else.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable

from megatron_hydra.config.transformer_config import TransformerConfig

# model.<key> -> whether the model uses it (its TransformerConfig, resolved).
USES: Dict[str, Callable[[TransformerConfig], bool]] = {
    "rope_scaling": lambda c: c.rope_scaling is not None,
    "local_rope_theta": lambda c: c.local_rope_theta is not None,
    "qkv_bias": lambda c: c.qkv_bias != c.add_bias_linear,  # a bias on QKV alone (or QKV alone without one)
    "qk_norm": lambda c: c.qk_norm,
    "sliding_window": lambda c: c.sliding_window is not None and bool(c.window_layers),
    # T5's scale of 1 is its own architecture's (its init folds the scale in), not this key.
    "query_pre_attn_scalar": lambda c: c.softmax_scale is not None and c.arch == "gpt",
    "attn_logit_softcapping": lambda c: c.attn_logit_softcapping is not None,
    "final_logit_softcapping": lambda c: c.final_logit_softcapping is not None,
    "zero_centered_gamma": lambda c: c.zero_centered_gamma,
    "post_sublayer_norm": lambda c: c.post_sublayer_norm,
    "scale_embeddings": lambda c: c.scale_embeddings,
    "moe": lambda c: c.moe is not None,
}


def lacks(cfg: TransformerConfig, family: str, has: Iterable[str] = ()) -> str:
    """'' when ``cfg`` uses no key outside ``has``, else why ``family`` cannot express it."""
    extra = [key for key, used in USES.items() if key not in has and used(cfg)]
    return f"{family} has no model.{' or model.'.join(extra)}" if extra else ""


def windowed_everywhere(cfg: TransformerConfig) -> bool:
    """Every layer attends through the sliding window (Mistral's, Qwen3-MoE's only kind)."""
    return cfg.sliding_window is not None and len(cfg.window_layers) == cfg.num_layers
