"""The Hugging Face families an import and an export know, one module each (``convert/<family>.py``:
its ``MODEL_TYPE``, ``ARCH``, ``NAME_MAP``, ``model_config``, ``compatible`` and ``hf_config``).

Import dispatches on ``config.json``'s ``model_type``; export on the checkpoint's ``model.arch``,
then on the first family (in this order) whose ``compatible`` accepts the model: the plainest
family that expresses it, so a Llama-shaped model exports as Llama, not as a look-alike.
"""

from __future__ import annotations

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert import (bert, features, gemma2, gemma3, gpt2, llama, mistral, mixtral, qwen2, qwen3,
                                    qwen3_moe, t5)
from megatron_hydra.errors import ConfigError

FAMILIES = {family.MODEL_TYPE: family for family in (gpt2, llama, bert, t5, mixtral, mistral, qwen2, qwen3, qwen3_moe,
                                                     gemma2, gemma3)}


def _why_not(family, tcfg: TransformerConfig) -> str:
    """Why ``tcfg`` does not export as ``family`` (its ``compatible``); a family that predates the
    architecture keys (``convert.features``) lists none it expresses, so any of them rules it out."""
    why = "" if hasattr(family, "FEATURES") else features.lacks(tcfg, family.MODEL_TYPE)
    return why or family.compatible(tcfg)


def family_for(tcfg: TransformerConfig):
    """The Hugging Face family a model of ours exports as."""
    candidates = [family for family in FAMILIES.values() if family.ARCH == tcfg.arch]
    reasons = [_why_not(family, tcfg) for family in candidates]
    for family, why in zip(candidates, reasons):
        if not why:
            return family
    raise ConfigError(f"this model (position_embedding={tcfg.position_embedding}, normalization={tcfg.normalization}, "
                      f"activation={tcfg.activation}) has no Hugging Face counterpart: {'; '.join(reasons)}")
