"""The Hugging Face families an import and an export know, one module each (``convert/<family>.py``:
its ``MODEL_TYPE``, ``ARCH``, ``NAME_MAP``, ``model_config``, ``compatible`` and ``hf_config``, and
``EXPRESSES``: the architecture keys of ``convert.features`` it expresses, none where absent).

Import dispatches on ``config.json``'s ``model_type``; export on the checkpoint's ``model.arch``,
then on the first family (in this order) that expresses the model (``why_not``): the plainest
one, so a Llama-shaped model exports as Llama, not as a look-alike.
"""

from __future__ import annotations

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert import (bert, features, gemma2, gemma3, gpt2, llama, mistral, mixtral, qwen2, qwen3,
                                    qwen3_moe, t5)
from megatron_hydra.errors import ConfigError

FAMILIES = {family.MODEL_TYPE: family for family in (gpt2, llama, bert, t5, mixtral, mistral, qwen2, qwen3, qwen3_moe,
                                                     gemma2, gemma3)}


def why_not(family, tcfg: TransformerConfig) -> str:
    """Why ``tcfg`` does not export as ``family``, or '': an architecture key (``convert.features``)
    outside the family's ``EXPRESSES``, checked here for every family so that none can export a
    model that computes something its architecture does not, else the family's own
    ``compatible``."""
    return features.lacks(tcfg, family.MODEL_TYPE, getattr(family, "EXPRESSES", ())) or family.compatible(tcfg)


def family_for(tcfg: TransformerConfig):
    """The Hugging Face family a model of ours exports as."""
    candidates = [family for family in FAMILIES.values() if family.ARCH == tcfg.arch]
    reasons = [why_not(family, tcfg) for family in candidates]
    for family, why in zip(candidates, reasons):
        if not why:
            return family
    raise ConfigError(f"this model (position_embedding={tcfg.position_embedding}, normalization={tcfg.normalization}, "
                      f"activation={tcfg.activation}) has no Hugging Face counterpart: {'; '.join(reasons)}")
